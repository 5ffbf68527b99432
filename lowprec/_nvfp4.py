"""NVFP4's two-level scales: a float32 per-tensor scale times an E4M3 scale per 16 elements.

lowprec follows torchao's NVFP4 recipe (``torchao.prototype.mx_formats.nvfp4_tensor``:
``per_tensor_amax_to_scale`` and ``_nvfp4_quantize``), step for step, each step one IEEE
float32 operation rounded to nearest even::

    tensor_scale = amax / (448 * 6)                      # F8E4M3_MAX * F4_E2M1_MAX = 2688
    block_scale  = e4m3(clamp((block_amax / 6) / tensor_scale, 2^-6, 448))
    element      = e2m1(clamp(x / (tensor_scale * block_scale), -6, 6))

and a value decodes as ``element * (tensor_scale * block_scale)`` (torchao's ``to_dtype``:
the scale product rounded to float32, then the product with the element).
Every one of those operations is carried out here on float32 *bit patterns* with integer
arithmetic (long division for the quotients), so the result is the IEEE one on every backend:
XLA on CPU would flush subnormal operands and rewrite ``a / broadcast(c)`` as
``a * (1 / c)`` under ``jit`` (docs/design.md §8), which changes quotients in the last bit.
On CPU the quotients take XLA's float32 division wherever it is provably the IEEE one (normal
operands and quotient, the divisor per element or behind a barrier) and integer steps for the
rest (:func:`div_by_integer`, :func:`element_quotient_bits`): a few operations instead of the
long division, which made most of the NVFP4 training step's program (benchmarks/README.md).

NVINT4 (INT4 elements k ∈ [−7, 7], Chen et al. 2025) takes the same steps with its element's
largest value Q = 7 in place of 6: tensor scale amax / (448 * 7), block scale
e4m3((block_amax / 7) / tensor_scale). Every step below holds for any 4-bit element whose
nonzero values are multiples of 1/2, at least 1/2, with at most 6 significant bits (the
scheme checks it: ``_scheme_nvfp4.NVFP4Scheme.check_element``).

Conventions where torchao is silent or fails (docs/design.md §3b): ``amax`` is the largest
*finite* magnitude (a block holding NaN/±inf gets the E4M3 NaN scale 0x7F and dequantizes to
NaN, as an MX block does); an all-zero tensor gets tensor scale 1 (as TransformerEngine's
NVFP4 recipe does; torchao would divide 0 by 0); a tensor scale (computed or given) below 2^-143
is raised to it, so that every block's divisor ``tensor_scale * block_scale`` (block scales are at
least 2^-6) is a positive float32 — below it torchao divides by an underflowed zero.
"""

from __future__ import annotations

import contextlib

from fractions import Fraction

import numpy as np

from ._bits import (F32_ABS, F32_IMPLICIT, F32_INF, F32_MANT, F32_MANT_BITS, F32_QNAN, F32_SIGN,
                    bits_to_f32, f32_bits, rint_small)
from ._decode import decode_bits
from ._encode import encode_bits
from ._format import ElementFormat
from ._lazy import lazy_module
from ._rounding import round_shift

# Imported on first use: the checkpoint command line's native path needs no JAX.
jax = lazy_module("jax")
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")
_platform = lazy_module("lowprec._platform")

# 448 * 6: the largest E4M3 value times the largest E2M1 value. 2688 = 21 * 2^7.
NVFP4_AMAX_DIVISOR = 2688.0
_E4M3_EPS_BITS = 0x3C80_0000  # 2^-6 = 0x3C800000: the smallest normal E4M3 (torchao E4M3_EPS)
_E4M3_MAX_BITS = 0x43E0_0000  # 448 = 1.75 * 2^8 = 0x43E00000
_E2M1_MAX = 6.0
_F32_ONE = 0x3F80_0000
MIN_TENSOR_SCALE_BITS = 1 << 6  # 2^-143 = 2^6 * 2^-149 (a float32 subnormal): 2^-143 * 2^-6 > 0
# The "reciprocal" step's factor (1 / ts) / s stays finite for every block scale s >= 2^-6
# iff 1 / ts <= 2^121, i.e. ts >= 2^-121 = 0x03000000 ((127 - 121) << 23). torchao 0.17
# itself computes inf there (and 1 / ts alone is inf below 2^-128); lowprec raises ts to it.
MIN_RECIPROCAL_TENSOR_SCALE_BITS = (127 - 121) << 23



def _f32_const_bits(v: float) -> int:
    """Bits of a float32 constant that is exactly a float32 (checked)."""
    import numpy as np

    f = np.float32(v)
    assert Fraction(float(f)) == Fraction(v), v
    return int(f.view(np.uint32))


