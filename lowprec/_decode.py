"""Element decoders: codes → exact float32 values, from the bits.

:func:`decode_bits` builds the float32 pattern of any element format with integer operations
only; :func:`decode_f32` gives the same bits in fewer operations for the small float formats
(a rebias plus one exact float subtraction), and falls back to it elsewhere.
"""

from __future__ import annotations

import numpy as np

from ._bits import (
    F32_BIAS,
    F32_EMAX,
    F32_EMIN,
    F32_EXP_BITS,
    F32_IMPLICIT,
    F32_INF,
    F32_MANT_BITS,
    F32_MANT_MSB,
    F32_MIN_LSB_EXP,
    F32_QNAN,
    F32_SIGN,
    F32_SIGN_SHIFT,
    bits_to_f32,
    exponent_addend,
    f32_bits,
)
from . import _tapered
from ._format import ElementFormat
from ._lazy import lazy_module

# Imported on first use: the checkpoint command line's native path needs no JAX.
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")


def decode_bits(fmt: ElementFormat, codes):
    """Codes (any unsigned/signed int array) → exact float32 bit patterns (uint32)."""
    c = codes.astype(jnp.uint32)
    m_bits = fmt.mantissa_bits
    if fmt.encoding == "tapered":  # HiFloat8: codes do not split into fixed fields
        return _tapered.decode_bits(fmt, c)
    if fmt.encoding == "twos_complement":
        return _decode_twos_complement(fmt, c)
    mag = c & ((1 << fmt.magnitude_bits) - 1)
    sign = (
        lax.shift_right_logical(c, jnp.uint32(fmt.magnitude_bits)) & 1
        if fmt.signed
        else jnp.zeros_like(c)
    )
    if not fmt.zero:
        # E8M0: code k is 2^(k - bias); 2^-127 is a float32 subnormal, written directly.
        normal = lax.shift_left(mag + (F32_BIAS - fmt.bias), jnp.uint32(F32_MANT_BITS))
        bits = jnp.where(mag == 0, jnp.uint32(F32_MANT_MSB), normal)
    elif fmt.exponent_bits == F32_EXP_BITS and fmt.bias == F32_BIAS and fmt.nan == "ieee":
        # BF16 and TF32 are truncated float32: the code is the float32 pattern's top bits,
        # subnormals, infinities and NaNs included.
        bits = lax.shift_left(mag, jnp.uint32(F32_MANT_BITS - m_bits))
    else:
        efield = lax.shift_right_logical(mag, jnp.uint32(m_bits))
        mfield = mag & fmt.mantissa_mask
        normal = lax.shift_left(
            efield + (F32_BIAS - fmt.bias), jnp.uint32(F32_MANT_BITS)
        ) | lax.shift_left(mfield, jnp.uint32(F32_MANT_BITS - m_bits))
        # Subnormal m * 2^(emin - M): a float32 normal for the formats of formats/ (E < 8),
        # so convert the small integer m exactly and add to its exponent field.
        as_float = lax.bitcast_convert_type(mfield.astype(jnp.float32), jnp.uint32)
        sub = jnp.where(
            mfield == 0, jnp.uint32(0), as_float + jnp.uint32(exponent_addend(fmt.emin - m_bits))
        )
        bits = jnp.where(efield == 0, sub, normal)
        if fmt.emin - m_bits < F32_EMIN:
            # Values below 2^-126 (wide P3109 formats) are float32 subnormals: the
            # significand, shifted to units of 2^-149 (exact: every value is >= 2^-149).
            lsb = jnp.maximum(efield, 1).astype(jnp.int32) - (fmt.bias + m_bits)
            sig = jnp.where(efield > 0, mfield | (1 << m_bits), mfield)
            # floor(log2 value): lsb plus the position of sig's leading bit, 31 - clz.
            top = lsb + F32_SIGN_SHIFT - lax.clz(sig).astype(jnp.int32)
            tiny = lax.shift_left(sig, jnp.clip(lsb - F32_MIN_LSB_EXP, 0, 31).astype(jnp.uint32))
            bits = jnp.where((sig != 0) & (top < F32_EMIN), tiny, bits)
        if fmt.nan == "ieee":
            top = efield == (1 << fmt.exponent_bits) - 1
            bits = jnp.where(top & (mfield != 0), jnp.uint32(F32_QNAN), bits)
    if fmt.inf:
        bits = jnp.where(mag == fmt.inf_code, jnp.uint32(F32_INF), bits)
    if fmt.nan == "all_ones":
        bits = jnp.where(mag == (1 << fmt.magnitude_bits) - 1, jnp.uint32(F32_QNAN), bits)
    elif fmt.nan == "negative_zero":
        # fnuz / P3109: the code with only the sign bit set is NaN (ml_dtypes reads it as -NaN).
        bits = jnp.where((mag == 0) & (sign != 0), jnp.uint32(F32_QNAN), bits)
    return bits | lax.shift_left(sign, jnp.uint32(F32_SIGN_SHIFT))


