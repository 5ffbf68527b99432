"""Tapered element formats: a prefix-coded field selects how many exponent and mantissa
bits a code has (HiFloat8, Luo et al., arXiv 2409.16626).

A tapered format is data (``formats/elements.json``, field ``tapered``): a list of ``dot``
entries ``[prefix, exponent_width, mantissa_width]`` and a ``denormal`` entry. After the sign
bit, a code starts with one of the prefixes; the exponent field that follows, of width w >= 1,
is sign-magnitude with an implicit leading magnitude bit (its top bit is the exponent's sign,
the magnitude is 2^(w-1) plus the remaining bits), so width w covers exponents ±[2^(w-1),
2^w - 1] and width 0 the exponent 0; the value is 1.m × 2^E. The denormal prefix is followed
by the bits of an integer j: j = 0 is the zero (and, with the sign bit, the NaN), j >= 1 the
value 2^(j + offset). HiFloat8: prefixes 0001, 001, 01, 10, 11 with exponent widths 0-4 and
mantissa widths 3, 3, 3, 2, 1 (exponents 0, ±1, ±2..3, ±4..7, ±8..15), denormals 2^-22 ..
2^-16, +inf at 0x6F (1.5 × 2^15's code; -inf 0xEF), NaN 0x80 (where -0 would be).

Every positive value lies in one binade t with a mantissa width M(t) (0 for the denormals),
so encoding is rounding at quantum 2^(t - M(t)) — integer arithmetic, every rounding mode,
the same as :mod:`lowprec._encode` does for fixed layouts — and decoding is a table lookup.
Ties to even compare the codes' last bit (``ties: "code"``: it differs from the mantissa's
only between two denormals, which have no mantissa).
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Optional

import numpy as np

from ._bits import F32_BIAS, F32_MANT_BITS, F32_QNAN, F32_INF, F64_BIAS, F64_MANT_BITS, clz
from ._lazy import lazy_module
from ._rounding import Overflow, Rounding, round_shift

# Imported on first use: the checkpoint command line's native path needs no JAX.
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")

_FLOAT_LAYOUTS = {
    np.dtype(np.uint32): (F32_MANT_BITS, F32_BIAS),
    np.dtype(np.uint64): (F64_MANT_BITS, F64_BIAS),
}


def freeze(spec) -> Optional[tuple]:
    """The hashable form of a ``tapered`` data entry: ``(dots, (denormal prefix, offset))``
    with dots a tuple of ``(prefix, exponent_width, mantissa_width)``."""
    if spec is None:
        return None
    dots = tuple((str(p), int(e), int(m)) for p, e, m in spec["dot"])
    denormal = spec.get("denormal")
    return dots, None if denormal is None else (str(denormal["dot"]),
                                                int(denormal["exponent_offset"]))


def _exponents(width: int) -> range:
    """Exponent magnitudes of a sign-magnitude field of ``width`` bits with an implicit
    leading bit: 0 for width 0, else 2^(width-1) .. 2^width - 1."""
    return range(0, 1) if width == 0 else range(1 << (width - 1), 1 << width)


@functools.lru_cache(maxsize=None)
def layout(tapered: tuple, magnitude_bits: int):
    """Per binade and per code, the exact layout of a tapered format.

    Returns ``(binades, codes)``: ``binades`` maps each exponent t with values to
    ``(mantissa width, code of 1.0 × 2^t without sign)``; ``codes`` maps every magnitude code
    with a finite nonzero value to that value (a Fraction).
    """
    dots, denormal = tapered
    binades, codes = {}, {}
    for prefix, e_width, m_width in dots:
        base = int(prefix, 2) << (magnitude_bits - len(prefix))
        for magnitude in _exponents(e_width):
            for negative in ((False, True) if e_width else (False,)):
                t = -magnitude if negative else magnitude
                field = (int(negative) << (e_width - 1) | (magnitude - (1 << (e_width - 1)))
                         if e_width else 0)
                code0 = base | field << m_width
                binades[t] = (m_width, code0)
                for m in range(1 << m_width):
                    codes[code0 | m] = (1 + Fraction(m, 1 << m_width)) * Fraction(2) ** t
    if denormal is not None:
        prefix, offset = denormal
        width = magnitude_bits - len(prefix)
        base = int(prefix, 2) << width
        for j in range(1, 1 << width):
            binades[j + offset] = (0, base | j)
            codes[base | j] = Fraction(2) ** (j + offset)
    if binades[min(binades)][0] != 0:
        raise ValueError("a tapered format's lowest binade must have no mantissa bits (below "
                         "it the grid is {0, 2^lowest})")
    return binades, codes


def finite_codes(fmt) -> dict:
    """Magnitude code → exact value of every finite nonzero magnitude code (not +inf)."""
    _, codes = layout(fmt.tapered, fmt.magnitude_bits)
    return {c: v for c, v in codes.items() if c != fmt.inf_code}


def max_magnitude_code(fmt) -> int:
    values = finite_codes(fmt)
    return max(values, key=values.get)


def top_quantum_exponent(fmt) -> int:
    """log2 of the spacing of the largest binade's values."""
    binades, _ = layout(fmt.tapered, fmt.magnitude_bits)
    top = max(binades)
    return top - binades[top][0]


