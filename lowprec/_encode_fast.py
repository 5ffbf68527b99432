"""Fast element encoders for float32 input under the "ieee" overflow policy.

Same results as the general encoder (``_encode.encode_bits``), bit for bit, in fewer
operations: a rebias-and-round for the small signed float formats (nearest even and
stochastic rounding), and a shift for E8M0 (both nearest modes). Stochastic rounding with
16-bit words (the key's words, or caller uint16 words) has its own encoders, which take the
word's complement 0xFFFF − r and need no variable shift: :func:`stochastic16_encoder` picks
one for the rebias formats, the formats with float32's exponent range (bf16, tf32) and E8M0.
Each applies where the format's fields fit its preconditions (:func:`rebias_encodable`,
:func:`same_range_encodable`, :func:`is_e8m0`), never by name; tests/test_fast_paths.py
compares them with the general encoder for every format on samples, and
scripts/exhaustive_f32.py the default mode on every float32 input.
"""

from __future__ import annotations

import numpy as np

from ._bits import (
    E8M0_NAN,
    F32_ABS,
    F32_BIAS,
    F32_EMAX,
    F32_EMIN,
    F32_EXP_BITS,
    F32_IMPLICIT,
    F32_INF,
    F32_MANT,
    F32_MANT_BITS,
    F32_MANT_MSB,
    F32_SIGN,
    F32_SIGN_SHIFT,
    bits_to_f32,
    f32_bits,
    rint_small,
)
from ._lazy import lazy_module
from ._random import WORD_BITS
from ._format import ElementFormat

# Imported on first use: the checkpoint command line's native path needs no JAX.
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")


def rebias_encodable(fmt: ElementFormat) -> bool:
    """Whether :func:`encode_rebias` encodes ``fmt`` (static): a signed float format with
    zero and subnormals, a narrower exponent range than float32, every overflow going to
    one code just above the largest finite one (+inf for IEEE formats, the NaN code of
    all-ones formats), and a subnormal quantum whose float32 "magic" is normal."""
    over = fmt.inf_code if fmt.nan == "ieee" and fmt.inf else (
        fmt.nan_code if fmt.nan == "all_ones" else None)
    return (
        fmt.encoding == "sign_magnitude" and fmt.ties == "significand"
        and fmt.signed and fmt.zero and fmt.subnormals and over == fmt.max_magnitude_code + 1
        and fmt.emin > F32_EMIN and fmt.emax < F32_EMAX and fmt.mantissa_bits < F32_MANT_BITS
        and fmt.emin - fmt.mantissa_bits + F32_MANT_BITS >= F32_EMIN
    )


