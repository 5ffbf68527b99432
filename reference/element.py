"""Exact, slow reference codec for lowprec's element formats.

Every format is derived from the raw fields of :data:`lowprec_formats.ELEMENT_FORMATS`
(``sign_bits``, ``exponent_bits``, ``mantissa_bits``, ``bias``, ``inf``, ``nan``, ``zero``,
``subnormals``, ``nan_code``); nothing here uses JAX, ml_dtypes or lowprec. Values are
:class:`fractions.Fraction` and rounding is done on the exact rational value of the input, one
element at a time, with Python integers. It is meant to be read, not to be fast.

Value of a code (IEEE 754-2019 §3.4, "Binary interchange format encodings"; OCP 8-bit
Floating Point Specification (OFP8) rev. 1.0 §4; OCP Microscaling Formats (MX) v1.0 §5.3):

    "If E = 0 and T ≠ 0, then v is a subnormal number: v = (−1)^S × b^emin × (0 + 2^(1−p) × T)";
    "If 1 ≤ E ≤ 2^w − 2, then v = (−1)^S × 2^(E−bias) × (1 + 2^(1−p) × T)".

E4M3 (OFP8 §4): "the exponent field of all ones is used for normal numbers except for the
S.1111.111 bit pattern, which is reserved for NaN"; no infinities. E2M1 (MX v1.0 §5.3.3) and the
FP6 formats E2M3/E3M2 (MX v1.0 §5.3.2) have no infinities and no NaN. E8M0 (MX v1.0 §5.4.1) is
"an unsigned representation of a conventional biased Float32 exponent": 2^(E−127), "0xFF" is NaN,
and there is no zero and no sign. The "fnuz" FP8 formats (ml_dtypes float8_e4m3fnuz,
float8_e5m2fnuz, float8_e4m3b11fnuz) and IEEE P3109's signed formats have "finite, no negative
zero" layouts: the code 1000...0 is their only NaN. P3109 (interim report) puts ±infinity at the
largest magnitude codes of its extended formats. The MX INT8 element (MX v1.0 §5.3.4) is "a
signed two's complement integer" with an implicit scale of 2^-6.

Rounding (IEEE 754-2019 §4.3): "roundTiesToEven, the floating-point number nearest to the
infinitely precise result shall be delivered; if the two nearest floating-point numbers
bracketing an unrepresentable infinitely precise result are equally near, the one with an even
least significant digit shall be delivered"; roundTiesToAway delivers "the one with larger
magnitude"; roundTowardPositive / roundTowardNegative / roundTowardZero deliver the closest
value "no less than" / "no greater than" / "no greater in magnitude than" the exact result.

Overflow (IEEE 754-2019 §7.4): "roundTiesToEven and roundTiesToAway carry all overflows to ∞
with the sign of the intermediate result. roundTowardZero carries all overflows to the format's
largest finite number with the sign of the intermediate result. roundTowardNegative carries
positive overflows to the format's largest finite number, and carries negative overflows to
−∞. roundTowardPositive carries negative overflows to the format's most negative finite
number, and carries positive overflows to +∞." A format without ∞ uses its NaN code instead
(E4M3, E8M0, as ml_dtypes does) or its largest finite value if it has no NaN either (E2M1).

Example:
    >>> import numpy as np
    >>> value_of_code("e4m3", 0x7E)
    Fraction(448, 1)
    >>> encode("e4m3", np.array([464.0, 465.0, -0.0], np.float32)).tolist()
    [126, 127, 128]
    >>> decode("e2m1", all_codes("e2m1")).tolist()[:8]
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import Optional, Tuple, Union

import numpy as np

import lowprec_formats

__all__ = [
    "all_codes",
    "code_dtype",
    "decode",
    "encode",
    "encode_value",
    "format_names",
    "is_negative_code",
    "max_finite",
    "rounding_modes",
    "value_of_code",
]

Value = Union[Fraction, float]

_NEAREST = ("nearest_even", "nearest_away", "nearest_toward_zero")
# Extra modes accepted only by E8M0 (the MX scale rules): floor = down, ceil = up.
_E8M0_ONLY = {"floor": "down", "ceil": "up"}
_TWO32 = 1 << 32
_HALF = Fraction(1, 2)


@functools.lru_cache(maxsize=4096)
def _pow2(k: int) -> Fraction:
    """2^k as an exact Fraction (cached: the encoder asks for the same few powers again)."""
    return Fraction(1 << k) if k >= 0 else Fraction(1, 1 << -k)


# --------------------------------------------------------------------------------------------
# The format, derived from the raw data.


@dataclasses.dataclass(frozen=True)
class _Format:
    """Layout and derived constants of one element format (all derived from the JSON fields)."""

    name: str
    sign_bits: int
    exponent_bits: int
    mantissa_bits: int
    bias: int
    inf: bool
    nan: str  # "ieee", "all_ones", "negative_zero" or "none"
    zero: bool
    subnormals: bool
    nan_code: Optional[int]
    inf_code: Optional[int]  # the code of +inf
    twos_complement: bool  # codes are two's-complement integers of the signed magnitude
    code_parity_ties: bool  # ties to even compare the code's last bit (P3109)
    # A tapered format (HiFloat8): ((prefix, exponent width, mantissa width), ...) and the
    # denormal (prefix, exponent offset); None for a fixed layout.
    tapered: Optional[tuple] = None

    @property
    def magnitude_bits(self) -> int:
        return self.exponent_bits + self.mantissa_bits

    @property
    def code_bits(self) -> int:
        return self.sign_bits + self.magnitude_bits

    @property
    def sign_bit(self) -> int:
        """The code bit that holds the sign (0 for an unsigned format)."""
        return (1 << self.magnitude_bits) if self.sign_bits else 0

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade: exponent field 1 (or 0 without subnormals)."""
        return (1 if self.subnormals else 0) - self.bias


