"""The GEMM a low-precision product gets on a CUDA GPU: FP8 tensor cores or bfloat16, never float32.

On a CUDA GPU the GEMM is cuBLASLt's (or a Triton GEMM XLA autotunes against it); which one
XLA's GEMM rewriter forms depends on the operands it is given. lowprec's portable dot
(``_qdot.py``: decoded values, bfloat16 where that is exact, else float32 at
``precision=HIGHEST``) gives the right numbers everywhere but, on a GPU, bfloat16 GEMMs for
FP8 products and float32 GEMMs for NVFP4 and per-tensor-scaled FP8. The operand builders here
give the GEMM rewriter what it needs instead (docs/design.md §13, "GPU GEMMs"):

* **FP8 with per-tensor scales** (:func:`fp8_values`): lowprec's own codes (from its bit-exact
  encoder: there is no float → float8 convert that XLA could fold away, openxla/xla#41605),
  reinterpreted as ``float8_e4m3fn``/``float8_e5m2`` (a bitcast), converted and multiplied by
  a scalar factor. XLA matches ``dot(convert(f8) * s_a, convert(f8) * s_b)`` and emits
  ``__cublas$lt$matmul$f8`` on Hopper and later with the two factors as cuBLASLt's
  ``scale_a``/``scale_b`` (applied to the float32 accumulator, not to the operands). E4M3 x
  E4M3 and E4M3 x E5M2 in either order; cuBLASLt has no E5M2 x E5M2 (:func:`fp8_pair`).
  The dot is given ``precision=HIGHEST``, which makes XLA turn cuBLASLt's FP8 fast
  accumulation off (``IsFastAccumEnabled`` in XLA's ``stream_executor/cuda/cuda_blas_lt.cc``:
  on only at the DEFAULT precision); see docs/design.md §13 for what the accumulation does.
* **Block formats as bfloat16** (:func:`block_values_bf16`): every E8M0-scaled MX value
  with at most 8 significant bits is a bfloat16 value, decoded in one elementwise pass with
  no branch (``_mx_decode.mx_values_blockwise``); bits below bfloat16's subnormal step
  2^-133 are rounded to nearest even (only FP8 elements in blocks with scales below 2^-124,
  E4M3, or 2^-117, E5M2: the portable route keeps a float32 GEMM for those). NVFP4's element times
  E4M3 block scale has at most 2 + 4 = 6 significant bits within [2^-10, 2688]: always an
  exact normal bfloat16; the float32 tensor scales multiply the GEMM's float32 output
  (:func:`apply_tensor_scales`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._bits import bits_to_bf16_truncating, f32_bits
from ._decode import decode_f32
from ._format import ElementFormat, MXFormat
from ._mx_decode import element_codes, fast_decode_applies, mx_values_blockwise
from ._mxarray import MXArray

#: The element formats cuBLASLt's FP8 GEMM reads, by lowprec name, with their JAX dtypes.
FP8_DTYPES = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def fp8_pair(lhs: ElementFormat, rhs: ElementFormat) -> bool:
    """Whether ``lhs`` x ``rhs`` is an FP8 GEMM cuBLASLt has (static): both FP8, at least one
    E4M3 (Hopper's FP8 MMA takes E4M3 x E4M3 and E4M3 x E5M2, not E5M2 x E5M2)."""
    names = (getattr(lhs, "name", None), getattr(rhs, "name", None))
    return all(n in FP8_DTYPES for n in names) and "e4m3" in names


def fp8_values(codes, fmt: ElementFormat):
    """float32 operand of an FP8 GEMM: ``codes`` (integer codes of ``fmt`` from lowprec's
    encoder) read as ``fmt``'s float8 type and converted, the pattern XLA folds into
    cuBLASLt's FP8 GEMM; run anywhere else it is the exact value.

    Per-tensor scales go on the product's output (``dot(a, b) * sa * sb``, cuBLASLt's
    epilogue), never on an operand: XLA's Triton GEMM fusion takes the dot before the
    GEMM rewriter sees a scaled operand, so ``convert(a) * sa`` was written out as float32
    and the product ran a float32 GEMM (an H200: 52 ms for a training step whose FP8 GEMMs
    take 6 ms)."""
    values = lax.bitcast_convert_type(codes.astype(jnp.uint8), FP8_DTYPES[fmt.name])
    return values.astype(jnp.float32)


def fp8_dot_general(lhs, rhs, dimension_numbers, out_sharding=None):
    """``lax.dot_general`` of two :func:`fp8_values` operands, float32 out, at
    ``precision=HIGHEST`` (FP8 fast accumulation off)."""
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32, out_sharding=out_sharding)


def block_bf16_exact(fmt: MXFormat) -> bool:
    """Whether the GPU route feeds ``fmt``'s values to a bfloat16 GEMM (static).

    E8M0 scales (one multiply by 2^(s - 127)) with elements of at most 7 mantissa bits: the
    value keeps the element's significand, which bfloat16 holds (exact but for values below
    its subnormal step 2^-133). Or a scale format of its own under a float32 tensor scale
    (NVFP4) whose element x block-scale products have at most 8 significant bits and lie in
    bfloat16's normal range, so that only the tensor scale is left for the output.
    """
    el = fmt.element
    if fast_decode_applies(fmt):
        return el.mantissa_bits <= 7
    scale = fmt.scheme.scale
    if not fmt.scheme.tensor_scale or scale.encoding != "sign_magnitude":
        return False
    if el.encoding != "sign_magnitude" or (el.mantissa_bits + 1) + (scale.mantissa_bits + 1) > 8:
        return False
    # bfloat16's normal range is float32's: [2^-126, ~2^128).
    lo = el.min_subnormal * scale.min_subnormal
    hi = el.max_finite * scale.max_finite
    return lo >= 2.0**-126 and hi < 2.0**128


def block_values_bf16(mx: MXArray):
    """bfloat16 values of an MXArray's blocks (padding dropped) and the factor left for the
    GEMM's output (its float32 tensor scale, or None). For :func:`block_bf16_exact` formats.

    E8M0 formats: ``mx_values_blockwise`` to bfloat16 (one pass: element value from a table,
    the scale applied on the bfloat16 bits, NaN blocks NaN). NVFP4: element value times block
    scale value, both exact float32, their product exact (<= 6 significant bits), then its top
    16 bits (exact); a block whose scale is the E4M3 NaN code gives NaN.
    """
    fmt, axis = mx.fmt, mx.axis
    n = mx.shape[axis]
    if fast_decode_applies(fmt):
        return mx_values_blockwise(mx.elements, mx.scales, fmt, axis, n, jnp.bfloat16), None
    codes = element_codes(mx.elements, fmt, axis)  # [..., blocks, block, ...]
    scale = decode_f32(fmt.scheme.scale, jnp.expand_dims(mx.scales, axis + 1))
    values = decode_f32(fmt.element, codes) * scale
    values = bits_to_bf16_truncating(f32_bits(values))
    shape = values.shape
    merged = values.reshape(*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2:])
    return lax.slice_in_dim(merged, 0, n, axis=axis), mx.tensor_scale


def apply_tensor_scales(out, *factors):
    """The float32 GEMM output times each non-None factor, one rounding per factor, in order
    (the product of two tensor scales is never formed: it could underflow where neither
    step does)."""
    for f in factors:
        if f is not None:
            out = out * f
    return out