def _clz(x):
    """Leading zeros of uint32 ``x`` (32 for 0) as int32: ``lax.clz``, or in a kernel body a
    binary search over the top 16, 8, 4, 2, 1 bits."""
    if _platform_branches:
        return lax.clz(x).astype(jnp.int32)
    n = jnp.zeros(x.shape, jnp.int32)
    for s in (16, 8, 4, 2, 1):
        top_zero = lax.shift_right_logical(x, jnp.uint32(32 - s)) == 0
        n = n + jnp.where(top_zero, jnp.int32(s), jnp.int32(0))
        x = jnp.where(top_zero, lax.shift_left(x, jnp.uint32(s)), x)
    return n + jnp.where(x == 0, jnp.int32(1), jnp.int32(0))


def _split(bits):
    """Finite nonzero float32 bits → (significand in [2^23, 2^24) as uint32, exponent of its
    last bit as int32): value = sig * 2^exp. Subnormals are normalized with clz."""
    mag = bits & F32_ABS
    efield = lax.shift_right_logical(mag, jnp.uint32(F32_MANT_BITS)).astype(jnp.int32)
    sig = jnp.where(efield > 0, (mag & F32_MANT) | (1 << F32_MANT_BITS), mag & F32_MANT)
    exp = jnp.maximum(efield, 1) - 150  # 1 - 127 - 23
    nz = jnp.maximum(_clz(sig) - 8, 0)  # leading bit to position 23
    return lax.shift_left(sig, nz.astype(jnp.uint32)), exp - nz


def round_to_f32(sig, exp, sign, sticky):
    """float32 bits of sign * (sig + s) * 2^exp, rounded to nearest even, where 0 <= s < 1 is
    nonzero iff ``sticky``; sig < 2^30 (uint32). Subnormal results and overflow to inf are
    handled like IEEE 754."""
    top = exp + 31 - _clz(sig)  # floor(log2 value) for sig > 0
    binade = jnp.maximum(top, -126)
    shift = binade - 23 - exp  # bits to drop (<= 0: the value is exact, shift left)
    # Fold the sticky bit in below the rounding position (one more bit to drop).
    s2 = lax.shift_left(sig, jnp.uint32(1)) | sticky.astype(jnp.uint32)
    rounded = round_shift(s2, jnp.maximum(shift + 1, 1), sign, "nearest_even")
    exact = lax.shift_left(sig, jnp.clip(-shift, 0, 31).astype(jnp.uint32)).astype(jnp.int32)
    mag_q = jnp.where(shift > 0, rounded, exact)
    # Past 2^127 the code lands on or above the infinity pattern (binade clipped so that
    # the shift cannot wrap the int32); at the clip a significand rounded up to 2^24 makes
    # (254 << 23) + 2^24 = 2^31, which wraps to the int32's minimum: also an overflow.
    code = lax.shift_left(jnp.minimum(binade, 128) + 126, jnp.int32(23)) + mag_q
    # (One unsigned compare covers both: a wrapped code reads as 2^31 or more.)
    code = jnp.where(code.astype(jnp.uint32) >= F32_INF, F32_INF, code)
    # Below 2^-150 (half the smallest subnormal) the value rounds to zero; the shift above
    # would pass the word's width there.
    code = jnp.where((sig == 0) | (top < -150), 0, code).astype(jnp.uint32)
    return code | lax.shift_left(sign.astype(jnp.uint32), jnp.uint32(31))


def f32_div(a_bits, b_bits):
    """IEEE float32 a / b, rounded to nearest even, from the bits: a finite; b nonzero, not
    NaN (an infinite b gives a signed zero).

    Long division of the 24-bit significands: the numerator's is doubled where it is the
    smaller, so that the quotient's leading bit is 1 with remainder sa - sb, then three
    8-bit steps (every partial remainder, below sb < 2^24, times 2^8 stays below 2^32) give
    a 25-bit quotient (24 bits and the rounding bit) and a sticky bit for one rounding.
    Three integer divisions per element: what a GPU runs here, where it is the costly part.
    """
    sign = lax.shift_right_logical((a_bits ^ b_bits) & jnp.uint32(F32_SIGN), jnp.uint32(31))
    sa, ea = _split(a_bits)
    sb, eb = _split(b_bits)
    smaller = sa < sb
    sa = jnp.where(smaller, lax.shift_left(sa, jnp.uint32(1)), sa)  # sa in [sb, 2 sb)
    ea = ea - smaller.astype(jnp.int32)
    q = jnp.ones_like(sa)
    r = sa - sb
    for _ in range(3):
        r = lax.shift_left(r, jnp.uint32(8))
        digit = r // sb
        q = lax.shift_left(q, jnp.uint32(8)) | digit
        r = r - digit * sb
    out = round_to_f32(q, ea - eb - 24, sign, r != 0)
    # A zero numerator or an infinite divisor (which _split reads as 2^128) gives a signed 0.
    zero = ((a_bits & F32_ABS) == 0) | ((b_bits & F32_ABS) == F32_INF)
    return jnp.where(zero, lax.shift_left(sign, jnp.uint32(31)), out)


# False while a Pallas (Triton) kernel body is traced: it lowers for one platform, so
# f32_div_hwfloat divides exactly without platform_dependent, and Triton lowers no count of
# leading zeros, so _clz searches for it. _ieee_instructions: the body is compiled for an
# NVIDIA GPU (not run by the Pallas interpreter), so the element steps may use PTX's IEEE
# instructions instead of the integer ones.
_platform_branches = True
_ieee_instructions = False