@functools.lru_cache(maxsize=None)
def _fmt(name: str) -> _Format:
    try:
        canonical, d = lowprec_formats.element_spec(name) if isinstance(name, str) else (0, 0)
    except (KeyError, ValueError):
        canonical = None
    if not canonical:
        if isinstance(name, str) and lowprec_formats.ALIASES.get(name) in lowprec_formats.MX_FORMATS:
            raise ValueError(
                f"{name!r} is a block (MX) format, not an element format; valid element formats: "
                f"{format_names()} (use lowprec_reference.quantize_mx for MX formats)"
            )
        raise ValueError(
            f"unknown element format {name!r}; valid names: {format_names()} and P3109 names "
            "such as 'p3109_k8p3se'"
        )
    if d["zero"] != d["subnormals"]:
        raise NotImplementedError(f"{canonical}: zero without subnormals is not modelled")
    if d["sign_bits"] not in (0, 1) or d["nan"] not in ("ieee", "all_ones", "negative_zero", "none"):
        raise NotImplementedError(f"{canonical}: unsupported layout {dict(d)}")
    if d["inf"] != (d["inf_code"] is not None):
        raise ValueError(f"{canonical}: 'inf' and 'inf_code' disagree")
    if d.get("encoding", "sign_magnitude") == "twos_complement" and d["exponent_bits"]:
        raise NotImplementedError(f"{canonical}: two's complement with an exponent field")

    def code(v):
        return None if v is None else int(v, 16)

    return _Format(
        name=canonical,
        sign_bits=d["sign_bits"],
        exponent_bits=d["exponent_bits"],
        mantissa_bits=d["mantissa_bits"],
        bias=d["bias"],
        inf=d["inf"],
        nan=d["nan"],
        zero=d["zero"],
        subnormals=d["subnormals"],
        nan_code=code(d["nan_code"]),
        inf_code=code(d["inf_code"]),
        twos_complement=d.get("encoding", "sign_magnitude") == "twos_complement",
        code_parity_ties=d.get("ties", "significand") == "code",
        tapered=_tapered_layout(d),
    )


def _tapered_layout(d) -> Optional[tuple]:
    if d.get("encoding", "sign_magnitude") != "tapered":
        return None
    t = d["tapered"]
    dots = tuple((p, int(e), int(m)) for p, e, m in t["dot"])
    den = t.get("denormal")
    return dots, None if den is None else (den["dot"], int(den["exponent_offset"]))


def _tapered_magnitude(f: _Format, mag: int, raw: bool = False):
    """The value of a tapered magnitude code, read bit by bit as the HiFloat8 paper defines
    it (arXiv 2409.16626 §2): the prefix-coded dot field, then an exponent field of the width
    it names — sign-magnitude, its first bit the sign, an implicit leading 1 on the magnitude
    — then the mantissa, value 1.m × 2^E; the denormal dot, then j: 2^(j + offset), j = 0 the
    zero. Returns a Fraction, or ``"inf"`` for the infinity code (``raw``: the value its bits
    would spell, for the spacing of the top binade)."""
    if f.inf and mag == f.inf_code and not raw:
        return "inf"
    bits = format(mag, f"0{f.magnitude_bits}b")
    dots, denormal = f.tapered
    if denormal is not None and bits.startswith(denormal[0]):
        j = int(bits[len(denormal[0]):], 2)
        return Fraction(0) if j == 0 else _pow2(j + denormal[1])
    for prefix, e_width, m_width in dots:
        if bits.startswith(prefix):
            rest = bits[len(prefix):]
            assert len(rest) == e_width + m_width, (f.name, mag)
            e = 0
            if e_width:
                e = int("1" + rest[1:e_width], 2)
                e = -e if rest[0] == "1" else e
            m = Fraction(int(rest[e_width:] or "0", 2), 1 << m_width)
            return (1 + m) * _pow2(e)
    raise AssertionError(f"{f.name}: code {mag:#x} matches no dot prefix")