def encode_rebias(fmt: ElementFormat, u, random_bits=None):
    """nearest_even (or, given ``random_bits``, stochastic) / "ieee" encode of float32
    patterns ``u`` (int32 codes) for the formats of :func:`rebias_encodable`, e.g. fp16,
    e5m2, e4m3.

    Normal results: rebias the exponent field and round the mantissa by adding a bias below
    the cut (half − 1, plus the kept lsb), then shift; the carry moves into the exponent and,
    past the largest finite value, onto the overflow code, where ``min`` holds every larger
    magnitude (inf, and NaN for all-ones formats, included). Subnormal results (|x| < 2^emin):
    one float32 add of the "magic" 2^(emin − M + 23), whose ulp is the format's subnormal
    quantum, so the add rounds |x| to that quantum (to nearest even) and the difference of
    the bit patterns is the code (F. Giesen's float_to_half_fast3_rtne). Every operand of
    the add is a float32 normal except an |x| below 2^-126, which rounds to 0 whether or not
    the backend flushes it (the code is 0 either way).

    Stochastic: element i rounds away from zero iff r_i < frac_i · 2^32 (``round_shift``'s
    rule) ⇔ ⌊r_i / 2^(32 − s)⌋ < rem_i, s the bits dropped and rem_i their value, so adding
    (2^32 − 1 − r_i) >> (32 − s) below the cut carries exactly then. Normal results drop the
    fixed 23 − M bits; subnormal results s_i ≥ 23 − M bits of the significand with its
    implicit bit, the same addend up to s_i = 31, and past that the whole significand is
    below the cut (code 0 or 1: up iff r_i < ⌈sig_i / 2^(s_i − 32)⌉).
    """
    m_bits = fmt.mantissa_bits
    shift = F32_MANT_BITS - m_bits
    sign = u & jnp.uint32(F32_SIGN)
    mag = u & jnp.uint32(F32_ABS)
    over = fmt.inf_code if fmt.inf else fmt.nan_code
    # Normal path: (mag − (127 − bias) << 23 + half − 1 + lsb) >> shift, in uint32 (mag ≥
    # 2^emin here, so the rebiasing never goes below zero).
    is_sub = mag < jnp.uint32((fmt.emin + F32_BIAS) << F32_MANT_BITS)
    if random_bits is None:
        rebias = (((fmt.bias - F32_BIAS) << F32_MANT_BITS) + (1 << (shift - 1)) - 1) % (1 << 32)
        lsb = lax.shift_right_logical(mag, jnp.uint32(shift)) & 1
        normal = lax.shift_right_logical(mag + jnp.uint32(rebias) + lsb, jnp.uint32(shift))
        magic_bits = (fmt.emin - m_bits + F32_MANT_BITS + F32_BIAS) << F32_MANT_BITS
        magic = np.uint32(magic_bits).view(np.float32)
        sub = f32_bits(bits_to_f32(mag) + magic) - jnp.uint32(magic_bits)
    else:
        not_r = ~random_bits.astype(jnp.uint32)
        rebias = ((fmt.bias - F32_BIAS) << F32_MANT_BITS) % (1 << 32)
        add = lax.shift_right_logical(not_r, jnp.uint32(32 - shift))
        normal = lax.shift_right_logical(mag + jnp.uint32(rebias) + add, jnp.uint32(shift))
        efield = lax.shift_right_logical(mag, jnp.uint32(F32_MANT_BITS))
        sig = jnp.where(efield > 0, (mag & jnp.uint32(F32_MANT)) | jnp.uint32(F32_IMPLICIT),
                        mag)
        # Bits dropped: the quantum 2^(emin − M) over the input's last bit 2^(max(e, 1) − 150).
        s = (fmt.emin - m_bits + F32_BIAS + F32_MANT_BITS) - jnp.maximum(efield, 1).astype(jnp.int32)
        s_add = jnp.clip(s, 1, 31).astype(jnp.uint32)
        small = lax.shift_right_logical(
            sig + lax.shift_right_logical(not_r, jnp.uint32(32) - s_add), s_add)
        k = jnp.clip(s - 32, 0, 31).astype(jnp.uint32)
        thr = jnp.where(sig == 0, jnp.uint32(0),
                        lax.shift_right_logical(sig - 1, k) + 1)  # ⌈sig / 2^(s − 32)⌉
        tiny = (random_bits.astype(jnp.uint32) < thr).astype(jnp.uint32)
        sub = jnp.where(s <= 31, small, tiny)
    normal = jnp.minimum(normal, jnp.uint32(over))
    code = jnp.where(is_sub, sub, normal)
    return _with_nan_and_sign(fmt, code, mag, sign)


def _with_nan_and_sign(fmt: ElementFormat, code, mag, sign):
    """int32 codes of the rebias encoders: magnitude codes ``code`` (inf already saturated
    to the overflow code by the caller), NaN magnitudes ``mag`` given the format's NaN code
    where it has infinities, and the sign bits of ``sign`` (float32 patterns' top bit)."""
    if fmt.inf:  # NaN has its own code (inf is handled by the caller's min)
        code = jnp.where(mag > jnp.uint32(F32_INF), jnp.uint32(fmt.nan_code), code)
    code = code | lax.shift_right_logical(sign, jnp.uint32(F32_SIGN_SHIFT - fmt.magnitude_bits))
    return code.astype(jnp.int32)


def is_e8m0(fmt: ElementFormat) -> bool:
    """Whether ``fmt`` is E8M0: unsigned powers of two 2^(code − 127), 0xFF NaN (static)."""
    return (
        not fmt.signed and not fmt.zero and fmt.mantissa_bits == 0
        and fmt.exponent_bits == F32_EXP_BITS and fmt.bias == F32_BIAS
        and fmt.nan == "all_ones" and fmt.nan_code == E8M0_NAN
    )


