"""Bit-level constants and helpers shared by the codec, MX, matmul and analysis code.

Everything that reads or builds a float32 from its bits lives here, so that each constant
has one definition. Values are written as bit patterns with their derivation alongside.
"""

from __future__ import annotations

import numpy as np

from ._lazy import lazy_module

# Imported on first use: the checkpoint command line's native path needs no JAX.
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")

# -- binary32 layout: 1 sign bit, 8 exponent bits (bias 127), 23 mantissa bits -------------
F32_EXP_BITS = 8
F32_MANT_BITS = 23
F32_BIAS = 127  # 2^(8 - 1) - 1
F32_SIGN_SHIFT = 31  # 8 + 23: the position of the sign bit
F32_EXP_MAX = 0xFF  # (1 << 8) - 1: the exponent field of inf and NaN
F32_EMIN = 1 - F32_BIAS  # -126: the exponent of the smallest normal (field 1)
F32_EMAX = 0xFE - F32_BIAS  # 127: the exponent of the largest binade (field 0xFE)
F32_SIGN = 0x8000_0000  # 1 << 31
F32_ABS = 0x7FFF_FFFF  # every bit below the sign
F32_MANT = 0x007F_FFFF  # (1 << 23) - 1
F32_IMPLICIT = 0x0080_0000  # 1 << 23: the implicit leading bit of a normal significand
F32_MANT_MSB = 0x0040_0000  # 1 << 22: the top mantissa bit (half an ulp of the binade
# above; a NaN's quiet bit; alone in a pattern, the subnormal 2^-127)
F32_INF = 0x7F80_0000  # exponent field all ones (0xFF << 23), mantissa 0
F32_QNAN = 0x7FC0_0000  # F32_INF | 1 << 22: the canonical quiet NaN
BF16_MANT_BITS = 7  # bfloat16: float32's top 16 bits
F32_MAX = 0x7F7F_FFFF  # (2 - 2^-23) * 2^127
# Unbiased exponent of the last bit of a float32 subnormal: 2^-149 = 2^(1 - 127 - 23).
F32_MIN_LSB_EXP = 1 - F32_BIAS - F32_MANT_BITS

# -- binary64 layout: 1 sign bit, 11 exponent bits (bias 1023), 52 mantissa bits ------------
F64_MANT_BITS = 52
F64_BIAS = 1023  # 2^(11 - 1) - 1
F64_SIGN_SHIFT = 63  # 11 + 52
F64_EXP_MAX = 0x7FF  # (1 << 11) - 1: the exponent field of inf and NaN

# -- E8M0, the MX scale format: code k is 2^(k - 127); 0xFF is NaN ---------------------------
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E8M0_MAX_EXP = 0xFE - E8M0_BIAS  # 127: code 0xFE
E8M0_MIN_EXP = -E8M0_BIAS  # -127: code 0x00


def exponent_addend(delta: int) -> int:
    """The uint32 that adds ``delta`` (any sign) to a float32 pattern's exponent field:
    ``delta << 23`` modulo 2^32, so a negative ``delta`` wraps to the subtraction.

    Example:
        >>> hex(exponent_addend(1)), hex(exponent_addend(-1))
        ('0x800000', '0xff800000')
    """
    return (delta << F32_MANT_BITS) % (1 << (F32_SIGN_SHIFT + 1))


def f32_bits(x):
    """uint32 bit patterns of a float32 array (other float dtypes are converted first)."""
    return lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.float32), jnp.uint32)


def bits_to_f32(bits):
    """float32 values of uint32 bit patterns."""
    return lax.bitcast_convert_type(bits, jnp.float32)


def clz(x):
    """Leading zero bits of unsigned integers (int32), counted on the same-width signed
    bitcast: the same bits, and the form Triton lowers (it refuses ``math.ctlz`` on
    unsigned tensors, so a Pallas kernel calling this compiles for a GPU)."""
    signed = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[jnp.dtype(x.dtype).itemsize]
    return lax.clz(lax.bitcast_convert_type(x, signed)).astype(jnp.int32)