@functools.lru_cache(maxsize=None)
def _tapered_grid(name: str) -> Tuple[Tuple[Fraction, int], ...]:
    """(value, magnitude code) of every finite nonzero magnitude code, by value."""
    f = _fmt(name)
    pairs = []
    for mag in range(1, 1 << f.magnitude_bits):
        v = _tapered_magnitude(f, mag)
        if v != "inf" and v != 0:
            pairs.append((v, mag))
    return tuple(sorted(pairs))


@functools.lru_cache(maxsize=None)
def _tapered_codes(name: str) -> dict:
    """{value: magnitude code} of ``_tapered_grid`` (built once: the encoder looks up every
    rounded magnitude)."""
    return dict(_tapered_grid(name))


@functools.lru_cache(maxsize=None)
def _tapered_raw_values(name: str) -> Tuple[Fraction, ...]:
    """Every nonzero value the layout spells, the infinity code's included, sorted."""
    f = _fmt(name)
    return tuple(sorted(v for v in (_tapered_magnitude(f, m, raw=True)
                                    for m in range(1, 1 << f.magnitude_bits)) if v != 0))


def format_names() -> tuple:
    """Canonical element format names, e.g. ``('fp16', 'bf16', 'tf32', ...)``.

    Example:
        >>> "e4m3" in format_names()
        True
    """
    return tuple(lowprec_formats.ELEMENT_FORMATS)


def rounding_modes(fmt: str) -> tuple:
    """Rounding modes :func:`encode` accepts for ``fmt`` (E8M0 adds ``floor`` and ``ceil``).

    Example:
        >>> rounding_modes("e8m0")[-2:]
        ('floor', 'ceil')
    """
    modes = tuple(lowprec_formats.ROUNDING_MODES)
    f = _fmt(fmt)
    powers_of_two = not f.sign_bits and not f.mantissa_bits  # E8M0, P3109 unsigned binaryKp1
    return modes + tuple(_E8M0_ONLY) if powers_of_two else modes


def code_dtype(fmt: str) -> np.dtype:
    """The unsigned integer dtype of ``fmt``'s codes: uint8 (≤ 8 bits), uint16, else uint32.

    Example:
        >>> code_dtype("tf32")
        dtype('uint32')
    """
    bits = _fmt(fmt).code_bits
    return np.dtype(np.uint8 if bits <= 8 else np.uint16 if bits <= 16 else np.uint32)


# --------------------------------------------------------------------------------------------
# Decoding.


def _fields(f: _Format, code: int):
    """Splits a code into (negative, exponent field, mantissa field).

    A two's-complement code (INT8) is first read as the integer k it holds; its magnitude |k|
    (up to 2^7 for k = -128, one more than a sign-magnitude field holds) is split as usual:
    with no exponent bits the "mantissa field" is |k| itself.
    """
    if not 0 <= code < (1 << f.code_bits):
        raise ValueError(f"code {code} is out of range for {f.name} ({f.code_bits}-bit codes)")
    negative = bool(code & f.sign_bit)
    if f.twos_complement:
        return negative, 0, (1 << f.code_bits) - code if negative else code
    e_field = (code >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1)
    m_field = code & ((1 << f.mantissa_bits) - 1)
    return negative, e_field, m_field


def _classify(f: _Format, e_field: int, m_field: int, negative: bool = False) -> str:
    """'nan', 'inf' or 'finite' for the sign and exponent/mantissa fields of a code."""
    if f.twos_complement:
        return "finite"
    e_all_ones = e_field == (1 << f.exponent_bits) - 1
    m_all_ones = m_field == (1 << f.mantissa_bits) - 1
    magnitude = (e_field << f.mantissa_bits) | m_field
    if f.nan == "ieee" and e_all_ones and m_field != 0:
        return "nan"
    if f.nan == "all_ones" and e_all_ones and m_all_ones:
        return "nan"
    if f.nan == "negative_zero" and negative and magnitude == 0:
        return "nan"
    if f.inf and magnitude == f.inf_code:
        return "inf"
    return "finite"


def _magnitude_of_fields(f: _Format, e_field: int, m_field: int) -> Fraction:
    """Exact magnitude of a finite code (IEEE 754 §3.4 b/c with b = 2, p = mantissa_bits + 1)."""
    m = Fraction(m_field, 1 << f.mantissa_bits)
    if f.subnormals and e_field == 0:
        return m * _pow2(f.emin)  # 0.m × 2^(1 − bias)
    return (1 + m) * _pow2(e_field - f.bias)  # 1.m × 2^(E − bias)