def encode_e8m0_nearest(u):
    """E8M0 encode of float32 patterns ``u`` to nearest (ties up) with "ieee" overflow, int32.

    A normal x rounds up iff its mantissa is at least one half: (u + 2^22) >> 23 is the
    code, 0xFF (NaN) from 2^127·1.5 up, inf and NaN included (``min`` caps NaN patterns).
    Float32 subnormals follow ml_dtypes: (2^-127, 2^-126) → 1 (2^-126), the rest → 0
    (2^-127). Zero and negatives (sign bit set: −0, −NaN too) have no code but NaN.
    """
    half = jnp.uint32(F32_MANT_MSB)
    normal = jnp.minimum(lax.shift_right_logical(u + half, jnp.uint32(F32_MANT_BITS)), E8M0_NAN)
    code = jnp.where(u < jnp.uint32(F32_IMPLICIT), (u > half).astype(jnp.uint32), normal)
    # u − 1 wraps for u = 0, so one unsigned compare catches +0 and every negative pattern.
    no_code = (u - jnp.uint32(1)) >= jnp.uint32(F32_ABS)
    return jnp.where(no_code, jnp.uint32(E8M0_NAN), code).astype(jnp.int32)


# -- stochastic rounding with 16-bit words ----------------------------------------------------
# Each encoder takes ``nr = 0xFFFF − r`` (uint32), r the element's 16-bit word, and rounds
# away from zero iff r < frac · 2^16 (the contract), frac being the dropped part of the
# magnitude in units of the result's last place. With s ≥ 1 bits dropped (their value rem),
# r < rem · 2^(16 − s) ⇔ ⌊r / 2^(16 − s)⌋ < rem for s ≤ 16 and ⇔ r · 2^(s − 16) < rem for
# s > 16, so adding the complement of r scaled to the cut, nr >> (16 − s) or
# (nr << (s − 16)) + 2^(s − 16) − 1, carries into the kept bits exactly then. The general
# encoder compares 32-bit words r · 2^16 with frac · 2^32, which decides alike.


def _carry_addend(nr, shift: int):
    """``nr`` aligned below a cut ``shift`` bits up: the addend that carries iff the dropped
    ``shift`` bits exceed the word (see above). Static ``shift`` in 1..31."""
    if shift <= WORD_BITS:
        return lax.shift_right_logical(nr, jnp.uint32(WORD_BITS - shift))
    fill = (1 << (shift - WORD_BITS)) - 1
    return lax.shift_left(nr, jnp.uint32(shift - WORD_BITS)) + jnp.uint32(fill)


def encode_rebias_stochastic16(fmt: ElementFormat, u, nr):
    """Stochastic / "ieee" encode of float32 patterns ``u`` (int32 codes) for the formats of
    :func:`rebias_encodable`, given the word complements ``nr``.

    Normal results: :func:`encode_rebias`'s rebias with the carry addend in place of the
    rounding bias. Subnormal results (|x| < 2^emin): the quantum is 2^(emin − M) whatever
    x's exponent, so T = |x| · 2^(M + 16 − emin), a float32 multiply by a power of two and
    exact (T < 2^(M + 16)), is |x| in units of 2^-16 quanta: the code rounded toward zero
    is ⌊T / 2^16⌋ and frac · 2^16 = T mod 2^16. As r is an integer, r < y ⇔ r < ⌈y⌉, so
    the code is (⌈T⌉ + nr) >> 16 (⌈T⌉ exact). ⌈T⌉ becomes an integer by adding 2^23 and reading the pattern's
    low bits where T < 2^23 (FP8), by a float-to-int conversion otherwise (fp16). A float32
    subnormal x (|x| < 2^-126; flushed to zero by XLA on CPU) has 0 < T < 1, so ⌈T⌉ = 1
    for x ≠ 0: the integer max with min(|x|'s pattern, 1) gives that on every backend.
    """
    m_bits = fmt.mantissa_bits
    shift = F32_MANT_BITS - m_bits
    sign = u & jnp.uint32(F32_SIGN)
    mag = u & jnp.uint32(F32_ABS)
    over = fmt.inf_code if fmt.inf else fmt.nan_code
    rebias = ((fmt.bias - F32_BIAS) << F32_MANT_BITS) % (1 << 32)
    normal = lax.shift_right_logical(mag + jnp.uint32(rebias) + _carry_addend(nr, shift),
                                     jnp.uint32(shift))
    normal = jnp.minimum(normal, jnp.uint32(over))
    scale = np.float32(2.0 ** (m_bits + WORD_BITS - fmt.emin))
    t_ceil = jnp.ceil(bits_to_f32(mag) * scale)
    if m_bits + WORD_BITS <= F32_MANT_BITS:  # ⌈T⌉ ≤ 2^(M + 16) ≤ 2^23: an integer already
        units = rint_small(t_ceil)
    else:  # ⌈T⌉ < 2^26 (fp16): an exact conversion
        units = t_ceil.astype(jnp.int32).astype(jnp.uint32)
    units = jnp.maximum(units, jnp.minimum(mag, jnp.uint32(1)))
    sub = lax.shift_right_logical(units + nr, jnp.uint32(WORD_BITS))
    is_sub = mag < jnp.uint32((fmt.emin + F32_BIAS) << F32_MANT_BITS)
    code = jnp.where(is_sub, sub, normal)
    return _with_nan_and_sign(fmt, code, mag, sign)


