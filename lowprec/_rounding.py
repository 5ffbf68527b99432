"""Rounding modes and overflow policies: names, validation, and the integer rounding step.

Every mode is a named string; :func:`round_shift` is the one place that decides, from the
bits shifted out of an integer significand, whether to round the magnitude up. The checks
here are called only by the option objects of ``_options.py``. The random words of
stochastic rounding come from ``_random.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

import lowprec_formats as _data

from ._format import ElementFormat

ROUNDING_MODES: tuple[str, ...] = _data.ROUNDING_MODES
OVERFLOW_POLICIES: tuple[str, ...] = _data.OVERFLOW_POLICIES

# E8M0 is unsigned, so rounding to a power of two below/above is exactly down/up.
_E8M0_ALIASES = {"floor": "down", "ceil": "up"}


def check_rounding(fmt: ElementFormat, rounding: str) -> str:
    """Validates ``rounding`` for ``fmt``; returns the canonical mode name.

    Example:
        >>> from lowprec._format import element_format
        >>> check_rounding(element_format("e8m0"), "floor")
        'down'
    """
    if not isinstance(rounding, str):
        raise TypeError(f"rounding must be a string, got {rounding!r}; valid modes: {ROUNDING_MODES}")
    if rounding in _E8M0_ALIASES:
        if fmt.signed or fmt.mantissa_bits:
            raise ValueError(
                f"rounding={rounding!r} is only defined for the E8M0 scale format (powers of "
                f"two), not {fmt.name!r}; use 'down' or 'up' for directed rounding. "
                f"Valid modes: {ROUNDING_MODES}"
            )
        return _E8M0_ALIASES[rounding]
    if rounding not in ROUNDING_MODES:
        extra = " (and 'floor'/'ceil' for e8m0)" if fmt.signed or fmt.mantissa_bits else ", 'floor', 'ceil'"
        raise ValueError(f"unknown rounding mode {rounding!r}; valid modes: {ROUNDING_MODES}{extra}")
    return rounding


def check_overflow(overflow: str) -> str:
    """Validates an overflow policy name (``"ieee"`` or ``"saturate"``)."""
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(
            f"unknown overflow policy {overflow!r}; valid policies: {OVERFLOW_POLICIES}"
        )
    return overflow


def rounds_away_on_overflow(rounding: str, sign):
    """IEEE 754 §7.4: whether an overflowing result goes to infinity (True) or ±max.

    Round-to-nearest modes (and stochastic) carry to infinity; ``toward_zero`` never does;
    ``up`` does for positive values and ``down`` for negative ones.
    """
    if rounding in ("nearest_even", "nearest_away", "stochastic"):
        return jnp.ones_like(sign, dtype=bool)  # *_like: keeps sign's sharding
    if rounding == "toward_zero":
        return jnp.zeros_like(sign, dtype=bool)
    if rounding == "up":
        return sign == 0
    if rounding == "down":
        return sign != 0
    raise AssertionError(rounding)


def round_shift(sig, shift, sign, rounding: str, random_bits=None):
    """Shifts the unsigned significand ``sig`` right by ``shift`` bits, rounding as named.

    Args:
      sig: unsigned integer array (uint32 or uint64), the magnitude in units of 2^k.
      shift: int32 array, ≥ 1, number of low bits to drop (may exceed the width).
      sign: uint array, 1 for negative values (directed modes depend on it).
      rounding: canonical mode name.
      random_bits: uint32 array, one word r per element (stochastic only): the magnitude
        rounds up iff r < frac × 2^32, frac being the dropped fraction.

    Returns:
      int32 array: the rounded magnitude in units of 2^(k + shift).
    """
    udt = sig.dtype
    width = jnp.iinfo(udt).bits
    one = jnp.asarray(1, udt)
    # Clamping keeps every shift in range; at width-1 the whole significand (< 2^(width-1))
    # lies below the half point, so the classification of what was dropped is unchanged.
    s = jnp.minimum(shift, width - 1).astype(udt)
    if rounding != "stochastic":
        # Round by adding a bias below the cut, then shifting: the carry does the rest.
        # sig < 2^(width-1) (a magnitude) and bias <= 2^s - 1 < 2^(width-1): no wrap-around.
        if rounding == "nearest_even":  # half - 1, plus 1 when the kept lsb is odd
            bias = lax.shift_left(one, s - one) - one + (lax.shift_right_logical(sig, s) & one)
        elif rounding == "nearest_away":
            bias = lax.shift_left(one, s - one)
        elif rounding == "toward_zero":
            bias = jnp.zeros((), udt)
        elif rounding in ("up", "down"):
            away = (sign == 0) if rounding == "up" else (sign != 0)
            bias = jnp.where(away, lax.shift_left(one, s) - one, jnp.zeros((), udt))
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