def value_of_code(fmt: str, code: int) -> Value:
    """Exact value of one code.

    Args:
      fmt: element format name or alias (e.g. ``"e4m3"``, ``"float8_e4m3fn"``).
      code: the integer code, ``0 <= code < 2**code_bits``.

    Returns:
      A :class:`~fractions.Fraction` for a finite code (``Fraction(0)`` for both zeros; see
      :func:`is_negative_code` for the sign of −0), ``float('inf')`` / ``float('-inf')``, or
      ``float('nan')``.

    Example:
        >>> value_of_code("e8m0", 0), value_of_code("e8m0", 127), value_of_code("e8m0", 255)
        (Fraction(1, 170141183460469231731687303715884105728), Fraction(1, 1), nan)
        >>> value_of_code("e5m2", 0x7B), value_of_code("e5m2", 0xFC)
        (Fraction(57344, 1), -inf)
    """
    f = _fmt(fmt)
    if f.tapered is not None:
        return _tapered_value_of_code(f, int(code))
    negative, e_field, m_field = _fields(f, int(code))
    kind = _classify(f, e_field, m_field, negative)
    if kind == "nan":
        return math.nan
    if kind == "inf":
        return -math.inf if negative else math.inf
    v = _magnitude_of_fields(f, e_field, m_field)
    return -v if negative else v


def _tapered_value_of_code(f: _Format, code: int) -> Value:
    negative, mag = bool(code & f.sign_bit), code & (f.sign_bit - 1)
    if negative and mag == 0:
        return math.nan  # the NaN where -0 would be ("negative_zero")
    v = _tapered_magnitude(f, mag)
    if v == "inf":
        return -math.inf if negative else math.inf
    return -v if negative else v


def is_negative_code(fmt: str, code: int) -> bool:
    """Whether the sign bit of ``code`` is set (True for −0; always False for E8M0).

    Example:
        >>> is_negative_code("e4m3", 0x80), value_of_code("e4m3", 0x80)
        (True, Fraction(0, 1))
    """
    f = _fmt(fmt)
    return _fields(f, int(code))[0]


def _float_of_code(f: _Format, code: int) -> float:
    if f.tapered is not None:
        v = _tapered_value_of_code(f, code)
        return float(v)
    negative, e_field, m_field = _fields(f, code)
    kind = _classify(f, e_field, m_field, negative)
    if kind == "nan":
        return math.nan
    mag = math.inf if kind == "inf" else float(_magnitude_of_fields(f, e_field, m_field))
    return -mag if negative else mag  # −0.0 for the negative zero code


def decode(fmt: str, codes) -> np.ndarray:
    """Values of an array of codes, as float64 (every value of every format is a float64).

    Args:
      fmt: element format name or alias.
      codes: integer array of codes (any integer dtype; values must be in range).

    Returns:
      float64 array of ``codes``' shape: exact values, ±inf, NaN for NaN codes and −0.0 for
      the negative zero code.

    Example:
        >>> decode("fp16", np.array([0x3C00, 0x8000, 0x7C00, 0x7E00], np.uint16)).tolist()
        [1.0, -0.0, inf, nan]
    """
    f = _fmt(fmt)
    codes = np.asarray(codes)
    if codes.dtype.kind not in "ui":
        raise TypeError(f"codes must be an integer array, got dtype {codes.dtype}")
    out = np.array([_float_of_code(f, int(c)) for c in codes.ravel().tolist()], np.float64)
    return out.reshape(codes.shape)


def all_codes(fmt: str) -> np.ndarray:
    """Every code of ``fmt`` in increasing order (2**code_bits of them), in its code dtype.

    Example:
        >>> all_codes("e2m1").shape, all_codes("tf32").shape, all_codes("fp16").dtype
        ((16,), (524288,), dtype('uint16'))
    """
    f = _fmt(fmt)
    return np.arange(1 << f.code_bits, dtype=np.int64).astype(code_dtype(fmt))


@functools.lru_cache(maxsize=None)
def _max_magnitude_code(name: str) -> int:
    """Largest finite magnitude code: scan down from the all-ones magnitude code (a tapered
    format's codes do not order like their values: the code of its largest value)."""
    f = _fmt(name)
    if f.tapered is not None:
        return _tapered_grid(name)[-1][1]
    code = (1 << f.magnitude_bits) - 1
    while _classify(f, code >> f.mantissa_bits, code & ((1 << f.mantissa_bits) - 1)) != "finite":
        code -= 1
    return code


@functools.lru_cache(maxsize=None)
def max_finite(fmt: str) -> Fraction:
    """Largest finite value of ``fmt`` (derived by scanning the codes down from all ones).

    Example:
        >>> [int(max_finite(n)) for n in ("fp16", "e4m3", "e5m2", "e2m1")]
        [65504, 448, 57344, 6]
        >>> max_finite("e8m0") == 2**127
        True
    """
    f = _fmt(fmt)
    if f.tapered is not None:
        return _tapered_grid(f.name)[-1][0]
    code = _max_magnitude_code(f.name)
    return _magnitude_of_fields(f, code >> f.mantissa_bits, code & ((1 << f.mantissa_bits) - 1))