def same_range_encodable(fmt: ElementFormat) -> bool:
    """Whether ``fmt`` has float32's exponent range and IEEE specials, so that its code is
    the top bits of a float32 magnitude (bf16, tf32; static): the general encoder's
    shortcut for such formats."""
    return (
        fmt.encoding == "sign_magnitude" and fmt.ties == "significand"
        and fmt.signed and fmt.zero and fmt.inf and fmt.nan == "ieee"
        and fmt.emin == F32_EMIN and fmt.mantissa_bits < F32_MANT_BITS
    )


def encode_same_range_stochastic16(fmt: ElementFormat, u, nr):
    """Stochastic / "ieee" encode of float32 patterns ``u`` (int32 codes) for the formats of
    :func:`same_range_encodable`: the magnitude plus the carry addend, shifted. The carry
    moves into the exponent field by itself (subnormals included) and from the largest
    finite value onto infinity, as rounding to nearest does (IEEE 754 §7.4)."""
    shift = F32_MANT_BITS - fmt.mantissa_bits
    sign = u & jnp.uint32(F32_SIGN)
    mag = u & jnp.uint32(F32_ABS)
    code = lax.shift_right_logical(mag + _carry_addend(nr, shift), jnp.uint32(shift))
    code = jnp.where(mag > jnp.uint32(F32_INF), jnp.uint32(fmt.nan_code), code)
    code = code | lax.shift_right_logical(sign, jnp.uint32(F32_SIGN_SHIFT - fmt.magnitude_bits))
    return code.astype(jnp.int32)


def encode_e8m0_stochastic16(u, nr):
    """E8M0 stochastic encode of float32 patterns ``u`` with "ieee" overflow (int32), given
    the word complements ``nr``.

    A normal x = 2^e · (1 + m/2^23) rounds up to 2^(e+1) iff r < m · 2^-7: the code is
    (u + addend) >> 23, capped by ``min`` at 0xFF (NaN: the "ieee" overflow of a value of
    the top binade rounding up, and of inf and NaN). A float32
    subnormal x lies below 2^-126 (code 1): from 2^-127 (code 0, pattern 2^22) up it rounds
    between codes 0 and 1 with frac = (pattern − 2^22) / 2^22, which is the normal rule on
    the doubled pattern, one code lower; below 2^-127 it is code 0 (the general encoder's
    rule for values under the smallest code). Zero and negatives (sign bit set) have no code
    but NaN.
    """
    add = _carry_addend(nr, F32_MANT_BITS)
    normal = jnp.minimum(lax.shift_right_logical(u + add, jnp.uint32(F32_MANT_BITS)), E8M0_NAN)
    doubled = lax.shift_right_logical(lax.shift_left(u, jnp.uint32(1)) + add,
                                      jnp.uint32(F32_MANT_BITS))
    sub = jnp.maximum(doubled, jnp.uint32(1)) - jnp.uint32(1)
    code = jnp.where(u < jnp.uint32(F32_IMPLICIT), sub, normal)
    no_code = (u - jnp.uint32(1)) >= jnp.uint32(F32_ABS)  # +0 and every negative pattern
    return jnp.where(no_code, jnp.uint32(E8M0_NAN), code).astype(jnp.int32)


def stochastic16_encoder(fmt: ElementFormat):
    """The encoder ``f(fmt, u, nr)`` of stochastic rounding with 16-bit words for float32
    patterns under "ieee" overflow, or None where ``fmt`` takes the general encoder
    (static)."""
    if rebias_encodable(fmt):
        return encode_rebias_stochastic16
    if same_range_encodable(fmt):
        return encode_same_range_stochastic16
    if is_e8m0(fmt):
        return _e8m0_stochastic16
    return None


def _e8m0_stochastic16(fmt: ElementFormat, u, nr):
    """:func:`encode_e8m0_stochastic16` with the common signature (``fmt`` is E8M0)."""
    del fmt
    return encode_e8m0_stochastic16(u, nr)
