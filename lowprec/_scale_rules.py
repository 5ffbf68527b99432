"""MX scale rules: how a block's shared exponent follows from its largest magnitude.

A block's largest magnitude ``amax`` is read from exact float32 bits (never
``floor(log2(x))`` in floating point), and one of the :class:`ScaleRule` members turns it
into the shared exponent, clamped to E8M0's range [−127, 127]. The functions here work on
bit patterns; ``lowprec.shared_exponents`` and the MX quantizer call them.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Union

import jax.numpy as jnp
import numpy as np
from jax import lax

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
from ._rounding import DocumentedStr


class ScaleRule(DocumentedStr):
    """The rule choosing an MX block's shared exponent from its largest magnitude ``amax``.

    ``emax_elem`` is the exponent of the element format's largest binade, floor(log2 max_elem):
    8 for E4M3, 15 for E5M2, 2 for E2M1 and E2M3, 4 for E3M2, and 0 for the MX INT8 element
    (max 127/64), for which the rules read: floor puts amax's binade at [1, 2), where INT8
    clips above 127/64; ceil puts amax in (1/2, 1]; even rounds amax to 7 significant bits
    (INT8's 6 fractional bits at [1, 2)) first; rceil divides by 127/64. Members are strings, so ``"floor"`` and ``ScaleRule.FLOOR`` are
    interchangeable everywhere. Each member's own docstring says who uses it.

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
        drop = F32_MANT_BITS - (elem.emax - elem.top_quantum_exponent)
        keep = ~((1 << drop) - 1) & 0xFFFF_FFFF
        rounded = (amax_bits + jnp.uint32(1 << (drop - 1))) & jnp.uint32(keep)
        return floor_log2_bits(rounded) - emax
    if scale_rule is ScaleRule.RCEIL:
        return rceil_code(amax_bits, elem.max_finite_exact) - E8M0_BIAS
    raise AssertionError(scale_rule)


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