# --------------------------------------------------------------------------------------------
# Encoding: exact rounding of a rational magnitude onto the grid.


def _floor_log2(a: Fraction) -> int:
    """floor(log2 a) for a rational a > 0, exactly (integer arithmetic only)."""
    e = a.numerator.bit_length() - a.denominator.bit_length()
    # Now 2^(e-1) < a < 2^(e+1); step down if a < 2^e.
    if (a.numerator << max(-e, 0)) < (a.denominator << max(e, 0)):
        e -= 1
    return e


def _quantum_exponent(f: _Format, a: Fraction) -> int:
    """log2 of the grid spacing around magnitude a > 0.

    In a normal binade [2^e, 2^(e+1)) the representable values are spaced 2^(e − p + 1) with
    p − 1 = mantissa_bits. Below 2^emin the spacing is that of the subnormals,
    2^(emin − mantissa_bits); without subnormals the grid below 2^emin is {0, 2^emin}, spacing
    2^emin. Above the largest finite value the grid is extended with the same rule (unbounded
    exponent range, as IEEE 754 §7.4 measures overflow).
    """
    e = _floor_log2(a)
    if f.tapered is not None:
        # The spacing of a's binade: the gap from 2^e to the next value the layout spells (the
        # infinity code's 1.5 x 2^15 included: the top binade's spacing continues past the
        # largest finite value, IEEE 754 §7.4); below the smallest value 2^lo the grid is
        # {0, 2^lo}.
        return _tapered_quantum_exponent(f.name, e)
    if e >= f.emin:
        return e - f.mantissa_bits
    return f.emin - f.mantissa_bits if f.subnormals else f.emin


@functools.lru_cache(maxsize=None)
def _tapered_quantum_exponent(name: str, e: int) -> int:
    """log2 of a tapered format's grid spacing in binade [2^e, 2^(e+1)) (cached per binade:
    a scan of the layout's values, which every encoded element would repeat)."""
    raw = _tapered_raw_values(name)
    lo, top = _floor_log2(raw[0]), _floor_log2(raw[-1])
    e = min(max(e, lo), top)
    nxt = next((v for v in raw if v > _pow2(e)), _pow2(e + 1))
    return _floor_log2(min(nxt, _pow2(e + 1)) - _pow2(e))


def _round_magnitude(f: _Format, a: Fraction, direction: str, r: Optional[int]) -> Fraction:
    """Rounds a magnitude a ≥ 0 onto the (upward-unbounded) grid of ``f``.

    ``direction`` is one of "nearest_even", "nearest_away", "nearest_toward_zero", "in"
    (toward zero), "out" (away from zero) or "stochastic" (then ``r`` is the 32-bit random word).
    """
    if a == 0:
        return a
    quantum = _pow2(_quantum_exponent(f, a))
    n = a / quantum
    lo = n.numerator // n.denominator  # floor(a / quantum): lower neighbour is lo × quantum
    frac = n - lo  # in [0, 1): position of a between the two neighbours
    if frac == 0:
        return a  # exactly representable (in the extended grid)
    if direction == "nearest_even":
        odd = lo % 2 == 1
        if f.code_parity_ties and 0 < lo * quantum <= max_finite(f.name):
            # P3109: ties go to the even *code*; without mantissa bits (precision 1) the
            # lower neighbour 2^e has code e + bias, whatever the parity of its significand 1.
            odd = _magnitude_code(f, lo * quantum) % 2 == 1
        up = frac > _HALF or (frac == _HALF and odd)
    elif direction == "nearest_away":
        up = frac >= _HALF
    elif direction == "nearest_toward_zero":
        up = frac > _HALF  # a tie keeps the smaller magnitude
    elif direction == "in":
        up = False
    elif direction == "out":
        up = True
    elif direction == "stochastic":
        up = r < frac * _TWO32  # exact comparison of an integer with a rational
    else:  # pragma: no cover - validated by the callers
        raise AssertionError(direction)
    return (lo + 1) * quantum if up else lo * quantum


def _magnitude_code(f: _Format, v: Fraction) -> int:
    """Magnitude code of a grid value 0 < v ≤ max finite (inverse of _magnitude_of_fields)."""
    if f.tapered is not None:
        return _tapered_codes(f.name)[v]
    e = _floor_log2(v)
    if e < f.emin:  # subnormal: 0.m × 2^emin
        code = v / _pow2(f.emin - f.mantissa_bits)
        assert f.subnormals and code.denominator == 1, (f.name, v)
        return int(code)
    m = v / _pow2(e - f.mantissa_bits) - (1 << f.mantissa_bits)
    assert m.denominator == 1 and 0 <= m < (1 << f.mantissa_bits), (f.name, v)
    return ((e + f.bias) << f.mantissa_bits) | int(m)