def smallest_binade(fmt) -> int:
    binades, _ = layout(fmt.tapered, fmt.magnitude_bits)
    return min(binades)


def smallest_normal_binade(fmt) -> int:
    """The lowest binade with a mantissa (HiFloat8: 2^-15; the denormals lie below)."""
    binades, _ = layout(fmt.tapered, fmt.magnitude_bits)
    return min(t for t, (m, _) in binades.items() if m > 0 or t >= 0)


# -- decode -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _value_table(fmt) -> np.ndarray:
    """float32 pattern of every code (sign included)."""
    table = np.zeros(1 << fmt.code_bits, np.uint32)
    for code, value in finite_codes(fmt).items():
        table[code] = np.float32(float(value)).view(np.uint32)  # exact: <= 4 significant bits
    if fmt.inf_code is not None:
        table[fmt.inf_code] = F32_INF
    sign = 1 << fmt.magnitude_bits
    table[sign:] = table[:sign] | np.uint32(1 << 31)
    table[sign] = F32_QNAN  # the NaN where -0 would be
    table[0] = 0
    return table


def decode_bits(fmt, codes):
    """float32 patterns (uint32) of tapered codes, by table lookup."""
    table = jnp.asarray(_value_table(fmt))
    return table[codes.astype(jnp.int32) & ((1 << fmt.code_bits) - 1)]


# -- encode -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _binade_tables(fmt):
    """(lowest binade, mantissa width per binade, code of 2^t per binade, tie-up at ties to
    even per binade) for t from the lowest binade to the highest plus one (the carry out of
    the top binade, which overflows)."""
    binades, _ = layout(fmt.tapered, fmt.magnitude_bits)
    lo, hi = min(binades), max(binades)
    widths = np.array([binades[t][0] for t in range(lo, hi + 1)], np.int32)
    code0 = np.array([binades[t][1] for t in range(lo, hi + 1)] + [0], np.int32)
    # A tie in a binade without mantissa (2^t vs 2^(t+1)) goes to the even code; in one with
    # a mantissa the rounded significand's parity is the code's. Below the lowest binade the
    # tie is between 0 (code 0, even) and 2^lo.
    tie_up = np.array([(binades[t + 1][1] % 2 == 0) if t + 1 in binades else True
                       for t in range(lo, hi + 1)], bool)
    return lo, hi, widths, code0, tie_up