@contextlib.contextmanager
def one_platform(ieee_instructions: bool = False):
    """While tracing a Pallas kernel body (one non-CPU platform, Triton): :func:`f32_div_hwfloat`
    is the exact :func:`f32_div`, with no ``platform_dependent``, and leading zeros are
    counted by a binary search (the same counts). With ``ieee_instructions`` (a body compiled
    for an NVIDIA GPU), :func:`f32_div_hwfloat` is PTX ``div.rn.f32`` and :func:`f32_mul`
    ``mul.rn.f32``: IEEE 754 round-to-nearest-even operations with subnormals kept (PTX ISA:
    without ``.ftz``), so the same bits as the integer arithmetic for the operands they get
    (finite; the division's normal, the product's any), at a few instructions per element
    instead of ~100."""
    global _platform_branches, _ieee_instructions
    previous = _platform_branches, _ieee_instructions
    _platform_branches, _ieee_instructions = False, ieee_instructions
    try:
        yield
    finally:
        _platform_branches, _ieee_instructions = previous


def _ptx_binary(instruction: str, a_bits, b_bits):
    """The float32 PTX ``instruction`` ("div.rn.f32", "mul.rn.f32") of two float32 patterns,
    elementwise, as inline assembly in a Pallas Triton kernel body: bits of the result."""
    from jax.experimental.pallas import triton as plt

    a_bits, b_bits = jnp.broadcast_arrays(a_bits, b_bits)
    a = lax.bitcast_convert_type(a_bits, jnp.float32)
    b = lax.bitcast_convert_type(b_bits, jnp.float32)
    [out] = plt.elementwise_inline_asm(
        f"{instruction} $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return lax.bitcast_convert_type(out, jnp.uint32)


def f32_div_hwfloat(a_bits, b_bits):
    """Bits of the IEEE float32 quotient a / b (a finite; b nonzero, not NaN, an infinite b
    giving a signed zero; one shape): XLA's float32 division on CPU, correctly rounded where
    operands and quotient are normal (it flushes subnormals), with the divisor made per
    element (:func:`per_element_divisor`) so that XLA cannot turn a division by a broadcast
    into a product with its reciprocal; :func:`f32_div` elsewhere (``lax.platform_dependent``). XLA on an
    NVIDIA GPU divides with PTX ``div.full``, which is not correctly rounded
    (docs/design.md §8)."""

    def on_cpu(a_bits, b_bits):
        b = per_element_divisor(lax.bitcast_convert_type(b_bits, jnp.float32), a_bits)
        return lax.bitcast_convert_type(lax.bitcast_convert_type(a_bits, jnp.float32) / b,
                                        jnp.uint32)

    if _ieee_instructions:
        return _ptx_binary("div.rn.f32", a_bits, b_bits)
    if not _platform_branches:
        return f32_div(a_bits, b_bits)
    return _platform.platform_dependent(a_bits, b_bits, cpu=on_cpu, default=f32_div)


def f32_mul_short(a_bits, b_bits):
    """IEEE float32 a * b from the bits, for finite a and a finite b with at most 6
    significant bits (E4M3 values, E2M1 x E4M3 products): the exact product of the 24-bit and
    6-bit significands fits 30 bits, then one rounding."""
    sign = lax.shift_right_logical((a_bits ^ b_bits) & jnp.uint32(F32_SIGN), jnp.uint32(31))
    sa, ea = _split(a_bits)
    sb, eb = _split(b_bits)
    out = round_to_f32(sa * lax.shift_right_logical(sb, jnp.uint32(18)), ea + eb + 18, sign,
                       jnp.zeros(sa.shape, bool))
    zero = ((a_bits & F32_ABS) == 0) | ((b_bits & F32_ABS) == 0)
    return jnp.where(zero, lax.shift_left(sign, jnp.uint32(31)), out)


def f32_mul(a_bits, b_bits):
    """IEEE float32 a * b from the bits, rounded to nearest even, for finite a and b: the
    exact 48-bit product of the 24-bit significands from 12-bit halves (every partial product
    and sum below 2^26 in uint32), then one rounding (subnormal results and overflow as IEEE).
    In a kernel body compiled for a GPU (:func:`one_platform`), PTX ``mul.rn.f32``."""
    if _ieee_instructions:
        return _ptx_binary("mul.rn.f32", a_bits, b_bits)
    sign = lax.shift_right_logical((a_bits ^ b_bits) & jnp.uint32(F32_SIGN), jnp.uint32(31))
    sa, ea = _split(a_bits)
    sb, eb = _split(b_bits)
    m12, m24 = jnp.uint32(0xFFF), jnp.uint32(0xFF_FFFF)
    a0, a1 = sa & m12, lax.shift_right_logical(sa, jnp.uint32(12))
    b0, b1 = sb & m12, lax.shift_right_logical(sb, jnp.uint32(12))
    mid = a1 * b0 + a0 * b1  # < 2^25
    low = a0 * b0 + lax.shift_left(mid & m12, jnp.uint32(12))  # < 2^25
    high = a1 * b1 + lax.shift_right_logical(mid, jnp.uint32(12)) + lax.shift_right_logical(
        low, jnp.uint32(24))  # product >> 24, < 2^24
    low = low & m24  # product mod 2^24
    # product >> 18 in [2^28, 2^30); the 18 bits dropped decide the sticky bit.
    sig = lax.shift_left(high, jnp.uint32(6)) | lax.shift_right_logical(low, jnp.uint32(18))
    out = round_to_f32(sig, ea + eb + 18, sign, (low & jnp.uint32((1 << 18) - 1)) != 0)
    zero = ((a_bits & F32_ABS) == 0) | ((b_bits & F32_ABS) == 0)
    return jnp.where(zero, lax.shift_left(sign, jnp.uint32(31)), out)


def reciprocal_factor_bits(scale_codes, ts_bits, scale_fmt: ElementFormat):
    """Bits of float32(float32(1 / tensor_scale) / block_scale): the factor torchao >= 0.17
    multiplies a block's elements by (the ``"reciprocal"`` NVFP4 step). Finite for tensor scales
    of at least :data:`MIN_RECIPROCAL_TENSOR_SCALE_BITS` and block scales of at least 2^-6."""
    inverse = f32_div(jnp.full_like(ts_bits, _F32_ONE), ts_bits)
    return f32_div(inverse, decode_bits(scale_fmt, scale_codes))


def per_element_divisor(divisor, dividend_bits):
    """``divisor`` (float32, broadcastable to ``dividend_bits``) as an array of the dividend's
    own shape that XLA cannot see as a broadcast: a select on the dividend's bits (all-ones,
    a NaN pattern that no caller divides by anything it keeps, takes 1).

    XLA:CPU rewrites every division by a broadcast as a product with the broadcast
    reciprocal, which rounds differently (docs/design.md §8), also when the broadcast is
    made after an optimization barrier: under ``vmap`` a divisor that does not depend on the
    mapped axis (a constant, an unbatched tensor scale) is barriered per example and then
    broadcast along the batch. The select depends on the dividend, so it is batched wherever
    the dividend is (tests/test_nvfp4_values.py: per-group tensor scales)."""
    return jnp.where(dividend_bits == jnp.uint32(0xFFFF_FFFF), jnp.float32(1), divisor)


def _on_cpu(cpu, default, *args):
    """``cpu(*args)`` where XLA lowers for CPU, ``default(*args)`` elsewhere and in a Pallas
    kernel body (one platform, no ``platform_dependent``); where JAX here compiles for CPU
    alone, ``cpu(*args)`` alone (``_platform.platform_dependent``)."""
    if not _platform_branches:
        return default(*args)
    return _platform.platform_dependent(*args, cpu=cpu, default=default)


def div_by_integer(a_bits, d: int):
    """Bits of the IEEE float32 quotient a / d, rounded to nearest even, for non-negative
    finite float32 patterns ``a_bits`` and a positive integer constant ``d`` below 2^12 (the
    NVFP4 divisors 6, 7, 2688, 3136): :func:`f32_div` where XLA does not lower for CPU;
    on CPU in a few operations:

    * where a >= d * 2^-126 the quotient is a float32 normal and so is a: XLA:CPU's float32
      division is correctly rounded there (the divisor made per element,
      :func:`per_element_divisor`, so that XLA cannot multiply by a rounded reciprocal
      instead);
    * below, the quotient is a subnormal (or 2^-126 after rounding): its pattern is
      rint(A / d) for the integer A = a * 2^149 < d * 2^23, with d = o * 2^p (o odd): A is
      sig * 2^s (sig the 24-bit significand, s <= 11 + 12), so n = floor(A / 2^p) and the p
      bits dropped are shifts of sig, n < o * 2^23 < 2^32, and n = o q + r (a division by
      the constant o, which compilers strength-reduce); the fraction of A / d is
      (r 2^p + dropped) / d, compared with 1/2 on the integers (ties to even).
    """
    p = (d & -d).bit_length() - 1
    odd = d >> p
    assert 0 < d < (1 << 12), d

    def cpu(a_bits):
        a = lax.bitcast_convert_type(a_bits, jnp.float32)
        divisor = per_element_divisor(jnp.float32(d), a_bits)
        normal = lax.bitcast_convert_type(a / divisor, jnp.uint32)
        efield = lax.shift_right_logical(a_bits, jnp.uint32(F32_MANT_BITS))
        sig = jnp.where(efield > 0, (a_bits & F32_MANT) | F32_IMPLICIT, a_bits & F32_MANT)
        s = jnp.maximum(efield, jnp.uint32(1)) - jnp.uint32(1)  # A = sig * 2^s
        up_shift = jnp.clip(s.astype(jnp.int32) - p, 0, 31).astype(jnp.uint32)
        down_shift = jnp.clip(p - s.astype(jnp.int32), 0, 31).astype(jnp.uint32)
        n = jnp.where(s >= p, lax.shift_left(sig, up_shift), lax.shift_right_logical(
            sig, down_shift))
        dropped = jnp.where(s >= p, jnp.uint32(0),
                            lax.shift_left(sig, jnp.minimum(s, jnp.uint32(31)))
                            & jnp.uint32((1 << p) - 1))
        q = n // jnp.uint32(odd)
        frac2 = 2 * (lax.shift_left(n - q * jnp.uint32(odd), jnp.uint32(p)) + dropped)
        up = (frac2 > d) | ((frac2 == d) & ((q & 1) == 1))
        tiny = q + up.astype(jnp.uint32)
        return jnp.where(a_bits >= jnp.uint32(_f32_const_bits(d * 2.0**-126)), normal, tiny)

    return _on_cpu(cpu, lambda a: f32_div(a, jnp.uint32(_f32_const_bits(float(d)))), a_bits)


def finite_amax_bits(bits):
    """Bits of the largest finite magnitude of float32 patterns (0 if there is none)."""
    mag = bits & F32_ABS
    return jnp.max(jnp.where(mag < F32_INF, mag, jnp.uint32(0)), initial=jnp.uint32(0))


def tensor_scale_bits(amax_bits, element_max: float = _E2M1_MAX):
    """Bits of the tensor scale float32(amax / (448 * Q)) (Q = ``element_max``: 2688 for
    E2M1) of a tensor whose largest finite magnitude has bits ``amax_bits``: 1.0 for an
    all-zero tensor (then raised to 2^-143 by :func:`clamp_tensor_scale_bits`, like a given
    one)."""
    divisor = 448.0 * element_max   # exact in float32 (torchao: F8E4M3_MAX * F4_E2M1_MAX)
    ts = div_by_integer(amax_bits, int(divisor))
    return jnp.where(amax_bits == 0, jnp.uint32(_F32_ONE), ts)


def clamp_tensor_scale_bits(ts_bits):
    """A positive tensor scale raised to at least 2^-143 (on the bits: positive float32
    patterns order like their values)."""
    return jnp.maximum(ts_bits, jnp.uint32(MIN_TENSOR_SCALE_BITS))


def block_scale_codes(block_amax_bits, ts_bits, scale_fmt: ElementFormat,
                      element_max: float = _E2M1_MAX):
    """E4M3 codes (int32) of e4m3(clamp((block_amax / Q) / tensor_scale, 2^-6, 448)), Q the
    element's largest value ``element_max`` (6 for E2M1)."""
    quotient = _on_cpu(
        lambda a, t: element_quotient_bits(div_by_integer(a, int(element_max)), t),
        lambda a, t: f32_div(f32_div(a, jnp.uint32(_f32_const_bits(element_max))), t),
        block_amax_bits, jnp.broadcast_to(ts_bits, jnp.shape(block_amax_bits)))
    # Non-negative float32 bit patterns order like their values: clamp on the bits.
    clamped = jnp.clip(quotient, jnp.uint32(_E4M3_EPS_BITS), jnp.uint32(_E4M3_MAX_BITS))
    return encode_bits(scale_fmt, clamped, "nearest_even", "saturate", None)


def total_scale_bits(scale_codes, ts_bits, scale_fmt: ElementFormat):
    """Bits of float32(tensor_scale * block_scale), the divisor of a block's elements."""
    return f32_mul_short(ts_bits, decode_bits(scale_fmt, scale_codes))


# -- the hardware-float path (CPU) ---------------------------------------------------------------
# The same float32 steps by XLA:CPU's float arithmetic (which flushes subnormal operands and
# results to zero), exact for every block when the tensor scale ts lies in [2^-118, 2^116]:
# * (block_amax / 6) / ts: a quotient below 2^-126 at either step is at most 2^-126 / 2^-118,
#   below 2^-6, where the clamp puts it anyway; a normal one is the IEEE quotient; an
#   overflow is inf, clamped to 448 both ways.
# * ts * block_scale >= 2^-118 * 2^-6 = 2^-124 is a normal product (and at most
#   2^116 * 448 < 2^125), so a subnormal x (flushed) has |x| / total < 2^-2, which rounds to
#   the E2M1 zero, as does a quotient below 2^-126; an overflowing quotient is inf, which
#   saturates at 6 as the exact path's does.
# * 1 / ts lies in [2^-116, 2^118], so (1 / ts) / block_scale in [2^-125, 2^124] is normal,
#   and a flushed subnormal x had |x| * factor < 2^-2.
# Divisions by a per-block or scalar value go through a divisor that depends on the element
# (per_element_divisor; a barrier alone does not survive vmap): XLA:CPU turns a division by
# a broadcast into a product with its reciprocal, which rounds differently, and its
# simplifier turns (a / b) / c into a / (b * c).
HWFLOAT_TS_MIN_BITS = (127 - 118) << 23  # 2^-118
HWFLOAT_TS_MAX_BITS = (127 + 116) << 23  # 2^116


def hwfloat_scale_codes(block_amax_bits, ts_bits, scale_fmt: ElementFormat,
                       element_max: float = _E2M1_MAX):
    """:func:`block_scale_codes` by float32 division (CPU; exact for a tensor scale in
    [2^-118, 2^116], see above)."""
    amax = lax.bitcast_convert_type(block_amax_bits, jnp.float32)
    ts = lax.bitcast_convert_type(ts_bits, jnp.float32)
    first = per_element_divisor(jnp.float32(element_max), block_amax_bits)
    # The first quotient is materialized: XLA rewrites (a / b) / c as a / (b * c).
    over_q = lax.optimization_barrier(amax / first)
    ts_b = per_element_divisor(ts, block_amax_bits)
    quotient = lax.bitcast_convert_type(over_q / ts_b, jnp.uint32)
    clamped = jnp.clip(quotient, jnp.uint32(_E4M3_EPS_BITS), jnp.uint32(_E4M3_MAX_BITS))
    return encode_bits(scale_fmt, clamped, "nearest_even", "saturate", None)


def hwfloat_divisors(scale_codes, ts_bits, scale_fmt: ElementFormat):
    """float32(tensor_scale * block_scale) by a float32 product (CPU; see above)."""
    ts = lax.bitcast_convert_type(ts_bits, jnp.float32)
    return ts * lax.bitcast_convert_type(decode_bits(scale_fmt, scale_codes), jnp.float32)


def hwfloat_factors(scale_codes, ts_bits, scale_fmt: ElementFormat):
    """float32(float32(1 / tensor_scale) / block_scale) by float32 division (CPU; see
    above): the divisors are per block, never a broadcast, and the reciprocal is
    materialized first (XLA rewrites (1 / t) / s as 1 / (t * s))."""
    inverse = lax.optimization_barrier(jnp.float32(1) / lax.bitcast_convert_type(ts_bits, jnp.float32))
    return inverse / lax.bitcast_convert_type(decode_bits(scale_fmt, scale_codes), jnp.float32)


def hwfloat_quotients(magnitudes, divisors, x_bits):
    """float32 |x| / total per element (CPU; see above), ``divisors`` broadcast per block.
    The divisor is made per-element by a select on x's bits (all-ones, a NaN, belongs to a
    NaN block whose codes are discarded), so no reciprocal replaces the division.

    The quotient is returned through ``abs`` (the identity here: magnitudes over positive
    divisors): XLA does not fuse an expensive producer such as a division into a loop that
    reads it twice (the element encoder reads the quotient as bits and as a float), and
    writes all quotients out first, a whole extra pass; with ``abs`` its one reader is cheap.
    """
    d = per_element_divisor(divisors, x_bits)
    return jnp.abs(magnitudes / d)


def hwfloat_sr_quotients(x_bits, divisors):
    """Bits of float32(|x| / total) for stochastic rounding to E2M1 (CPU; a tensor scale in
    the hardware-float range, so every divisor is a normal float32 in [2^-124, 2^125]),
    ``divisors`` broadcast per block: exact wherever the quotient is at least 2^-126, and
    below that a quotient that every rounding mode treats alike (any float32 quotient in
    (0, 2^-33) rounds up iff its word is 0, a zero one never; the representative is 2^-100).

    XLA:CPU flushes subnormal operands and results, so the one division |x| / total is exact
    where x is normal and the quotient is at least 2^-126. The other lanes divide
    X = |x| * 2^64 instead (built on the bits: exponent + 64 for a normal x below 2^64, the
    integer significand times 2^-85 for a subnormal one; both exact and normal): X / total
    = q 2^64 rounded to 24 bits, normal for q >= 2^-190. Where that is at least 2^-62, q is
    at least 2^-126 (rounding is monotone and 2^-62 a float32) and the float32 quotient is
    its exponent less 64; below, the float32 quotient is nonzero iff q > 2^-150 (2^-150
    itself is a tie that rounds to the even 0), i.e. iff X / total rounds above 2^-86, or to
    2^-86 without being exactly 2^-86 (same significands, exponents 86 apart).
    """
    d = per_element_divisor(divisors, x_bits)
    mag = x_bits & jnp.uint32(F32_ABS)
    q = f32_bits(bits_to_f32(mag) / d)
    efield = lax.shift_right_logical(mag, jnp.uint32(F32_MANT_BITS))
    lifted = jnp.where(efield > 0, bits_to_f32(mag + jnp.uint32(64 << F32_MANT_BITS)),
                       (mag & F32_MANT).astype(jnp.float32) * np.float32(2.0**-85))
    q64 = f32_bits(lifted / d)
    db = f32_bits(d)
    lb = f32_bits(lifted)
    at_tie = (q64 == jnp.uint32(_f32_const_bits(2.0**-86))) & (
        (lb & F32_MANT) == (db & F32_MANT)) & (
        lax.shift_right_logical(lb, jnp.uint32(F32_MANT_BITS)) + jnp.uint32(86)
        == lax.shift_right_logical(db, jnp.uint32(F32_MANT_BITS)))
    nonzero = (q64 > jnp.uint32(_f32_const_bits(2.0**-86))) | (
        (q64 == jnp.uint32(_f32_const_bits(2.0**-86))) & ~at_tie)
    small = jnp.where(nonzero, jnp.uint32(_f32_const_bits(2.0**-100)), jnp.uint32(0))
    big = q64 >= jnp.uint32(_f32_const_bits(2.0**-62))
    fixed = jnp.where(big, q64 - jnp.uint32(64 << F32_MANT_BITS), small)
    return jnp.where((efield > 0) & (q >= jnp.uint32(F32_IMPLICIT)), q, fixed)


# Quotients below 2^-100 (or above 2^126) round like any other of their kind in every mode:
# to 0 / 0.5 / 6 by direction, and stochastic rounding of q < 2^-33 goes up iff its word is 0.
_TINY_BITS = (127 - 100) << 23  # 2^-100
_HUGE_BITS = (127 + 126) << 23  # 2^126


def element_quotient_bits(x_bits, total_bits):
    """Bits of float32(x / total) — what the E2M1 element encoder rounds — for blocks of
    float32 patterns ``x_bits`` [..., n, block] and their divisors ``total_bits`` [..., n, 1]
    (finite, positive; NaN/inf inputs give garbage, masked by the caller).

    Numerator and divisor are scaled by the same power of two (integer exponent arithmetic,
    exact for subnormal inputs), which leaves the quotient unchanged and puts the divisor in
    [1, 2); numerators are kept in [2^-100, 2^126], where the quotient is a float32 normal
    (no flush to zero on CPU) and rounds to E2M1 exactly as the unclamped one would, except
    for quotients that underflow to zero in float32, which are decided exactly on the
    integers. Those normal operands then go to :func:`f32_div_hwfloat`: one float32 division
    per element on CPU, the long division elsewhere (measured on an H200, XLA's own float32
    division changed 2-14% of the E2M1 codes of near-tie blocks).
    """
    sig_t, exp_t = _split(total_bits)  # total = sig_t * 2^exp_t, sig_t in [2^23, 2^24)
    k = -(exp_t + F32_MANT_BITS)  # total * 2^k in [1, 2)
    t_scaled = (127 << F32_MANT_BITS) | (sig_t & F32_MANT)
    sign = x_bits & jnp.uint32(F32_SIGN)
    sig_x, exp_x = _split(x_bits)
    field = exp_x + k + 150  # exponent field of x * 2^k (150 = 127 + 23)
    scaled = lax.shift_left(jnp.clip(field, 1, 254).astype(jnp.uint32), jnp.uint32(23)) | (
        sig_x & F32_MANT)
    scaled = jnp.clip(scaled, jnp.uint32(_TINY_BITS), jnp.uint32(_HUGE_BITS))
    # The float32 quotient underflows to (signed) zero iff |x / total| <= 2^-150 (the tie
    # rounds to the even 0): with x / total = sig_x / sig_t * 2^(d - 173), that is d < 0, or
    # d = 0 and sig_x <= sig_t. Any other quotient below 2^-126 is a nonzero subnormal, which
    # rounds to E2M1 like the clamped normal one.
    d = exp_x + k + 173
    underflow = (d < 0) | ((d == 0) & (sig_x <= sig_t))
    scaled = jnp.where(((x_bits & F32_ABS) == 0) | underflow, jnp.uint32(0), scaled)
    x_scaled = scaled | sign
    return f32_div_hwfloat(x_scaled, jnp.broadcast_to(t_scaled.astype(jnp.uint32), x_scaled.shape))


PER_BLOCK = "per_block"  # dequantize_bits' route: the formulation chosen block by block
# Non-negative float32 patterns order like their values: 2^-125 is (127 - 125) << 23.
_FAST_PRODUCT_MIN_BITS = 2 << 23


def dequantize_bits(value_bits, scale_codes, ts_bits, scale_fmt: ElementFormat, route=None):
    """float32 bits of element * float32(tensor_scale * block_scale), as torchao's
    ``NVFP4Tensor.to_dtype`` computes it in float32 (``get_hp_scales`` first, then the
    product with the element): two roundings, the first shared with the quantizer's divisor.
    A NaN block scale gives NaN, and so does a tensor scale that is not a positive finite
    float32 (NaN, ±inf, zero or negative: no valid NVFP4 tensor has one, and a product with it
    would be ±inf, zero or sign-flipped values instead of an evident failure).

    The product with the element is one float multiply when every block's factor is at
    least 2^-125: then factor and element (>= 0.5 when nonzero) are float32 normals and so is
    their product, which every backend rounds correctly. Otherwise (tensors below ~1e-35) it
    is computed exactly on the bits. ``route``: None decides here (one ``lax.cond`` for the
    whole array); else ``(fast, blocks)``, the formulation (a Python bool) and
    :func:`decode_blocks`' per-block values, from a caller that branched on
    :func:`fast_product_serves` before decoding any element (see ``_mx_decode.mx_values``),
    or ``fast`` = :data:`PER_BLOCK`: each block's own choice by an elementwise select (on a
    GPU, where XLA computes both branches of a cheap ``lax.cond`` anyway, and did so in
    separate passes over materialized operands).
    """
    fast, blocks = (None, None) if route is None else route
    total, nan = decode_blocks(scale_codes, ts_bits, scale_fmt) if blocks is None else blocks

    def fast_product(total, values):
        prod = lax.bitcast_convert_type(total, jnp.float32) * lax.bitcast_convert_type(
            values, jnp.float32)
        return lax.bitcast_convert_type(prod, jnp.uint32)

    def exact(total, values):
        return f32_mul_short(total, values)  # E2M1 values have <= 2 significant bits

    if fast is None:
        out = lax.cond(fast_product_serves((total, nan)), fast_product, exact, total, value_bits)
    elif fast is PER_BLOCK:  # each block's product in one elementwise pass (GPU); a NaN
        # block's total is NaN (decode_blocks), and every NaN product becomes the quiet NaN
        out = lifted_product(total, value_bits)
        nan_out = (out & jnp.uint32(F32_ABS)) > jnp.uint32(F32_INF)
        return jnp.where(nan_out, jnp.uint32(F32_QNAN), out)
    else:
        out = (fast_product if fast else exact)(total, value_bits)
    return jnp.where(nan, jnp.uint32(F32_QNAN), out)


def lifted_product(total, value_bits):
    """float32 bits of float32(total × value), rounded to nearest even, for ``total`` bits
    of any sign and magnitude (subnormal included) and E2M1 value bits, in a few float
    operations none of which sees a subnormal (no backend's flushing can change it).

    A block with total >= 2^-125 takes the plain product (normal operands, normal result).
    Below, the total is lifted to T = total · 2^149, its value in units of float32's
    smallest subnormal: exact (an exponent add, or for a subnormal total the integer its
    bits spell) and below 2^24. P = T · |value| is then a float32 normal computed exactly
    whenever P < 2^23 (T is an integer and E2M1 values are multiples of 1/2, so P has at
    most 24 significant bits there): rint(P) (_bits.rint_small) is the subnormal
    result's pattern, correctly rounded once (a carry to 2^23 is the smallest normal's).
    For P >= 2^23 the result is a normal, and P rounded to 24 bits is its significand: 149
    comes off the exponent field.
    """
    # A total can be negative: E4M3 scale codes with the sign bit decode to negative scales.
    sign = (value_bits ^ total) & jnp.uint32(F32_SIGN)
    v = lax.bitcast_convert_type(value_bits & jnp.uint32(F32_ABS), jnp.float32)
    total = total & jnp.uint32(F32_ABS)
    lifted = total < jnp.uint32(_FAST_PRODUCT_MIN_BITS)
    lift = jnp.uint32(149 << 23)  # 149 = 126 + 23: 2^-149 is the smallest subnormal
    big_t = lax.bitcast_convert_type(total + lift, jnp.float32)
    t = jnp.where(lifted, jnp.where(total >= jnp.uint32(F32_IMPLICIT), big_t,
                                    total.astype(jnp.float32)),
                  lax.bitcast_convert_type(total, jnp.float32))
    p = t * v
    pb = lax.bitcast_convert_type(p, jnp.uint32)
    # rint(P) for P < 2^23 (a GPU's FMA contraction of T·v + 2^23 inside rint_small rounds
    # the same sum once: the product is exact there).
    two23 = np.float32(2.0**F32_MANT_BITS)
    lifted_bits = jnp.where(p < two23, rint_small(p), pb - lift)
    return jnp.where(lifted, lifted_bits, pb) | sign


def decode_blocks(scale_codes, ts_bits, scale_fmt: ElementFormat):
    """Per block, ``(total, nan)``: the bits of float32(tensor_scale * block_scale), and
    whether the block decodes to NaN (a NaN scale code, or a tensor scale that is not a
    positive finite float32)."""
    nan = (decode_bits(scale_fmt, scale_codes) & F32_ABS) > F32_INF
    # Positive finite float32 patterns are exactly those in (0, 0x7F800000) as unsigned ints.
    nan = nan | (ts_bits == 0) | (ts_bits >= jnp.uint32(F32_INF))
    # A NaN block's total is the quiet NaN itself, so that its products are NaN without the
    # flag (the one-pass GPU decode reads only the totals; the other paths apply the flag).
    total = jnp.where(nan, jnp.uint32(F32_QNAN), total_scale_bits(scale_codes, ts_bits, scale_fmt))
    return total, nan


def fast_product_serves(blocks):
    """Scalar bool: whether every block's factor (:func:`decode_blocks`' total) is at least
    2^-125, so that :func:`dequantize_bits` may take the one-multiply product."""
    total, _ = blocks
    return jnp.all(total >= jnp.uint32(_FAST_PRODUCT_MIN_BITS))
