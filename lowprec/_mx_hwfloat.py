"""The block encoder's hardware-float path: element quotients by float32 hardware arithmetic
where that is provably exact, then a short saturating round-to-nearest-even encode.

The exact encoder (``_encode.encode_bits`` with ``scale_exp``, NVFP4's integer float32
steps) never relies on float arithmetic, because XLA on CPU flushes float32 subnormals and
rewrites divisions by a broadcast into products with a reciprocal (docs/design.md §8). That
costs ~40 integer operations per element. Yet for almost every block the quotient |x| / scale
is one correctly rounded float32 operation whose operands and result are normal: then the
hardware gives the exact float32 quotient, and where its operands or result would be
subnormal, the element rounds to zero whatever the backend does with them. A scheme states
when that holds (its ``fast_encoder()``, a ``_scheme.FastEncoder``: ``scales`` gives one
flag for the whole array, ``operands`` a per-block operand); the block encoder
(``_mx_encode.py``) then takes this path on CPU and the exact one otherwise, so the codes
are the same bits either way.

The element encode here serves nearest-even rounding with saturation (quantize_mx's default)
of the MX element formats (:func:`hwfloat_element`): from the float32 magnitude q, a normal
result is a rebias of the exponent field and a rounding add (the carry moves into the
exponent), a result below the element's smallest normal is one float32 add of a "magic"
power of two whose ulp is the element's subnormal quantum (the add rounds q to that quantum,
to nearest even), and a min saturates. Every q below 2^-126 rounds to code 0 in every MX
element format (their subnormal quanta are 2^-17 at the smallest), whether or not a backend
flushes it, so the hardware-float quotients may be flushed there.
"""

from __future__ import annotations

import functools

import numpy as np

from ._bits import F32_ABS, F32_BIAS, F32_EMAX, F32_EMIN, F32_MANT_BITS, F32_SIGN_SHIFT, bits_to_f32
from ._format import ElementFormat
from ._lazy import lazy_module

# Imported on first use: the checkpoint command line's native path needs no JAX.
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")


@functools.lru_cache(maxsize=None)  # read per call by the dispatch; the format's properties cost
def hwfloat_element(el: ElementFormat) -> bool:
    """Whether :func:`encode_magnitudes` encodes ``el`` (static): a signed element format with
    zero and subnormals whose ties go by the significand, a narrower exponent range than
    float32 and half a subnormal quantum above 2^-126 (so every float32 below 2^-126 rounds
    to code 0); sign-magnitude (FP8, FP6, FP4), or two's complement with every value on the
    subnormal grid (the MX INT8 element: k / 64, |k| <= 127)."""
    if not (el.signed and el.zero and el.subnormals and el.ties == "significand"):
        return False
    if not (el.mantissa_bits < F32_MANT_BITS and el.emax < F32_EMAX
            and el.emin - el.mantissa_bits - 1 > F32_EMIN):
        return False
    if el.encoding == "sign_magnitude":
        return True
    return el.encoding == "twos_complement" and el.max_finite < 2.0 ** el.emin


def half_quantum_exponent(el: ElementFormat) -> int:
    """log2 of half the smallest subnormal of ``el``, 2^(emin - M - 1): magnitudes up to it
    round to code 0 (to nearest even)."""
    return el.emin - el.mantissa_bits - 1


def encode_magnitudes(el: ElementFormat, q):
    """Magnitude codes (uint32) of the float32 magnitudes with bit patterns ``q`` (uint32, sign
    bit clear; +inf allowed), rounded to nearest even and saturated at ``el``'s largest finite
    magnitude. Exactly ``encode_bits(el, q, "nearest_even", "saturate", None)`` for such q,
    for the formats of :func:`hwfloat_element`, except that a q below 2^-126 may come flushed
    to zero (it gives code 0 either way)."""
    m = el.mantissa_bits
    shift = F32_MANT_BITS - m
    # Normal results: move the exponent field from float32's bias to the element's and add
    # half an element ulp less one, plus the kept lsb (ties to even), then drop the bits.
    # Below the element's smallest normal this wraps; the select below discards it.
    rebias = (((el.bias - F32_BIAS) << F32_MANT_BITS) + (1 << (shift - 1)) - 1) % (1 << 32)
    lsb = lax.shift_right_logical(q, jnp.uint32(shift)) & 1
    normal = lax.shift_right_logical(q + jnp.uint32(rebias) + lsb, jnp.uint32(shift))
    # Results below 2^emin: q + 2^(emin - M + 23) rounds q to the subnormal quantum 2^(emin - M)
    # (the sum's ulp); the low bits of the sum are the code. Both operands are normal unless q
    # is below 2^-126, which rounds to 0 either way.
    magic_bits = (el.emin - m + F32_MANT_BITS + F32_BIAS) << F32_MANT_BITS
    magic = np.uint32(magic_bits).view(np.float32)
    sub = lax.bitcast_convert_type(bits_to_f32(q) + magic, jnp.uint32) - jnp.uint32(magic_bits)
    is_sub = q < jnp.uint32((el.emin + F32_BIAS) << F32_MANT_BITS)
    # The subnormal path reaches 2^emin / quantum at most: the first normal code, or for INT8
    # (all values subnormal-like) 128, one above its largest magnitude 127: saturate after.
    return jnp.minimum(jnp.where(is_sub, sub, normal), jnp.uint32(el.max_magnitude_code))


def signed_codes(el: ElementFormat, magnitude, x_bits):
    """Codes (uint32) of ``el`` from magnitude codes and the sign bits of float32 patterns
    ``x_bits``: the sign bit above the magnitude (−0 keeps it), or two's complement."""
    if el.encoding == "twos_complement":
        negative = lax.shift_right_logical(x_bits, jnp.uint32(F32_SIGN_SHIFT)) != 0
        mask = jnp.uint32((1 << el.code_bits) - 1)
        return jnp.where(negative, (jnp.uint32(0) - magnitude) & mask, magnitude)
    sign = lax.shift_right_logical(x_bits, jnp.uint32(F32_SIGN_SHIFT - el.magnitude_bits))
    return magnitude | (sign & jnp.uint32(1 << el.magnitude_bits))


def magnitudes_f32(x_bits):
    """float32 |x| of float32 patterns (the sign bit cleared on the bits)."""
    return bits_to_f32(x_bits & jnp.uint32(F32_ABS))
