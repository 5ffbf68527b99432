"""Rounding modes and overflow policies: the :class:`Rounding` and :class:`Overflow` enums,
their validation, and the integer rounding step.

Modes and policies are ``str``-valued enums, so ``"up"`` and ``Rounding.UP`` are
interchangeable wherever lowprec takes a rounding. :func:`round_shift` is the one place that
decides, from the bits shifted out of an integer significand, whether to round the magnitude
up; the encoders ask the members what else depends on the mode (:attr:`Rounding.nearest`,
:meth:`Rounding.overflows_to_inf`). The checks here are called only by the option objects of
``_options.py``. The random words of stochastic rounding come from ``_random.py``.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Union

import lowprec_formats as _data

from ._lazy import lazy_module

# Imported on first use: the checkpoint command line's native path needs no JAX.
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")

if TYPE_CHECKING:  # type-only: _format imports this module (through _tapered)
    from ._format import ElementFormat


class DocumentedStr(str, enum.Enum):
    """A ``str`` enum whose members are written ``NAME = (value, docstring)`` (the base of
    :class:`Rounding`, :class:`Overflow` and ``ScaleRule``)."""

    def __new__(cls, value: str, doc: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.__doc__ = doc
        return member

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class Rounding(DocumentedStr):
    """How a value between two neighbouring values of a format is rounded.

    Members are strings, so ``"up"`` and ``Rounding.UP`` are interchangeable everywhere a
    rounding is taken; validation returns the member. Each member's own docstring says what
    it does; what happens beyond the largest finite value is the :class:`Overflow` policy's
    business, with the mode deciding the direction (IEEE 754 §7.4).

    Example:
        >>> Rounding("up") is Rounding.UP, Rounding.NEAREST_EVEN == "nearest_even"
        (True, True)
    """

    NEAREST_EVEN = (
        "nearest_even",
        "To the nearer neighbour; a tie to the one whose significand ends in an even bit (IEEE "
        "754 roundTiesToEven; in P3109 formats of precision 1 ties compare the codes' last "
        "bit; E8M0, whose values are powers of two, takes ties up). The default: with "
        "overflow='ieee' it is ml_dtypes' astype bit for bit.",
    )
    NEAREST_AWAY = (
        "nearest_away",
        "To the nearer neighbour; a tie to the one of larger magnitude (IEEE 754 "
        "roundTiesToAway; microxcaling's 'nearest'; NVIDIA's cvt.rna.tf32.f32 for TF32).",
    )
    NEAREST_TOWARD_ZERO = (
        "nearest_toward_zero",
        "To the nearer neighbour; a tie to the one of smaller magnitude (round half toward "
        "zero; no IEEE 754 attribute). ggml's FP4 quantizers (llama.cpp best_index_mxfp4, "
        "gguf-py gguf.quants.MXFP4: the first of equally near table entries, smaller "
        "magnitudes first); with ScaleRule.FLOOR_LOG2F, ggml's MXFP4 bit for bit, up to the "
        "sign of zero (ggml writes every zero as +0). Overflows as the other nearest modes do.",
    )
    TOWARD_ZERO = (
        "toward_zero",
        "To the neighbour of smaller magnitude (truncation). A finite value beyond the "
        "largest rounds to ±max under either overflow policy.",
    )
    UP = (
        "up",
        "To the neighbour toward +infinity (the smaller magnitude for negative values). "
        "Beyond the largest finite value, positive values overflow as the nearest modes do "
        "(overflow='ieee') and negative ones round to -max.",
    )
    DOWN = (
        "down",
        "To the neighbour toward -infinity (the smaller magnitude for positive values). "
        "Beyond the largest finite value, negative values overflow as the nearest modes do "
        "(overflow='ieee') and positive ones round to +max.",
    )
    STOCHASTIC = (
        "stochastic",
        "Away from zero with probability equal to the value's distance from the neighbour "
        "of smaller magnitude, in units of the gap, resolved to 16 bits: element i rounds "
        "away iff its word r_i < frac_i * 2**16 (words from key= as lowprec.random_bits "
        "draws them, or caller random_bits=; caller uint32 words compare with "
        "frac_i * 2**32). Needs key= or random_bits=. Overflows as the nearest modes do.",
    )
    FLOOR = (
        "floor",
        "E8M0 only: the largest power of two not above the value, the MX floor rule; "
        "validation turns it into DOWN (the same thing for this unsigned format).",
    )
    CEIL = (
        "ceil",
        "E8M0 only: the smallest power of two not below the value; validation turns it "
        "into UP (the same thing for this unsigned format).",
    )

    @property
    def nearest(self) -> bool:
        """Whether the mode rounds to the nearer neighbour (``NEAREST_EVEN``, ``NEAREST_AWAY``,
        ``NEAREST_TOWARD_ZERO``)."""
        return self in (Rounding.NEAREST_EVEN, Rounding.NEAREST_AWAY, Rounding.NEAREST_TOWARD_ZERO)

    @property
    def directed(self) -> bool:
        """Whether the mode rounds in a fixed direction (``TOWARD_ZERO``, ``UP``, ``DOWN``;
        validation has already turned E8M0's ``FLOOR``/``CEIL`` into ``DOWN``/``UP``)."""
        return self in (Rounding.TOWARD_ZERO, Rounding.UP, Rounding.DOWN)

    def away_from_zero(self, sign):
        """For a directed mode: whether a magnitude with ``sign`` (1: negative) rounds away
        from zero, as a bool array of ``sign``'s shape (never for ``TOWARD_ZERO``; for
        positive values under ``UP``, negative ones under ``DOWN``)."""
        if self is Rounding.UP:
            return sign == 0
        if self is Rounding.DOWN:
            return sign != 0
        if self is Rounding.TOWARD_ZERO:
            return jnp.zeros_like(sign, dtype=bool)  # *_like: keeps sign's sharding
        raise AssertionError(f"{self} is not a directed mode")

    def overflows_to_inf(self, sign):
        """IEEE 754 §7.4: whether a result beyond the largest finite value goes to infinity
        (True) or to ±max, as a bool array of ``sign``'s shape.

        The nearest modes and stochastic rounding carry to infinity; a directed mode does
        exactly where it rounds the magnitude away from zero.
        """
        if self.nearest or self is Rounding.STOCHASTIC:
            return jnp.ones_like(sign, dtype=bool)  # *_like: keeps sign's sharding
        return self.away_from_zero(sign)


class Overflow(DocumentedStr):
    """What an encoder does with values beyond a format's largest finite value, and with ±inf.

    Members are strings, so ``"saturate"`` and ``Overflow.SATURATE`` are interchangeable.

    Example:
        >>> Overflow("ieee") is Overflow.IEEE
        True
    """

    IEEE = (
        "ieee",
        "What ml_dtypes' astype does (the default): beyond the largest finite value, and for "
        "±inf, the format's overflow code: ±inf where it has infinities (fp16, bf16, e5m2, "
        "...), its NaN where it has a NaN but no infinity (e4m3, the fnuz formats, e8m0), "
        "±max where it has neither (e2m1, FP6). Finite values go there only where the "
        "rounding mode rounds away from zero (IEEE 754 §7.4); otherwise they round to ±max.",
    )
    SATURATE = (
        "saturate",
        "Finite values beyond the largest and ±inf clamp to ±max finite, in every rounding "
        "mode. NaN stays the format's NaN (formats without one give a zero, as under 'ieee').",
    )


ROUNDING_MODES: tuple[str, ...] = _data.ROUNDING_MODES
OVERFLOW_POLICIES: tuple[str, ...] = _data.OVERFLOW_POLICIES

# E8M0 is unsigned, so rounding to a power of two below/above is exactly down/up.
_E8M0_ALIASES = {Rounding.FLOOR: Rounding.DOWN, Rounding.CEIL: Rounding.UP}

assert tuple(r.value for r in Rounding if r not in _E8M0_ALIASES) == ROUNDING_MODES, (
    "formats/ lists other rounding modes")
assert tuple(p.value for p in Overflow) == OVERFLOW_POLICIES, "formats/ lists other policies"


def check_rounding(fmt: ElementFormat, rounding: Union[str, Rounding]) -> Rounding:
    """Validates ``rounding`` for ``fmt``; returns its :class:`Rounding` member (E8M0's
    ``"floor"``/``"ceil"`` as ``DOWN``/``UP``).

    Example:
        >>> from lowprec._format import element_format
        >>> check_rounding(element_format("e8m0"), "floor")
        <Rounding.DOWN: 'down'>
    """
    if not isinstance(rounding, str):
        raise TypeError(f"rounding must be a string, got {rounding!r}; valid modes: {ROUNDING_MODES}")
    e8m0_only = fmt.signed or fmt.mantissa_bits
    try:
        member = Rounding(rounding)
    except ValueError:
        extra = " (and 'floor'/'ceil' for e8m0)" if e8m0_only else ", 'floor', 'ceil'"
        raise ValueError(
            f"unknown rounding mode {rounding!r}; valid modes: {ROUNDING_MODES}{extra}"
        ) from None
    if member in _E8M0_ALIASES:
        if e8m0_only:
            raise ValueError(
                f"rounding={member.value!r} is only defined for the E8M0 scale format (powers "
                f"of two), not {fmt.name!r}; use 'down' or 'up' for directed rounding. "
                f"Valid modes: {ROUNDING_MODES}"
            )
        return _E8M0_ALIASES[member]
    return member


def check_overflow(overflow: Union[str, Overflow]) -> Overflow:
    """Validates an overflow policy (``"ieee"`` or ``"saturate"``); returns its member."""
    try:
        return Overflow(overflow)
    except (ValueError, TypeError):
        raise ValueError(
            f"unknown overflow policy {overflow!r}; valid policies: {OVERFLOW_POLICIES}"
        ) from None


def round_shift(sig, shift, sign, rounding: Union[str, Rounding], random_bits=None):
    """Shifts the unsigned significand ``sig`` right by ``shift`` bits, rounding as named.

    Args:
      sig: unsigned integer array (uint32 or uint64), the magnitude in units of 2^k.
      shift: int32 array, ≥ 1, number of low bits to drop (may exceed the width).
      sign: uint array, 1 for negative values (directed modes depend on it).
      rounding: a canonical mode (a :class:`Rounding` member or its value; not FLOOR/CEIL).
      random_bits: uint32 array, one word r per element (stochastic only): the magnitude
        rounds up iff r < frac × 2^32, frac being the dropped fraction.

    Returns:
      int32 array: the rounded magnitude in units of 2^(k + shift).
    """
    rounding = Rounding(rounding)
    udt = sig.dtype
    width = jnp.iinfo(udt).bits
    one = jnp.asarray(1, udt)
    # Clamping keeps every shift in range; at width-1 the whole significand (< 2^(width-1))
    # lies below the half point, so the classification of what was dropped is unchanged.
    s = jnp.minimum(shift, width - 1).astype(udt)
    if rounding is not Rounding.STOCHASTIC:
        # Round by adding a bias below the cut, then shifting: the carry does the rest.
        # sig < 2^(width-1) (a magnitude) and bias <= 2^s - 1 < 2^(width-1): no wrap-around.
        if rounding is Rounding.NEAREST_EVEN:  # half - 1, plus 1 when the kept lsb is odd
            bias = lax.shift_left(one, s - one) - one + (lax.shift_right_logical(sig, s) & one)
        elif rounding is Rounding.NEAREST_AWAY:
            bias = lax.shift_left(one, s - one)
        elif rounding is Rounding.NEAREST_TOWARD_ZERO:  # half - 1: a tie stays below
            bias = lax.shift_left(one, s - one) - one
        elif rounding is Rounding.TOWARD_ZERO:
            bias = jnp.zeros((), udt)
        elif rounding.directed:  # UP, DOWN: all ones below the cut where it rounds away
            bias = jnp.where(rounding.away_from_zero(sign), lax.shift_left(one, s) - one,
                             jnp.zeros((), udt))
        else:
            raise AssertionError(rounding)
        return lax.shift_right_logical(sig + bias, s).astype(jnp.int32)
    # Stochastic: round up iff r < (rem / 2^shift) * 2^32, compared exactly as integers.
    q = lax.shift_right_logical(sig, s)
    rem = sig & (lax.shift_left(one, s) - one)
    r = random_bits.astype(udt)
    small = shift <= 32
    lsh = jnp.clip(32 - shift, 0, 31).astype(udt)
    thr_small = lax.shift_left(rem, lsh)  # rem < 2^shift, so this is < 2^32
    k = jnp.clip(shift - 32, 0, width - 1).astype(udt)
    # ceil(rem / 2^k) without overflow: r < x (real) <=> r < ceil(x).
    thr_big = jnp.where(rem == 0, 0, lax.shift_right_logical(rem - one, k) + one).astype(udt)
    up = r < jnp.where(small, thr_small, thr_big)
    return q.astype(jnp.int32) + up.astype(jnp.int32)