def _check_rounding(f: _Format, rounding: str) -> str:
    valid = rounding_modes(f.name)
    if not isinstance(rounding, str) or rounding not in valid:
        extra = (
            " ('floor' and 'ceil' are E8M0-only scale rules; use 'down'/'up')"
            if rounding in _E8M0_ONLY
            else ""
        )
        raise ValueError(f"unknown rounding {rounding!r} for {f.name}; valid: {valid}{extra}")
    return _E8M0_ONLY.get(rounding, rounding)


def _check_overflow(overflow: str) -> str:
    valid = tuple(lowprec_formats.OVERFLOW_POLICIES)
    if not isinstance(overflow, str) or overflow not in valid:
        raise ValueError(f"unknown overflow policy {overflow!r}; valid: {valid}")
    return overflow


def _signed(f: _Format, negative: bool, magnitude: int) -> int:
    """The code of a signed finite magnitude code.

    Sign-magnitude formats set the sign bit — except on a zero in formats without −0 (fnuz,
    P3109: that code is their NaN), which gives +0. A two's-complement format (INT8) stores
    −k as 2^bits − k; its only zero is 0.
    """
    if f.twos_complement:
        return (1 << f.code_bits) - magnitude if negative and magnitude else magnitude
    if f.nan == "negative_zero" and magnitude == 0:
        return 0
    return (f.sign_bit if negative else 0) | magnitude


def _nan_result(f: _Format, negative: bool) -> int:
    """Code for a NaN input.

    The format's NaN code with the input's sign bit (fnuz/P3109 have one NaN code, 1000...0,
    whatever the sign). Formats without NaN (E2M1, E2M3, E3M2): ml_dtypes (and XLA) give a zero
    of the *opposite* sign (+NaN → 0b1000 = −0, −NaN → 0b0000 = +0); reproduced (INT8: 0).
    Unsigned formats: their NaN code (E8M0: 0xFF).
    """
    if f.nan_code is None:
        return _signed(f, not negative, 0)
    if f.nan == "negative_zero":
        return f.nan_code
    return f.nan_code | (f.sign_bit if negative else 0)


def _overflow_result(f: _Format, negative: bool) -> int:
    """The code an IEEE overflow goes to: ±∞, else the NaN code, else ±the largest finite."""
    if f.inf:
        return _signed(f, negative, f.inf_code)
    if f.nan_code is not None:
        return _nan_result(f, negative)
    return _signed(f, negative, _max_magnitude_code(f.name))


def _encode_one(
    f: _Format,
    negative: bool,
    kind: str,
    a: Optional[Fraction],
    mode: str,
    overflow: str,
    r: Optional[int],
) -> int:
    """Code of one input: sign, kind ('nan' / 'inf' / 'finite') and exact magnitude a ≥ 0.

    ``mode`` is already validated and E8M0's floor/ceil are mapped to down/up.
    """
    if kind == "nan":
        return _nan_result(f, negative)
    if not f.sign_bits:
        if not f.zero and (negative or (kind == "finite" and a == 0)):
            return f.nan_code  # E8M0: no sign and no zero → NaN (as ml_dtypes)
        if negative and not (kind == "finite" and a == 0):
            return f.nan_code  # unsigned P3109: a negative number has no code; −0 is +0
        negative = False
    max_code = _max_magnitude_code(f.name)
    if kind == "inf":
        # Conversion of ∞ is exact in every rounding mode; a format without ∞ gets its NaN
        # (E4M3, fnuz, E8M0) or its largest finite value (E2M1, FP6, INT8) under "ieee".
        if overflow == "ieee":
            return _overflow_result(f, negative)
        return _signed(f, negative, max_code)

    # Direction of the magnitude rounding.
    if mode in _NEAREST or mode == "stochastic":
        direction = mode
    elif mode == "toward_zero":
        direction = "in"
    elif mode == "up":
        direction = "in" if negative else "out"
    elif mode == "down":
        direction = "out" if negative else "in"
    else:  # pragma: no cover
        raise AssertionError(mode)

    v = _round_magnitude(f, a, direction, r)
    if (
        not f.zero
        and overflow == "ieee"
        and mode in _NEAREST
        and _pow2(f.emin) < a < _pow2(f.emin + 1)
    ):
        # ml_dtypes / XLA quirk for E8M0, reproduced under the default policy: every value
        # strictly inside the lowest binade (2^-127, 2^-126) — float32 subnormals — becomes
        # 2^-126 (code 0x01), although e.g. 1.1 × 2^-127 is nearer to 2^-127. Correct rounding
        # is what the other modes and overflow="saturate" give.
        v = _pow2(f.emin + 1)
    if v == 0:
        if not f.zero:
            return 0  # no zero (E8M0): the smallest value 2^-bias, code 0
        return _signed(f, negative, 0)  # signed zero, sign kept (IEEE 754 §6.3) if it exists
    if v > max_finite(f.name):
        # IEEE 754 §7.4: the nearest modes and stochastic (and the directed mode that rounds
        # away from zero) go to the overflow value; the others give the largest finite.
        if overflow == "ieee" and direction != "in":
            return _overflow_result(f, negative)
        return _signed(f, negative, max_code)
    return _signed(f, negative, _magnitude_code(f, v))