def _subtract_decodable(fmt: ElementFormat) -> bool:
    """Whether :func:`decode_f32` builds ``fmt``'s values by float subtraction (static):
    a signed or unsigned float format with zero and subnormals, whose smallest subnormal
    and whose exponent offset keep every intermediate a float32 normal, and whose specials
    are IEEE inf/NaN, an all-ones NaN, or none."""
    return (
        fmt.encoding == "sign_magnitude"
        and fmt.zero and fmt.subnormals and fmt.exponent_bits >= 1
        and fmt.nan in ("ieee", "all_ones", "none") and fmt.inf == (fmt.nan == "ieee")
        and fmt.code_bits <= 16 and fmt.mantissa_bits < F32_MANT_BITS
        # The smallest subnormal at least one binade above float32's smallest normal.
        and F32_EMIN + 1 <= 1 - fmt.bias - fmt.mantissa_bits and fmt.emax < F32_EMAX
    )


def decode_f32(fmt: ElementFormat, codes):
    """Values of ``codes`` as float32, bit for bit those of :func:`decode_bits`.

    Fewer operations than :func:`decode_bits` for the small float formats: the magnitude's
    bits, moved into float32's layout and rebiased, are the value of every normal code; a
    subnormal code (exponent field 0) is read as if its field were 1, which adds the hidden
    2^(1 - bias), and that is subtracted in float32. Both operands and the difference are
    float32 normals (the difference lies in [2^(1 - bias - M), 2^(1 - bias)), and is exact
    by Sterbenz's lemma), so no backend's handling of subnormals can change it. Formats
    outside :func:`_subtract_decodable` take :func:`decode_bits`.
    """
    if not _subtract_decodable(fmt):
        return bits_to_f32(decode_bits(fmt, codes))
    c = codes.astype(jnp.uint32)
    m_bits = fmt.mantissa_bits
    mag = c & ((1 << fmt.magnitude_bits) - 1)
    low = mag < (1 << m_bits)  # exponent field 0: zero or subnormal
    rebias = (F32_BIAS - fmt.bias) << F32_MANT_BITS
    u = lax.shift_left(mag, jnp.uint32(F32_MANT_BITS - m_bits)) + jnp.where(
        low, jnp.uint32(rebias + F32_IMPLICIT), jnp.uint32(rebias)
    )
    hidden = np.float32(2.0 ** (1 - fmt.bias))
    bits = f32_bits(bits_to_f32(u) - jnp.where(low, hidden, np.float32(0)))
    if fmt.inf:
        inf_code = fmt.inf_code
        special = jnp.where(mag == inf_code, jnp.uint32(F32_INF), jnp.uint32(F32_QNAN))
        bits = jnp.where(mag >= inf_code, special, bits)
    elif fmt.nan == "all_ones":
        bits = jnp.where(mag == (1 << fmt.magnitude_bits) - 1, jnp.uint32(F32_QNAN), bits)
    if fmt.signed:  # the sign bit moved to bit 31; the bits below it shifted out of the mask
        to_sign = jnp.uint32(F32_SIGN_SHIFT - fmt.magnitude_bits)
        bits = bits | (lax.shift_left(c, to_sign) & jnp.uint32(F32_SIGN))
    return bits_to_f32(bits)


def _decode_twos_complement(fmt: ElementFormat, c):
    """Two's-complement codes (INT8: k in [-128, 127]) → float32 patterns of k × 2^(emin - M).

    |k| <= 2^(bits-1) converts exactly to float32; the scale moves its exponent field (every
    nonzero value is a float32 normal: INT8's smallest is 2^-6).
    """
    width = fmt.code_bits
    c = c & ((1 << width) - 1)
    negative = lax.shift_right_logical(c, jnp.uint32(width - 1)) != 0
    mag = jnp.where(negative, (1 << width) - c, c)
    as_float = lax.bitcast_convert_type(mag.astype(jnp.float32), jnp.uint32)
    scaled = as_float + jnp.uint32(exponent_addend(fmt.emin - fmt.mantissa_bits))
    bits = jnp.where(mag == 0, jnp.uint32(0), scaled)
    return bits | lax.shift_left(negative.astype(jnp.uint32), jnp.uint32(F32_SIGN_SHIFT))