def encode_bits(fmt, u, rounding, overflow, random_bits):
    """Tapered codes (int32) of float32/float64 patterns ``u`` in any mode and policy.

    ``rounding``/``overflow``: canonical members (validated by the caller). NaN gives the NaN
    code; ±inf, and overflow under ``"ieee"`` where the mode rounds to infinity (IEEE 754
    §7.4, as for any float), the infinity code of that sign, else ± the largest finite value;
    a result of zero is code 0 (there is no -0).
    """
    rounding, overflow = Rounding(rounding), Overflow(overflow)
    lo, hi, np_widths, np_code0, np_tie_up = _binade_tables(fmt)
    widths, code0, tie_up = jnp.asarray(np_widths), jnp.asarray(np_code0), jnp.asarray(np_tie_up)
    max_code = max_magnitude_code(fmt)
    # The largest value's q in the top binade (units of 2^(hi - M(hi))).
    top_q = int(finite_codes(fmt)[max_code] / Fraction(2) ** (hi - int(np_widths[-1])))
    low_tie_up = int(np_code0[0]) % 2 == 0  # between 0 and 2^lo: up iff 2^lo's code is even
    in_mant, in_bias = _FLOAT_LAYOUTS[np.dtype(u.dtype)]
    width = jnp.iinfo(u.dtype).bits
    sign = lax.shift_right_logical(u, jnp.asarray(width - 1, u.dtype))
    mag = u & jnp.asarray((1 << (width - 1)) - 1, u.dtype)
    inf_bits = ((1 << (width - 1 - in_mant)) - 1) << in_mant
    efield = lax.shift_right_logical(mag, jnp.asarray(in_mant, u.dtype)).astype(jnp.int32)
    sig = jnp.where(efield > 0, (mag & ((1 << in_mant) - 1)) | (1 << in_mant),
                    mag & ((1 << in_mant) - 1)).astype(u.dtype)
    lsb_exp = jnp.maximum(efield, 1) - (in_bias + in_mant)
    e_x = lsb_exp + (width - 1) - clz(sig)
    t = jnp.clip(e_x, lo, hi)
    m_width = widths[t - lo]
    # >= 1 wherever e_x <= hi (the quantum lies below the input's last bit at most 22 bits
    # above it); inputs past the top binade overflow whatever q says.
    shift = jnp.maximum((t - m_width) - lsb_exp, 1)
    q = round_shift(sig, shift, sign, rounding, random_bits)
    if rounding is Rounding.NEAREST_EVEN:
        # Ties between two denormals (no mantissa) go to the even code, not the even q.
        s = jnp.minimum(shift, width - 1).astype(u.dtype)
        one = jnp.asarray(1, u.dtype)
        tie = (sig & (lax.shift_left(one, s) - one)) == lax.shift_left(one, s - one)
        floor = lax.shift_right_logical(sig, s).astype(jnp.int32)
        # Below the lowest binade the tie is between 0 (code 0) and 2^lo.
        up = jnp.where(e_x < lo, low_tie_up, tie_up[t - lo])
        q = jnp.where(tie & (m_width == 0), floor + up.astype(jnp.int32), q)
    # q in units of 2^(t - M): in [2^M, 2^(M+1)) the value stays in binade t (below the
    # lowest binade, whose M is 0, q is 0 or 1: zero or 2^lo); 2^(M+1) is the carry to
    # 2^(t+1).
    carry = q == lax.shift_left(2, m_width)
    code = jnp.where(carry, code0[t + 1 - lo], code0[t - lo] + q - lax.shift_left(1, m_width))
    code = jnp.where(q == 0, 0, code)
    over = (e_x > hi) | (carry & (t == hi)) | ((t == hi) & (q > top_q)) | (mag == inf_bits)
    if overflow is Overflow.SATURATE:
        to_inf = jnp.zeros_like(over)
    else:
        to_inf = rounding.overflows_to_inf(sign) | (mag == inf_bits)
    code = jnp.where(over, jnp.where(to_inf, fmt.inf_code, max_code), code)
    code = jnp.where((code != 0) & (sign != 0), code | (1 << fmt.magnitude_bits), code)
    return jnp.where(mag > inf_bits, fmt.nan_code, code)