def floor_log2_bits(bits):
    """floor(log2 v) for the float32 pattern ``bits`` of v ≥ 0 (int32; v = 0 gives -150).

    Exact for subnormals: the leading bit of the significand gives the binade.

    Example:
        >>> import jax.numpy as jnp
        >>> floor_log2_bits(f32_bits(jnp.array([1.0, 3.0, 2.0**-140]))).tolist()
        [0, 1, -140]
    """
    efield = lax.shift_right_logical(bits, jnp.uint32(F32_MANT_BITS)).astype(jnp.int32)
    sig = jnp.where(efield > 0, (bits & F32_MANT) | F32_IMPLICIT, bits & F32_MANT)
    # For a normal v the leading bit of sig is bit 23 (clz = 8); each step lower is one binade.
    lsb_exp = jnp.maximum(efield, 1) - (F32_BIAS + F32_MANT_BITS)
    return lsb_exp + F32_SIGN_SHIFT - clz(sig)  # bit 31 - clz: sig's leading bit


def pow2_f32(n):
    """float32 2^n built from bits: exact for n in [-149, 127]; 0 below, inf above.

    Example:
        >>> pow2_f32(jnp.array([-149, 0, 127, 128])).tolist()[1:]
        [1.0, 1.7014118346046923e+38, inf]
    """
    n = jnp.asarray(n, jnp.int32)
    field = jnp.clip(n + F32_BIAS, 1, F32_EXP_MAX - 1).astype(jnp.uint32)
    normal = lax.shift_left(field, jnp.uint32(F32_MANT_BITS))
    sub_bit = jnp.clip(n - F32_MIN_LSB_EXP, 0, F32_MANT_BITS - 1).astype(jnp.uint32)
    sub = lax.shift_left(jnp.uint32(1), sub_bit)
    bits = jnp.where(n >= F32_EMIN, normal, jnp.where(n >= F32_MIN_LSB_EXP, sub, jnp.uint32(0)))
    bits = jnp.where(n > F32_EMAX, jnp.uint32(F32_INF), bits)
    return bits_to_f32(bits)


def times_pow2(v, n):
    """``v * 2^n`` for float32 ``v`` and integer ``n``: exact whenever the result is normal.

    The factor is applied in two halves, each a normal float32, so 2^n itself never has to
    be representable (n is clipped to [-252, 252], beyond any float32 result).
    """
    n = jnp.clip(jnp.asarray(n, jnp.int32), -252, 252)
    a = jnp.floor_divide(n, 2)
    return (jnp.asarray(v, jnp.float32) * pow2_f32(a)) * pow2_f32(n - a)


def rint_small(x):
    """uint32 nearest-even integers of float32 ``x`` in [0, 2^23]: x + 2^23 (ulp 1) rounds
    it, and the sum's pattern minus 2^23's is the integer (2^24's minus 2^23's is 2^23). One
    float add of normals, which every backend (and the Pallas Triton lowering, which has no
    round) computes alike."""
    magic = np.float32(2.0**F32_MANT_BITS)
    return f32_bits(x + magic) - jnp.uint32((F32_BIAS + F32_MANT_BITS) << F32_MANT_BITS)