def encode_value(
    fmt: str,
    value: Union[float, Fraction],
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    random_bits: Optional[int] = None,
    *,
    negative: Optional[bool] = None,
) -> int:
    """Code of one exact value (a float or any rational), by exact rounding.

    Args:
      fmt: element format name or alias.
      value: a Python float (incl. ±0.0, ±inf, NaN) or a :class:`~fractions.Fraction`.
      rounding: see :func:`encode`.
      overflow: see :func:`encode`.
      random_bits: the 32-bit word for ``rounding="stochastic"``.
      negative: sign to use when ``value`` is a zero Fraction (a Fraction has no −0);
        defaults to the sign of ``value``.

    Returns:
      The integer code.

    Example:
        >>> encode_value("e5m2", 61440.0), encode_value("e5m2", Fraction(61439))
        (124, 123)
        >>> encode_value("e4m3", Fraction(0), negative=True)
        128
    """
    f = _fmt(fmt)
    mode = _check_rounding(f, rounding)
    overflow = _check_overflow(overflow)
    if mode == "stochastic":
        if random_bits is None or not 0 <= int(random_bits) < _TWO32:
            raise ValueError("rounding='stochastic' needs random_bits, an integer in [0, 2**32)")
        random_bits = int(random_bits)
    if isinstance(value, Fraction):
        neg = value < 0 if negative is None else bool(negative)
        return _encode_one(f, neg, "finite", abs(value), mode, overflow, random_bits)
    value = float(value)
    neg = math.copysign(1.0, value) < 0 if negative is None else bool(negative)
    if math.isnan(value):
        return _encode_one(f, neg, "nan", None, mode, overflow, random_bits)
    if math.isinf(value):
        return _encode_one(f, neg, "inf", None, mode, overflow, random_bits)
    return _encode_one(f, neg, "finite", abs(Fraction(value)), mode, overflow, random_bits)


def _format_of_dtype(dt: np.dtype) -> Optional[str]:
    """The element format whose ``ml_dtypes`` storage type is ``dt`` (by name), or None."""
    for name, spec in lowprec_formats.ELEMENT_FORMATS.items():
        if spec["ml_dtypes"] == dt.name and dt.itemsize <= 2:
            return name
    return None


def _exact_float64(x: np.ndarray) -> np.ndarray:
    """A float array of any width lowprec knows → float64 array of the same values.

    Every value of these formats is a float64, so the conversion is exact. float16 and
    float32 are widened by NumPy; bfloat16 and the ml_dtypes types (float8_*, float6_*,
    float4_e2m1fn) are read from their bit patterns with this module's own decoder, without
    ml_dtypes arithmetic (a NaN keeps its sign).
    """
    dt = x.dtype
    if dt == np.float64:
        return x
    with np.errstate(invalid="ignore"):  # numpy warns when casting signalling NaNs
        if dt in (np.float16, np.float32):
            return x.astype(np.float64)
    name = _format_of_dtype(dt)
    if name is not None:
        f = _fmt(name)
        codes = x.view(np.uint16 if dt.itemsize == 2 else np.uint8) & ((1 << f.code_bits) - 1)
        values = decode(name, codes)
        # decode gives NaN without a sign; the input NaN's sign bit matters to encoders.
        negative = (codes & f.sign_bit) != 0
        return np.where(np.isnan(values) & negative, -np.abs(values), values)
    raise TypeError(
        f"x has dtype {dt}; encode accepts float16, bfloat16, float32, float64 or an ml_dtypes "
        "float (float8_*, float6_*, float4_e2m1fn) (cast other inputs with .astype(np.float32))"
    )


