"""MX scale rules: how a block's shared exponent follows from its largest magnitude.

A block's largest magnitude ``amax`` is read from exact float32 bits (never
``floor(log2(x))`` in floating point), and one of the :class:`ScaleRule` members turns it
into the shared exponent, clamped to E8M0's range [−127, 127]. The functions here work on
bit patterns; ``lowprec.shared_exponents`` and the MX quantizer call them.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Union

import numpy as np

import lowprec_formats as _data

from ._bits import (
    E8M0_BIAS,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    E8M0_NAN,
    F32_ABS,
    F32_INF,
    F32_MANT,
    F32_MANT_BITS,
    floor_log2_bits,
)
from ._format import MXFormat
from ._lazy import lazy_module
from ._rounding import DocumentedStr

# Imported on first use: the checkpoint command line's native path needs no JAX.
jnp = lazy_module("jax.numpy")
lax = lazy_module("jax.lax")


class ScaleRule(DocumentedStr):
    """The rule choosing an MX block's shared exponent from its largest magnitude ``amax``.

    ``emax_elem`` is the exponent of the element format's largest binade, floor(log2 max_elem):
    8 for E4M3, 15 for E5M2, 2 for E2M1 and E2M3, 4 for E3M2, and 0 for the MX INT8 element
    (max 127/64), for which the rules read: floor puts amax's binade at [1, 2), where INT8
    clips above 127/64; ceil puts amax in (1/2, 1]; even rounds amax to 7 significant bits
    (INT8's 6 fractional bits at [1, 2)) first; rceil divides by 127/64. Members are strings, so ``"floor"`` and ``ScaleRule.FLOOR`` are
    interchangeable everywhere. Each member's own docstring says who uses it.

    Two members reproduce other libraries' quantizers bit for bit: ``EVEN_E2M1`` is
    compressed-tensors' and llm-compressor's rule for MXFP4 and MXFP8 (their MXFP6 E2M3
    scales, compressed-tensors >= 0.20, are ``EVEN``'s), ``FLOOR_LOG2F`` ggml's (llama.cpp,
    gguf-py) for MXFP4, whose elements round with ``Rounding.NEAREST_TOWARD_ZERO``
    (docs/design.md §3).

    Example:
        >>> ScaleRule("rceil") is ScaleRule.RCEIL, ScaleRule.FLOOR == "floor"
        (True, True)
    """

    FLOOR = (
        "floor",
        "floor(log2 amax) − emax_elem: OCP MX v1.0 §6.3, microxcaling, gfloat, torchao FLOOR. "
        "Block maxima above the element's largest value times 2^shared_exp (1.75·2^emax for "
        "FP8, 1.5·2^emax for FP4) saturate.",
    )
    CEIL = (
        "ceil",
        "ceil(log2 amax) − emax_elem: torchao CEIL. Never clips; uses less of the element range.",
    )
    EVEN = (
        "even",
        "amax's significand rounded (half up) to the element's mantissa width, then floor: "
        "torchao EVEN.",
    )
    RCEIL = (
        "rceil",
        "amax / max_elem in float32, rounded up to a power of two: NVIDIA cuBLAS/cuDNN, "
        "Transformer Engine, jax.nn's MXFP8 quantizer (bit-exact). Never clips.",
    )
    EVEN_E2M1 = (
        "even_e2m1",
        "EVEN at E2M1's precision whatever the element: amax's significand rounded half up "
        "to one fraction bit (1.75 and above go to 2), then floor. compressed-tensors and "
        "llm-compressor (0.19, 0.20: generate_mx_scales) for MXFP4 and MXFP8, after vLLM's "
        "MXFP4 reference (bit-exact); the same as EVEN for E2M1 elements. Their MXFP6 (E2M3, "
        "compressed-tensors >= 0.20) is EVEN.",
    )
    FLOOR_LOG2F = (
        "floor_log2f",
        "floor of log2(amax) rounded to float32 (C's floorf(log2f(amax))), minus emax_elem: "
        "ggml (llama.cpp quantize_row_mxfp4_ref, gguf-py gguf.quants.MXFP4; bit-exact with "
        "rounding='nearest_toward_zero'). FLOOR, except that the 1 to 44 float32 block maxima "
        "just below each power of two 2^k with |k| >= 3 (|k| >= 2 for k < 0), whose log2 "
        "rounds up to k, take the next exponent.",
    )


assert tuple(r.value for r in ScaleRule) == _data.SCALE_RULES, "formats/ lists other rules"

#: The default: the OCP MX v1.0 rule. ``ScaleRule.RCEIL`` is what NVIDIA hardware uses.
DEFAULT_SCALE_RULE = ScaleRule.FLOOR
SCALE_RULES: tuple[str, ...] = tuple(r.value for r in ScaleRule)


def check_scale_rule(scale_rule: Union[str, ScaleRule]) -> ScaleRule:
    """Returns the :class:`ScaleRule` named ``scale_rule``; a clear error otherwise."""
    try:
        return ScaleRule(scale_rule)
    except ValueError:
        raise ValueError(
            f"unknown scale_rule {scale_rule!r}; valid rules: "
            + ", ".join(repr(r.value) for r in ScaleRule)
            + " (see lowprec.ScaleRule)"
        ) from None


def _floor_f32(v: Fraction) -> np.float32:
    """The largest float32 not above the positive rational ``v``."""
    f = np.float32(float(v))
    if Fraction(float(f)) > v:
        f = np.nextafter(f, np.float32(0))
    return f


def rceil_code(amax_bits, max_elem: Fraction):
    """E8M0 code of float32(amax / max_elem) rounded up to a power of two.

    Bit for bit the rule of ``jax._src.cudnn.scaled_matmul_stablehlo
    .cast_to_e8m0_with_rounding_up`` applied to the IEEE float32 quotient: mantissa > 0 →
    exponent + 1 (except at exponent 0xFE); a subnormal quotient rounds up to 2^-126 only
    when above 2^-127. Integer-only (checked against the IEEE division for every finite
    float32 amax): with max_elem = 1.f × 2^k, a normal quotient is an exact power of two
    only when amax's mantissa field equals f's, and otherwise lies in amax's binade shifted
    by k when amax's mantissa is above f, just below it otherwise. A subnormal quotient
    (amax < max_elem × 2^-126) exceeds 2^-127 iff amax > max_elem × (2^-127 + 2^-150);
    float32 patterns of non-negative values order like the values, so compare the bits.
    """
    k, max_mant, small_bits, thr_bits = rceil_constants(max_elem)
    efield = lax.shift_right_logical(amax_bits, jnp.uint32(F32_MANT_BITS)).astype(jnp.int32)
    above = ((amax_bits & F32_MANT) > max_mant).astype(jnp.int32)
    normal_code = jnp.minimum(efield - k + above, 0xFE)
    sub_code = (amax_bits > thr_bits).astype(jnp.int32)
    return jnp.where(amax_bits < small_bits, sub_code, normal_code)


def rceil_constants(max_elem: Fraction) -> tuple[int, int, int, int]:
    """The integers :func:`rceil_code` compares amax's bits with (also handed to the native
    CPU quantizer): max_elem = 1.f × 2^k as ``(k, f's mantissa field, the bits of
    max_elem × 2^-126, the bits of the largest float32 ≤ max_elem × (2^-127 + 2^-150))``.

    Example:
        >>> rceil_constants(Fraction(448))   # E4M3: 448 = 1.75 x 2^8
        (8, 6291456, 81788928, 73400321)
    """
    mf = int(np.float32(float(max_elem)).view(np.uint32))
    small_bits = int(np.float32(float(max_elem * Fraction(1, 2**126))).view(np.uint32))  # exact
    thr = _floor_f32(max_elem * (Fraction(1, 2**127) + Fraction(1, 2**150)))
    return (mf >> F32_MANT_BITS) - 127, mf & F32_MANT, small_bits, int(thr.view(np.uint32))


def round_half_up_exponent(amax_bits, fraction_bits: int):
    """floor(log2) of the float32 patterns ``amax_bits`` after rounding their significands
    half up to ``fraction_bits`` bits (torchao's EVEN step: add half a unit of the last kept
    bit, clear the dropped bits; a carry reaches the next binade, subnormals included)."""
    drop = F32_MANT_BITS - fraction_bits
    keep = ~((1 << drop) - 1) & 0xFFFF_FFFF
    return floor_log2_bits((amax_bits + jnp.uint32(1 << (drop - 1))) & jnp.uint32(keep))


# FLOOR_LOG2F: how many float32 just below 2^k have a log2 that rounds (to nearest even, in
# float32) up to k. log2(d) for d = 2^k (1 - j 2^-24) (normal d) is k - j 2^-24 / ln 2 + ...;
# it rounds to k when within half the float32 spacing next to k, 2^(b - 24) with b =
# floor(log2 |k|) for k < 0 and floor(log2 (k - 1)) for k >= 2 (the binade holding the
# values just below k), a tie going to k (its significand ends in 0s). So j <= n_b =
# floor(2^24 (1 - 2^(-2^(b - 24)))) ~ 2^b ln 2: 0, 1, 2, 5, 11, 22, 44, 88 for b = 0..7 (and 0
# for k = 0, 1). Checked against NumPy's and glibc's float32 log2 for every float32 near a
# power of two (tests/test_engine_rules.py). Subnormal d are 2^-149 apart, 2^(-126 - e) times
# the spacing of a normal binade [2^e, 2^(e+1)) would have: their count is n_b >> (-126 - e).
_LOG2F_ROUNDS_UP = ((128, 88), (64, 44), (32, 22), (16, 11), (8, 5), (4, 2), (2, 1))


def log2f_exponent(amax_bits):
    """floor(float32(log2 v)) (int32) for the float32 patterns ``amax_bits`` of v ≥ 0 (v = 0
    gives -150): ``floor_log2_bits``, plus one where the correctly rounded float32 log2 of
    v is the integer above (the table above)."""
    e = floor_log2_bits(amax_bits)
    k = e + 1
    a = jnp.where(k >= 2, k - 1, -k)  # the binade of the float32 next to k: b = floor(log2 a)
    n = jnp.zeros_like(a)
    for bound, count in reversed(_LOG2F_ROUNDS_UP):
        n = jnp.where(a >= bound, count, n)
    efield = lax.shift_right_logical(amax_bits, jnp.uint32(F32_MANT_BITS)).astype(jnp.int32)
    subnormal = efield == 0
    n = jnp.where(subnormal, lax.shift_right_logical(n, jnp.clip(-126 - e, 0, 31)), n)
    # d's distance below 2^k in units of its spacing: 2^23 - mantissa for a normal d; for a
    # subnormal one, whose significand is its mantissa field, 2^(e + 150) - mantissa.
    top = jnp.where(subnormal, lax.shift_left(jnp.int32(1), jnp.clip(e + 150, 0, 23)),
                    1 << F32_MANT_BITS)
    mant = (amax_bits & F32_MANT).astype(jnp.int32)
    return e + (mant >= top - n).astype(jnp.int32)  # never for n = 0: mant < top


def shared_exponent_of_amax(amax_bits, fmt: MXFormat, scale_rule: ScaleRule):
    """Unclamped shared exponent (int32) of blocks whose largest magnitude has bits ``amax_bits``."""
    elem = fmt.element
    emax = fmt.emax_elem
    if scale_rule is ScaleRule.FLOOR:
        return floor_log2_bits(amax_bits) - emax
    if scale_rule is ScaleRule.CEIL:
        sig = amax_bits & F32_MANT
        not_pow2 = jnp.where((amax_bits >> F32_MANT_BITS) > 0, sig != 0, (sig & (sig - 1)) != 0)
        return floor_log2_bits(amax_bits) + not_pow2.astype(jnp.int32) - emax
    if scale_rule is ScaleRule.EVEN:
        # Round amax's significand to the element's precision in its top binade (its
        # mantissa width; 6 bits for INT8, whose values k/64 are subnormal-like), half up.
        return round_half_up_exponent(amax_bits, even_fraction_bits(fmt, scale_rule)) - emax
    if scale_rule is ScaleRule.RCEIL:
        return rceil_code(amax_bits, elem.max_finite_exact) - E8M0_BIAS
    if scale_rule is ScaleRule.EVEN_E2M1:
        return round_half_up_exponent(amax_bits, even_fraction_bits(fmt, scale_rule)) - emax
    if scale_rule is ScaleRule.FLOOR_LOG2F:
        return log2f_exponent(amax_bits) - emax
    raise AssertionError(scale_rule)


def even_fraction_bits(fmt: MXFormat, scale_rule: ScaleRule) -> int:
    """The significand bits below the leading one that ``EVEN`` (the element's precision in
    its top binade: its mantissa width, 6 for INT8) or ``EVEN_E2M1`` (1, E2M1's) keeps of a
    block maximum.

    Example:
        >>> from lowprec._format import mx_format
        >>> even_fraction_bits(mx_format("mxfp8"), ScaleRule.EVEN), even_fraction_bits(
        ...     mx_format("mxfp8"), ScaleRule.EVEN_E2M1)
        (3, 1)
    """
    if scale_rule is ScaleRule.EVEN_E2M1:
        return 1  # E2M1's mantissa width (compressed-tensors' FP4_E2M1_DATA.mantissa)
    assert scale_rule is ScaleRule.EVEN, scale_rule
    elem = fmt.element
    return elem.emax - elem.top_quantum_exponent


def block_amax_bits(bits, block: int):
    """Largest magnitude bits of each block of ``block`` consecutive float32 patterns along
    the last axis of ``bits`` (a multiple of ``block`` long): ``[..., n / block]``.

    An integer max: exact for subnormals, and NaN/Inf patterns sort above every finite one.
    One reduce over both dims of a (block/4, 4) split of each block: XLA:CPU emits it
    vectorized, ~4x faster than its reduce over a single trailing dim of 32 (at 4096x4096
    about the time of a plain read of the input). The split is taken straight from the
    unsplit axis: reduced dims split off an already split block axis (two nested reduces
    alike) are merged back into the slow single-dim reduce by XLA's simplifier.
    """
    lead, n = bits.shape[:-1], bits.shape[-1]
    mag = bits & F32_ABS
    if block % 4:
        return jnp.max(mag.reshape(*lead, n // block, block), axis=-1)  # blocks of 2
    return jnp.max(mag.reshape(*lead, n // block, block // 4, 4), axis=(-2, -1))


def scale_codes_of_amax(amax_bits, fmt: MXFormat, scale_rule: ScaleRule):
    """E8M0 scale codes (int32) of blocks: the clamped shared exponent + 127, or 0xFF for a
    block holding a NaN or an infinity. Returns ``(codes, special)``."""
    special = amax_bits >= F32_INF
    shared = jnp.clip(shared_exponent_of_amax(amax_bits, fmt, scale_rule), E8M0_MIN_EXP, E8M0_MAX_EXP)
    return jnp.where(special, E8M0_NAN, shared + E8M0_BIAS), special