def scale_bits_by_e8m0(value_bits, scale_codes, out_bits: int = 32):
    """Patterns of value × 2^(scale − 127), exactly, subnormal results included, as float32
    (``out_bits=32``) or bfloat16 (16: rounded to nearest even), in a uint32.

    ``scale_codes`` are E8M0 codes broadcastable to ``value_bits``. An infinite value stays
    ±inf under any finite scale; NaN values and the NaN scale 0xFF give the quiet NaN
    (unsigned). A normal result is the value's pattern with ``s − 127`` added to its
    exponent field (an integer add). A result below 2^-126 is the integer
    ``rint(|value| · 2^(s + 22))`` (2^(s + 6) for bfloat16), the pattern of a subnormal (or,
    rounded up, of the smallest normal); that float is built by an add to the exponent
    field too, so it is a normal and the one float operation (an add that rounds it) never
    sees a subnormal a backend could flush (docs/design.md §8). ``value_bits``
    are float32 patterns of normals with at most 8 significant bits (every MX element; for
    bfloat16 output, so that a normal result is exact there), zeros, infs or NaNs.
    """
    sign = value_bits & jnp.uint32(F32_SIGN)
    mag = value_bits & jnp.uint32(F32_ABS)
    t = scale_codes.astype(jnp.int32) - E8M0_BIAS  # the block's exponent
    nf = lax.shift_right_logical(mag, jnp.uint32(F32_MANT_BITS)).astype(jnp.int32) + t
    # The exponent moved on the bits: the result's pattern when normal (wraps below 2^-126).
    normal = mag + lax.shift_left(t, jnp.int32(F32_MANT_BITS)).astype(jnp.uint32)
    # Below 2^-126: |value| · 2^(s - 127) in units of the output's subnormal quantum,
    # 2^-149 (float32: 149 = 126 + 23) or 2^-133 (bfloat16: 126 + 7), a float32 normal in
    # [2^-120, 2^23): exact for float32, rounded to nearest even (bfloat16, and the carry into
    # the smallest normal) by rint_small (the fake-quantize kernel decodes with this, and
    # the Pallas Triton lowering has no round).
    lift = -F32_EMIN + (F32_MANT_BITS if out_bits == 32 else BF16_MANT_BITS)
    sub = rint_small(bits_to_f32(normal + jnp.uint32(lift << F32_MANT_BITS)))
    shift = jnp.uint32(32 - out_bits)
    out = jnp.where(nf < 1, sub, lax.shift_right_logical(normal, shift))
    out = jnp.where(nf >= F32_EXP_MAX, jnp.uint32(F32_INF >> (32 - out_bits)), out)
    # Zero and inf keep their own pattern (mag - 1 wraps for zero); NaN values and the NaN
    # scale give the quiet NaN.
    special = (mag - jnp.uint32(1)) >= jnp.uint32(F32_INF - 1)
    out = jnp.where(special, lax.shift_right_logical(mag, shift), out)
    out = out | lax.shift_right_logical(sign, shift)
    nan = (mag > F32_INF) | (scale_codes == E8M0_NAN)
    return jnp.where(nan, jnp.uint32(F32_QNAN >> (32 - out_bits)), out)


def bits_to_bf16_bits(bits):
    """bfloat16 patterns (in a uint32) of float32 ``bits`` rounded to nearest even: the
    element encoder's result (overflow to ±inf, subnormals rounded, NaN the quiet NaN with
    its sign) in a few integer operations and a select: bfloat16 is float32's top half,
    so adding 0x7FFF plus the kept half's last bit carries exactly when it rounds up (into
    the exponent, and onto the infinity pattern past the largest finite)."""
    kept = lax.shift_right_logical(bits, jnp.uint32(16))
    rounded = lax.shift_right_logical(bits + jnp.uint32(0x7FFF) + (kept & jnp.uint32(1)),
                                      jnp.uint32(16))
    nan = (kept & jnp.uint32(F32_SIGN >> 16)) | jnp.uint32(F32_QNAN >> 16)
    return jnp.where((bits & jnp.uint32(F32_ABS)) > jnp.uint32(F32_INF), nan, rounded)


def bits_to_bf16_truncating(bits):
    """bfloat16 whose bits are the top half of float32 ``bits`` (exact iff the low 16 are 0)."""
    return lax.bitcast_convert_type(
        lax.shift_right_logical(bits, jnp.uint32(16)).astype(jnp.uint16), jnp.bfloat16
    )