def encode(
    fmt: str,
    x,
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    random_bits=None,
) -> np.ndarray:
    """Codes of ``x`` in ``fmt``, by exact rational rounding of every element.

    Each element is converted exactly to a :class:`~fractions.Fraction` and rounded onto the
    format's grid (IEEE 754-2019 §4.3), with overflow handled as described below.

    Args:
      fmt: element format name or alias (``lowprec_formats.ALIASES``).
      x: float16, bfloat16 (ml_dtypes), float32 or float64 array. float64 is rounded once,
        correctly (ml_dtypes' ``astype`` from float64 rounds through float32 first, so it can
        differ by double rounding).
      rounding: ``"nearest_even"`` (ties to the even code), ``"nearest_away"`` (ties away from
        zero), ``"nearest_toward_zero"`` (ties to the smaller magnitude), ``"toward_zero"``,
        ``"up"`` (toward +∞), ``"down"`` (toward −∞) or ``"stochastic"``; E8M0 also takes
        ``"floor"`` (= down) and ``"ceil"`` (= up). For E8M0 nearest_even and nearest_away
        coincide: a tie 1.5 × 2^k lies between the odd significand 1 and the even
        significand 2 = 1 × 2^(k+1), so both pick 2^(k+1) (3 → 4, 0.75 → 1), as ml_dtypes
        does; nearest_toward_zero picks 2^k.
      overflow: ``"ieee"`` (default) or ``"saturate"``.

        * ``"ieee"``: overflow means the magnitude rounded onto the grid extended past the
          largest finite value with the same spacing exceeds that value (IEEE 754 §7.4). The
          nearest modes and stochastic then give ∞ (fp16, bf16, tf32, e5m2), the NaN code
          with the sign kept (e4m3: 0x7F/0xFF; e8m0: 0xFF) or ±max (e2m1, which has neither);
          ``toward_zero`` gives ±max; ``up`` gives that overflow value for positive x and −max
          for negative x; ``down`` the reverse. ±∞ inputs: ±∞, else the NaN code, else ±max,
          in every mode. Matches ml_dtypes ``astype`` bit for bit for every float32 input
          under ``nearest_even`` (NaN payloads aside), including its E8M0 quirk that every
          value strictly between 2^-127 and 2^-126 gives 2^-126 in the nearest modes.
        * ``"saturate"``: finite overflow and ±∞ give ±max in every mode.

        In both: NaN → the NaN code with the input's sign bit (E2M1, without NaN: the zero of
        the opposite sign, as ml_dtypes: +NaN → 0b1000, −NaN → 0b0000); zero results keep the
        sign of x. E8M0 (unsigned, no zero): 0, −0, negatives and NaN → 0xFF; positive values
        rounding to 0 or below 2^-127 → 0x00 (2^-127); +∞ → 0xFF ("ieee") or 0xFE (2^127,
        "saturate").
      random_bits: for ``"stochastic"`` only (ignored otherwise): a uint32 array of x's shape,
        one word r per element. With lo ≤ |x| ≤ hi the neighbouring grid magnitudes and
        frac = (|x| − lo) / (hi − lo) exactly, the magnitude rounds up to hi iff
        r < frac × 2^32, so P(up) = ⌈frac × 2^32⌉ / 2^32; exact values are unchanged.

    Returns:
      Codes of x's shape: uint8 for ≤ 8-bit formats (E2M1 unpacked, 0..15), uint16 for
      fp16/bf16, uint32 for tf32 (a 19-bit code: the top 19 bits of a binary32).

    Raises:
      ValueError: unknown format, rounding or overflow; missing or mis-shaped random_bits.
      TypeError: unsupported dtype of x or random_bits.

    Example:
        >>> encode("e8m0", np.array([3.0, 0.75, 2.0**-130, 0.0])).tolist()
        [129, 127, 0, 255]
        >>> encode("e4m3", np.array([1000.0, -1000.0]), rounding="toward_zero").tolist()
        [126, 254]
        >>> encode("e2m1", np.array([0.25, 0.25]), "stochastic",
        ...        random_bits=np.array([0, 2**31], np.uint32)).tolist()
        [1, 0]
    """
    f = _fmt(fmt)
    mode = _check_rounding(f, rounding)
    overflow = _check_overflow(overflow)
    x = np.asarray(x)
    values = _exact_float64(x).ravel().tolist()
    if mode == "stochastic":
        if random_bits is None:
            raise ValueError("rounding='stochastic' needs random_bits (a uint32 array of x's shape)")
        random_bits = np.asarray(random_bits)
        if random_bits.dtype != np.uint32:
            raise TypeError(f"random_bits must have dtype uint32, got {random_bits.dtype}")
        if random_bits.shape != x.shape:
            raise ValueError(
                f"random_bits has shape {random_bits.shape}; it must have x's shape {x.shape}"
            )
        words = random_bits.ravel().tolist()
    else:
        words = [None] * len(values)
    out = []
    for v, r in zip(values, words):
        negative = math.copysign(1.0, v) < 0
        if v != v:
            out.append(_encode_one(f, negative, "nan", None, mode, overflow, r))
        elif v in (math.inf, -math.inf):
            out.append(_encode_one(f, negative, "inf", None, mode, overflow, r))
        else:
            out.append(_encode_one(f, negative, "finite", abs(Fraction(v)), mode, overflow, r))
    return np.array(out, dtype=np.int64).astype(code_dtype(f.name)).reshape(x.shape)
