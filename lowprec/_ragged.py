"""The quantized ragged dot (mixture-of-experts grouped matmul): :func:`ragged_dot`.

``lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`` multiplies consecutive rows of
``lhs`` by one weight each: rows ``start_g .. start_g + group_sizes[g] - 1`` (``start_g`` the
sum of the sizes before g) by ``rhs[g]``; rows past the last group give zeros. Here it runs
with quantized operands, and the rule is that **each group is its own matmul**: group g's
product, forward and backward, is what :func:`lowprec.dot_general` (or a recipe's
``dot_general``) computes for that group's tokens ``x_g`` [T_g, K] and its weight ``w_g``
[K, N] alone, as Transformer Engine's ``GroupedLinear`` quantizes each group's split of
tokens with its own quantizer:

* forward: ``Q(x_g along K) · Q(w_g along K)``; MX blocks run along K (each row of lhs, each
  column of each expert), so they never meet a group boundary;
* grad_lhs: ``Q(g_g along N) · Q(w_g along N)ᵀ`` (blocks along N, within each row of the
  cotangent g [M, N] and each expert);
* grad_rhs: ``Q(x_g along T)ᵀ · Q(g_g along T)``, reducing over the group's tokens, whose
  boundaries are data. MX blocks along tokens are formed *per group*: each group's tokens
  start a new block and the group's last block is zero-padded (exact: zeros add nothing), as
  ``pad=True`` pads a dot's token axis. Implemented without data-dependent shapes: the
  tokens are gathered into a layout where every group starts at a multiple of the block and
  is followed by zero rows (at most M + G·(block − 1) rows), quantized there along tokens,
  and reduced per group by a ragged dot over the padded sizes. Because group sizes are data,
  this padding happens whatever ``pad`` says (``pad`` governs K and N, which are static).
* per-tensor quantities are per group: the power-of-two scale of ``scaling="tensor"``
  recipes and NVFP4's float32 tensor scale come from the group's own tokens (lhs, cotangent)
  or from expert g's own weight, as they would for that group's dot alone. A tensor scale of
  a group's tokens is computed from their largest finite magnitude (the group's amax is the
  largest of its rows'), then by the format's own rule.

Products are exact (every quantized value is a float32, or a bfloat16 where that is exact:
the same run-time choice as :func:`lowprec.dot_general`, with float32 accumulation), so a
result is within K·2^-23·Σ|a_i b_i| of the exact dot of the quantized operands; it equals
``lax.ragged_dot`` of the dequantized operands given in the dtype chosen (XLA:CPU sums a
bfloat16 dot in another order than a float32 one: the two differ by about an ulp). Gradients come back in
their operands' dtypes; ``group_sizes`` gets none (integers).

The NVFP4 training recipe (:data:`~lowprec.NVIDIA_NVFP4`, ``DotSpec.nvfp4``): each group is
the recipe's own dot too (16 x 16 tiles per expert, the Hadamard transform and token blocks
in the per-group padded layout; see the section "the NVFP4 training recipe, per group"
below), its stochastic-rounding words drawn once for the whole cotangent.

Not supported (refused with an error): ``group_offset`` (a slice of the groups, for expert
sharding), :class:`~lowprec.MXArray` operands, other ``ragged_dot_general`` layouts.

Sharding: ``out_sharding`` goes to the forward ragged dot, as for :func:`dot_general`, and
MX blocks along K must not straddle shards (checked where the layout is visible). On
``Explicit`` mesh axes each backward ragged dot is given its operand's sharding (JAX's own
transpose of ``lax.ragged_dot`` passes none, and ``lax.ragged_dot_general`` infers none
there); JAX 0.10's ``ragged_dot_general`` has no ``Explicit`` rule for sharded tokens or K at
all, so on such axes expert-parallel layouts (rhs split over G) train, and others fail
inside JAX. ``Auto`` axes take any layout (tests/test_ragged.py: tokens, N and experts split
over 4 CPU devices give one device's result up to float32 summation order).
"""

from __future__ import annotations

import functools
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._bits import E8M0_BIAS, F32_ABS, F32_INF, bits_to_bf16_truncating, bits_to_f32, f32_bits, pow2_f32
from ._decode import decode_bits
from ._dtypes import bits_to_dtype, exactly_representable, input_bits
from ._encode import encode_bits
from ._format import FormatLike
from ._mx_decode import fast_decode_applies, mx_value_bits
from ._mx_encode import encode_blocks, zero_padded
from ._mxarray import MXArray
from ._nvfp4_train import quantize_2d, recipe_rht, recipe_rht_signs
from ._options import NVFP4_TILE, DotSpec, ElementCast, MXCast, OperandCast
from ._random import random_bits
from ._qdot import register_family, training_dot
from ._scale_rules import ScaleRule, rceil_code
from ._sharding import explicit_sharding, replicated
from .kernels import _nvfp4_cpu
from .kernels._dispatch import (cpu_mx_fused_values, cpu_nvfp4_fused_values, gpu_gemm_routes,
                                kernels_enabled, on_cpu, on_cuda)
from .kernels._mx_fake_cpu import fake_quantize as mx_fake_quantize_cpu

# lhs [M, K] x rhs [G, K, N] -> [M, N], rows of lhs ragged (lax.ragged_dot's layout).
_FORWARD = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (1,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])
# a [M, K] x b [M, N] -> [G, K, N], summed over each group's rows (lax's own transpose of the
# ragged dot with respect to rhs).
_PER_GROUP = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[])


#: The former name of the ragged dot's options: a ragged dot takes the one options object of
#: lowprec's training dots, :class:`~lowprec._options.DotSpec` (its fields ``backward_lhs``,
#: ``backward_rhs``, ``tensor_scaling``, ``high_precision_wgrad`` and ``high_precision_dgrad``
#: were RaggedSpec's). Deprecated: use DotSpec.
RaggedSpec = DotSpec


# -- the public function -------------------------------------------------------------------------


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    lhs_format: FormatLike = None,
    rhs_format: FormatLike = None,
    scale_rule: Union[str, ScaleRule, None] = None,
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    pad: bool = False,
    preferred_element_type=jnp.float32,
    backward: str = "ste",
    grad_format: FormatLike = None,
    group_offset=None,
    out_sharding=None,
    scale_options=None,
) -> jax.Array:
    """Quantized ``lax.ragged_dot`` (a mixture-of-experts layer's grouped matmul).

    Rows ``start_g .. start_g + group_sizes[g] - 1`` of ``lhs`` are multiplied by ``rhs[g]``
    (``start_g`` the sum of the sizes before g; rows past the last group give zeros), each
    group quantized as :func:`dot_general` quantizes one dot: MX blocks along K for both
    operands (each expert's weight along its own K), exact products, float32 sums.

    Args:
      lhs: [M, K] float32/bfloat16/float16 tokens, grouped by expert.
      rhs: [G, K, N] float32/bfloat16/float16 weights, one per group.
      group_sizes: [G] integers, the number of consecutive rows of each group.
      lhs_format, rhs_format, scale_rule, rounding, overflow, pad, preferred_element_type,
        grad_format, scale_options: as for :func:`dot_general`.
      backward: ``"ste"`` (default: the exact float32 gradient of the ragged dot of the
        quantized values) or ``"quantized"``: grad_lhs = Q(g along N) · Q(rhs along N)ᵀ per
        group; grad_rhs[g] = Q(lhs_g along tokens)ᵀ · Q(g_g along tokens) with blocks formed
        within each group (its last block zero-padded, whatever ``pad`` says: group sizes
        are data).
      group_offset: not supported (must be None).
      out_sharding: the output's sharding, given to the inner ``lax.ragged_dot_general``.

    Returns:
      [M, N] in ``preferred_element_type``.

    Raises:
      ValueError: bad shapes, negative (concrete) group sizes, format/rule/mode names as
        :func:`dot_general` refuses them, K not a multiple of the block size without
        ``pad``. TypeError: non-float operands or MXArray operands, non-integer group sizes.
      NotImplementedError: ``group_offset``.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.ones((5, 64))
        >>> w = jnp.stack([jnp.full((64, 2), 0.1), jnp.full((64, 2), 0.3)])
        >>> y = ragged_dot(x, w, jnp.array([3, 2]), lhs_format="mxfp8_e4m3", rhs_format="mxfp4")
        >>> y[:, 0].tolist()  # MXFP4 holds 0.1 as 0.09375 and 0.3 as 0.25
        [6.0, 6.0, 6.0, 16.0, 16.0]
    """
    spec = DotSpec.create(
        lhs_format, rhs_format, grad_format, scale_rule, rounding, overflow, pad, backward,
        preferred_element_type, scale_options=scale_options,
    )
    call = spec.check_ragged_call(lhs, rhs, group_sizes, group_offset, out_sharding)
    return ragged_dot_jit(call.lhs, call.rhs, call.group_sizes, spec, call.out_sharding)


@functools.partial(jax.jit, static_argnums=(3, 4))
def ragged_dot_jit(lhs, rhs, group_sizes, spec: DotSpec, out_sharding=None, sr_key=None):
    """The quantized ragged dot of validated operands (see :meth:`DotSpec.check_ragged_call`):
    lowprec's training dot in the ragged layout family (``sr_key``: the NVFP4 recipe's
    stochastic-rounding key, or None)."""
    aux = group_sizes if spec.nvfp4 is None else (group_sizes, sr_key)
    return training_dot(lhs, rhs, aux, spec, ("ragged", out_sharding))


# -- quantized values ----------------------------------------------------------------------------


def _elementwise(bits, cast: OperandCast):
    """float32 patterns of an operand quantized element by element (or left as it is)."""
    if cast is None:
        return bits
    codes = encode_bits(cast.fmt, bits, cast.rounding, cast.overflow, None)
    return decode_bits(cast.fmt, codes)


def _mx_bits(bits, cast: MXCast, axis: int, tensor_scale=None, words=None):
    """float32 patterns of ``bits`` block-quantized along ``axis`` (zero-padded to whole
    blocks, padding dropped); ``tensor_scale``: float32 for schemes with one, a scalar or one
    per leading index broadcast against the block maxima (e.g. [M, 1] for rows [M, C] along
    axis 1: each row under its own; None: computed from ``bits``); ``words``: stochastic
    rounding's words (the padded shape).

    Per-row tensor scales are broadcast rather than ``vmap``-ped: under ``vmap`` each
    ``lax.cond`` of the encoder and decoder (hardware-float or exact, one-multiply or exact
    product) became a select that traces and runs both formulations; here one branch is
    taken for the whole operand, the same bits (each formulation gives the exact values
    wherever its branch is taken)."""
    n = bits.shape[axis]
    block = cast.fmt.block_size
    bits = zero_padded(bits, axis, -(-n // block) * block)  # +0.0
    rng = None if words is None else (None, words)

    def xla(bits):
        elements, scales, ts = encode_blocks(bits, cast, axis, rng, tensor_scale)
        if ts is not None and ts.ndim:  # the decoder's layout: blocks split at axis + 1
            ts = jnp.expand_dims(ts, axis + 1)
        return mx_value_bits(elements, scales, cast.fmt, axis, n, ts)

    xf = bits_to_f32(bits)
    if (not cast.fmt.scheme.tensor_scale and words is None
            and cpu_mx_fused_values(xf, cast)):
        def fused(bits):  # E8M0 MX: one custom call for the encoder and exact decoder
            values, _ = mx_fake_quantize_cpu(bits_to_f32(bits), cast, axis)  # whole blocks
            return lax.slice_in_dim(f32_bits(values), 0, n, axis=axis)

        return on_cpu(fused, xla, bits)
    if (tensor_scale is None or jnp.ndim(tensor_scale) == 0
            or not cpu_nvfp4_fused_values(xf, cast, words is not None)):
        return xla(bits)

    def kernel(bits):
        # Per-group tensor scales, one per index of axis 0, clamped as encode_blocks clamps
        # a given one; the kernel's fused quantize-and-decode (one custom call for XLA's
        # encoder and decoder; stochastic rounding with the same words): the same bits.
        ts_bits = cast.fmt.scheme.clamp_tensor_scale_bits(f32_bits(tensor_scale), cast)
        ts = lax.bitcast_convert_type(ts_bits, jnp.float32).reshape(bits.shape[:1])
        values = _nvfp4_cpu.fake_quantize(bits_to_f32(bits), cast, axis, words, tensor_scale=ts)
        return lax.slice_in_dim(f32_bits(values), 0, n, axis=axis)

    return on_cpu(kernel, xla, bits)


def _tensor_scales(amax, cast: MXCast):
    """float32 tensor scale of each tensor whose largest finite magnitude is ``amax`` (uint32
    bits, any shape), by the format's own rule: the scale its encoder computes for it."""

    def scale_of(a):
        return cast.fmt.scheme.tensor_scale_bits(a[None], None, cast)

    return lax.bitcast_convert_type(jax.vmap(scale_of)(amax.reshape(-1)),
                                    jnp.float32).reshape(amax.shape)


def _finite_magnitudes(bits):
    """Magnitude bits of float32 patterns, 0 where NaN or infinite."""
    mag = bits & F32_ABS
    return jnp.where(mag < F32_INF, mag, jnp.uint32(0))


def _group_tensor_scales(bits, rows_group, num: int, cast: MXCast):
    """float32 tensor scale of each of ``num`` row groups of ``bits`` [R, C], from the
    group's largest finite magnitude by the format's own rule."""
    row_amax = jnp.max(_finite_magnitudes(bits), axis=1, initial=jnp.uint32(0))
    amax = jax.ops.segment_max(row_amax, rows_group, num_segments=num)  # empty groups: 0
    return _tensor_scales(amax, cast)


def _row_values(bits, cast: OperandCast, gid, groups: int, words=None):
    """Rows [M, C] of a token operand quantized along C (axis 1), each with its group's
    tensor scale where the format has one (``words``: [M, C padded], stochastic rounding)."""
    if not isinstance(cast, MXCast):
        return _elementwise(bits, cast)
    if not cast.fmt.scheme.tensor_scale:
        return _mx_bits(bits, cast, 1)
    ts = _group_tensor_scales(bits, gid, groups + 1, cast)[gid]
    return _mx_bits(bits, cast, 1, ts[:, None], words)


def _expert_values(bits, cast: OperandCast, axis: int):
    """Experts [G, ...] quantized along ``axis``, each on its own (its own tensor scale)."""
    if not isinstance(cast, MXCast):
        return _elementwise(bits, cast)
    if not cast.fmt.scheme.tensor_scale:
        return _mx_bits(bits, cast, axis)
    amax = jnp.max(_finite_magnitudes(bits), axis=tuple(range(1, bits.ndim)),
                   initial=jnp.uint32(0))
    ts = _tensor_scales(amax, cast)
    return _mx_bits(bits, cast, axis, ts.reshape((-1,) + (1,) * (bits.ndim - 1)))


def _token_block_values(bits, cast: OperandCast, unit_group, groups: int, unit: int,
                        words=None):
    """A token operand in the per-group padded layout [Mp, C] (every group starting at a
    multiple of ``unit``) quantized along tokens (axis 0); ``unit_group``: the group of each
    run of ``unit`` rows (``groups`` for the trailing zeros); ``words``: [Mp, C], stochastic
    rounding (a format with a tensor scale)."""
    if not isinstance(cast, MXCast):
        return _elementwise(bits, cast)
    if not cast.fmt.scheme.tensor_scale:
        return _mx_bits(bits, cast, 0)
    mp, c = bits.shape
    units = bits.reshape(mp // unit, unit, c)
    rows_group = jnp.repeat(unit_group, unit)
    ts = _group_tensor_scales(bits, rows_group, groups + 1, cast)[unit_group]
    if words is not None:
        words = words.reshape(mp // unit, unit, c)
    return _mx_bits(units, cast, 1, ts[:, None, None], words).reshape(mp, c)


# -- per-group power-of-two scales (scaling="tensor") --------------------------------------------


def _exponents(amax_bits, cast: OperandCast):
    """The power-of-two scale exponent of tensors whose largest magnitudes are ``amax_bits``
    (the MX ``rceil`` rule, clipped to [-126, 127]); 0 for operands that are not rounded to
    an element format."""
    if not isinstance(cast, ElementCast):
        return jnp.zeros(amax_bits.shape, jnp.int32)
    e = rceil_code(amax_bits, cast.fmt.max_finite_exact) - E8M0_BIAS
    return jnp.clip(e, -126, 127).astype(jnp.int32)


def _row_exponents(bits, gid, groups: int, cast: OperandCast):
    """[G + 1] exponents of the row groups of a token operand (the last: rows in no group)."""
    row_amax = jnp.max(bits & F32_ABS, axis=1, initial=jnp.uint32(0))
    return _exponents(jax.ops.segment_max(row_amax, gid, num_segments=groups + 1), cast)


def _expert_exponents(bits, cast: OperandCast):
    """[G + 1] exponents of the experts (the last, 0, for rows in no group), on every device:
    with experts split across devices (expert parallelism, Explicit axes) the G exponents are
    gathered, as every device's tokens may belong to any expert."""
    e = _exponents(jnp.max(bits & F32_ABS, axis=(1, 2), initial=jnp.uint32(0)), cast)
    return jnp.concatenate([replicated(e), jnp.zeros((1,), jnp.int32)])


def _scaled(bits, e):
    """float32 patterns of ``bits * 2^-e`` (``e`` broadcastable)."""
    return f32_bits(bits_to_f32(bits) * pow2_f32(-e))


# -- products ------------------------------------------------------------------------------------


def _kind(cast: OperandCast, dtype) -> str:
    """Which dot the quantized values allow: ``"bf16"`` (every value a bfloat16, known from
    the format), ``"f32"``, or ``"dynamic"`` (E8M0-scaled blocks: bfloat16 unless a value
    falls below its normal range, checked at run time)."""
    if cast is None:
        return "bf16" if np.dtype(dtype) == np.dtype(jnp.bfloat16) else "f32"
    if isinstance(cast, MXCast):
        fmt = cast.fmt
        return "dynamic" if fast_decode_applies(fmt) and fmt.element.mantissa_bits <= 7 else "f32"
    return "bf16" if exactly_representable(cast.fmt, jnp.bfloat16) else "f32"


def _bf16_exact(bits):
    """Whether every float32 pattern is a bfloat16 normal number, zero, inf or NaN."""
    mag = bits & F32_ABS
    return jnp.all(((bits & 0xFFFF) == 0) & ((mag >= 0x0080_0000) | (mag == 0)))


def _product(a, b, group_sizes, dn, kinds=("f32", "f32"), out_sharding=None):
    """float32 ragged dot of float32 patterns ``a`` and ``b``: in bfloat16 where every value
    is one (exact products either way), else float32 at ``precision=HIGHEST``."""

    def f32(a, b):
        return lax.ragged_dot_general(
            bits_to_f32(a), bits_to_f32(b), group_sizes, dn, precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32, out_sharding=out_sharding)

    def bf16(a, b):
        return lax.ragged_dot_general(
            bits_to_bf16_truncating(a), bits_to_bf16_truncating(b), group_sizes, dn,
            preferred_element_type=jnp.float32, out_sharding=out_sharding)

    if "f32" in kinds:
        return f32(a, b)
    if all(k == "bf16" for k in kinds):
        return bf16(a, b)

    def portable(a, b):
        ok = jnp.bool_(True)
        for x, kind in zip((a, b), kinds):
            if kind == "dynamic":
                ok = ok & _bf16_exact(x)
        return lax.cond(ok, bf16, f32, a, b)

    if not gpu_gemm_routes(kernels_enabled()):
        return portable(a, b)

    def gpu(a, b):
        # The GPU route (docs/design.md §13): no run-time check, no float32 GEMM; values below
        # bfloat16's subnormal step (only in blocks of the smallest E8M0 scales) are rounded
        # to nearest even, exactly as _gpu_gemm.block_values_bf16 rounds them.
        return lax.ragged_dot_general(
            bits_to_f32(a).astype(jnp.bfloat16), bits_to_f32(b).astype(jnp.bfloat16),
            group_sizes, dn, preferred_element_type=jnp.float32, out_sharding=out_sharding)

    return on_cuda(gpu, portable, a, b)


def _group_ids(group_sizes, m: int):
    """int32 [m]: the group of each row (G for rows past the last group)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def _padded_layout(group_sizes, m: int, unit: int):
    """The per-group padded token layout: ``(source, unit_group, padded_sizes)``.

    Group g's rows move to rows ``pstart_g ..`` of an array of Mp = M + G·(unit − 1) rows
    (rounded down to a multiple of ``unit``, the most the padding can take), where every
    ``pstart_g`` is a multiple of ``unit`` and each group is followed by zero rows up to the
    next multiple. ``source``: the row of the input each padded row takes (``m``, out of
    range, for a zero row); ``unit_group``: the group of each run of ``unit`` rows (G past
    the last group); ``padded_sizes``: the groups' sizes rounded up to multiples of
    ``unit``."""
    groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(group_sizes), m)  # rows past M do not exist
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = ends - starts
    padded_sizes = (sizes + unit - 1) // unit * unit
    pends = jnp.cumsum(padded_sizes)
    pstarts = pends - padded_sizes
    mp = max(unit, (m + groups * (unit - 1)) // unit * unit)
    p = jnp.arange(mp, dtype=jnp.int32)
    group = jnp.searchsorted(pends, p, side="right").astype(jnp.int32)
    g = jnp.minimum(group, groups - 1)
    offset = p - pstarts[g]
    valid = (group < groups) & (offset < sizes[g])
    source = jnp.where(valid, starts[g] + offset, m)
    return source, group[::unit], padded_sizes


def _gathered(bits, source):
    return jnp.take(bits, source, axis=0, mode="fill", fill_value=0)


# -- the ragged layout family of the training dot -------------------------------------------------


def _ragged_fwd(lhs, rhs, group_sizes, spec: DotSpec, layout: tuple):
    _, out_sharding = layout
    if spec.nvfp4 is not None:
        return _nvfp4_fwd(lhs, rhs, group_sizes, spec, out_sharding)
    m, groups = lhs.shape[0], rhs.shape[0]
    gid = _group_ids(group_sizes, m)
    lb, rb = input_bits(lhs), input_bits(rhs)
    if spec.tensor_scaling:
        el, er = _row_exponents(lb, gid, groups, spec.lhs), _expert_exponents(rb, spec.rhs)
        lb, rb = _scaled(lb, el[gid][:, None]), _scaled(rb, er[:groups, None, None])
    lv = _row_values(lb, spec.lhs, gid, groups)
    rv = _expert_values(rb, spec.rhs, 1)
    kinds = (_kind(spec.lhs, lhs.dtype), _kind(spec.rhs, rhs.dtype))
    out = _product(lv, rv, group_sizes, _FORWARD, kinds, out_sharding)
    if spec.tensor_scaling:  # each row's group: 2^(el_g + er_g), as its own dot would
        out = out * pow2_f32(el[gid])[:, None] * pow2_f32(er[gid])[:, None]
    # Residuals are the inputs; quantized values are recomputed in the backward pass.
    return bits_to_dtype(f32_bits(out), spec.out_dtype), (lhs, rhs, group_sizes)


def _ragged_bwd(spec: DotSpec, layout: tuple, residuals, g):
    if spec.nvfp4 is not None:
        return _nvfp4_bwd(spec, residuals, g)
    lhs, rhs, group_sizes = residuals
    m, groups = lhs.shape[0], rhs.shape[0]
    gid = _group_ids(group_sizes, m)
    lb, rb, gb = input_bits(lhs), input_bits(rhs), input_bits(g)
    # On Explicit mesh axes each gradient is sharded as its operand (lax.ragged_dot_general
    # infers no output sharding there: it must be given).
    shardings = (explicit_sharding(lhs), explicit_sharding(rhs))
    if spec.backward == "ste":
        grad_l, grad_r = _ste_backward(spec, lb, rb, gb, group_sizes, gid, groups, shardings)
    else:
        spec.check_ragged_backward(rhs.shape[2])
        grad_l, grad_r = _quantized_backward(spec, lhs, rhs, gb, group_sizes, gid, groups,
                                             shardings)
    if spec.high_precision_wgrad:
        # The weight gradient of the float layer: a float32 ragged dot of the unquantized
        # tokens and cotangent (XLA drops the one computed above).
        grad_r = _product(lb, gb, group_sizes, _PER_GROUP, out_sharding=shardings[1])
    if spec.high_precision_dgrad:  # likewise the input gradient
        grad_l = _product(gb, jnp.swapaxes(rb, 1, 2), group_sizes, _FORWARD,
                          out_sharding=shardings[0])
    return (bits_to_dtype(f32_bits(grad_l), lhs.dtype), bits_to_dtype(f32_bits(grad_r), rhs.dtype),
            None)


def _ste_backward(spec: DotSpec, lb, rb, gb, group_sizes, gid, groups: int, shardings):
    """The exact float32 gradient of the ragged dot of the quantized values."""
    el = er = None
    if spec.tensor_scaling:
        el, er = _row_exponents(lb, gid, groups, spec.lhs), _expert_exponents(rb, spec.rhs)
        lb, rb = _scaled(lb, el[gid][:, None]), _scaled(rb, er[:groups, None, None])
    lv = _row_values(lb, spec.lhs, gid, groups)
    rv = _expert_values(rb, spec.rhs, 1)
    sl, sr = shardings
    grad_l = _product(gb, jnp.swapaxes(rv, 1, 2), group_sizes, _FORWARD, out_sharding=sl)
    grad_r = _product(lv, gb, group_sizes, _PER_GROUP, out_sharding=sr)
    if spec.tensor_scaling:  # the dequantized values are 2^e times the scaled ones
        grad_l = grad_l * pow2_f32(er[gid])[:, None]
        grad_r = grad_r * pow2_f32(el[:groups])[:, None, None]
    return grad_l, grad_r


def _quantized_backward(spec: DotSpec, lhs, rhs, gb, group_sizes, gid, groups: int,
                        shardings):
    """Both backward dots quantized, each operand along that dot's reduction axis, per group."""
    m = lhs.shape[0]
    lb, rb = input_bits(lhs), input_bits(rhs)
    bl, br, cg = spec.bwd_lhs, spec.bwd_rhs, spec.grad
    if spec.tensor_scaling:
        el, er = _row_exponents(lb, gid, groups, bl), _expert_exponents(rb, br)
        eg = _row_exponents(gb, gid, groups, cg)
        lb, rb = _scaled(lb, el[gid][:, None]), _scaled(rb, er[:groups, None, None])
        gb = _scaled(gb, eg[gid][:, None])
    # grad_lhs: the cotangent (each row) and every expert blocked along N.
    gv = _row_values(gb, cg, gid, groups)
    rv = jnp.swapaxes(_expert_values(rb, br, 2), 1, 2)  # [G, N, K]
    kinds = (_kind(cg, jnp.float32), _kind(br, rhs.dtype))
    sl, sr = shardings
    grad_l = _product(gv, rv, group_sizes, _FORWARD, kinds, sl)
    # grad_rhs: tokens and cotangent blocked along each group's tokens.
    kinds = (_kind(bl, lhs.dtype), _kind(cg, jnp.float32))
    blocks = [c.fmt.block_size for c in (bl, cg) if isinstance(c, MXCast)]
    if blocks:
        unit = max(blocks)  # block sizes are powers of two: a multiple of each
        source, unit_group, padded_sizes = _padded_layout(group_sizes, m, unit)
        lv = _token_block_values(_gathered(lb, source), bl, unit_group, groups, unit)
        gv2 = _token_block_values(_gathered(gb, source), cg, unit_group, groups, unit)
        grad_r = _product(lv, gv2, padded_sizes, _PER_GROUP, kinds, sr)
    else:
        grad_r = _product(_elementwise(lb, bl), _elementwise(gb, cg), group_sizes, _PER_GROUP,
                          kinds, sr)
    if spec.tensor_scaling:
        grad_l = grad_l * pow2_f32(er[gid])[:, None] * pow2_f32(eg[gid])[:, None]
        grad_r = (grad_r * pow2_f32(el[:groups])[:, None, None]
                  * pow2_f32(eg[:groups])[:, None, None])
    return grad_l, grad_r


# -- the NVFP4 training recipe, per group ----------------------------------------------------------
#
# Each group is the recipe's own dot (_nvfp4_train.py) of its tokens and its expert: tokens
# quantized along K under the group's tensor scale, each expert's weight in 16 x 16 tiles
# (weight_block_2d) under its own; grad_x = Q(g along N, SR words) . Q2(w_g)^T; grad_w =
# Q(M x_g along T)^T . Q(M g_g along T, SR words), the Hadamard transform M and the token
# blocks running in the per-group padded layout (every group starting at a multiple of 16,
# zero rows after it: a 16-block never mixes two groups, and the zero rows are the zero
# padding of the group's own dot). Random words (stochastic rounding): k as the recipe's
# (the dot's key inside stochastic_rounding_key, else fold_in(key(seed), h) with h the
# wrapping sum of the cotangent's bits), w_d = random_bits(fold_in(k, 0), [M, N16]) for
# the cotangent's rows and w_w = random_bits(fold_in(k, 1), [Mp, N16]) in the padded layout.


def _nvfp4_casts(spec: DotSpec):
    """The recipe's NVFP4 casts: round to nearest even, and the cotangent's rounding."""
    opts = spec.nvfp4
    rn = MXCast("nvfp4", None, "nearest_even", opts.nvfp4_step)
    grad = MXCast("nvfp4", None, opts.grad_rounding, opts.nvfp4_step)
    return rn, grad


def _nvfp4_weights(rb, spec: DotSpec):
    """[G, K, N] float32 patterns: each expert's weight quantized as the recipe reads it
    (16 x 16 tiles of its [N, K] matrix with ``weight_block_2d``, else 16-blocks along K),
    under its own tensor scale."""
    opts = spec.nvfp4
    if not opts.weight_block_2d:
        return _expert_values(rb, _nvfp4_casts(spec)[0], 1)
    _, k, n = rb.shape

    def one(w):  # [K, N] -> the tiles of its [N16, K16] matrix, back to [K, N]
        wt = jnp.pad(bits_to_f32(w).T, ((0, -n % NVFP4_TILE), (0, -k % NVFP4_TILE)))
        return f32_bits(quantize_2d(wt, step=opts.nvfp4_step)[:n, :k].T)

    return jax.vmap(one)(rb)


def _nvfp4_fwd(lhs, rhs, aux, spec: DotSpec, out_sharding):
    group_sizes, sr_key = aux
    m, groups = lhs.shape[0], rhs.shape[0]
    gid = _group_ids(group_sizes, m)
    lv = _row_values(input_bits(lhs), _nvfp4_casts(spec)[0], gid, groups)
    rv = _nvfp4_weights(input_bits(rhs), spec)
    out = _product(lv, rv, group_sizes, _FORWARD, out_sharding=out_sharding)
    return bits_to_dtype(f32_bits(out), spec.out_dtype), (lhs, rhs, group_sizes, sr_key)


def _nvfp4_bwd(spec: DotSpec, residuals, g):
    lhs, rhs, group_sizes, sr_key = residuals
    opts = spec.nvfp4
    (m, _), (groups, _, n) = lhs.shape, rhs.shape
    gid = _group_ids(group_sizes, m)
    lb, rb, gb = input_bits(lhs), input_bits(rhs), input_bits(g)
    sl, sr = explicit_sharding(lhs), explicit_sharding(rhs)
    rn, gcast = _nvfp4_casts(spec)
    override = opts.backward_override
    if override is not None:  # float32 products of g and the operands as the forward read them
        if override == "dequantized":
            lb, rb = _row_values(lb, rn, gid, groups), _nvfp4_weights(rb, spec)
        grad_l = _product(gb, jnp.swapaxes(rb, 1, 2), group_sizes, _FORWARD, out_sharding=sl)
        grad_r = _product(lb, gb, group_sizes, _PER_GROUP, out_sharding=sr)
    else:
        wd = ww = None
        n16 = -(-n // NVFP4_TILE) * NVFP4_TILE
        source, unit_group, padded_sizes = _padded_layout(group_sizes, m, NVFP4_TILE)
        if opts.grad_rounding == "stochastic":
            key = sr_key
            if key is None:
                h = jnp.sum(gb, dtype=jnp.uint32)  # padding adds zeros
                key = jax.random.fold_in(jax.random.key(opts.seed), h)
            wd = random_bits(jax.random.fold_in(key, 0), (m, n16))
            ww = random_bits(jax.random.fold_in(key, 1), (source.shape[0], n16))
        # grad_x: each row of g along N (its group's tensor scale) . the expert's weight.
        gv = _row_values(gb, gcast, gid, groups, wd)
        rv = jnp.swapaxes(_nvfp4_weights(rb, spec), 1, 2)  # [G, N, K]
        grad_l = _product(gv, rv, group_sizes, _FORWARD, out_sharding=sl)
        # grad_w: tokens and cotangent in the per-group padded layout, transformed and
        # quantized along tokens.
        xp, gp = bits_to_f32(_gathered(lb, source)), bits_to_f32(_gathered(gb, source))
        if opts.wgrad_rht:
            signs = recipe_rht_signs(opts)
            xp, gp = recipe_rht(xp, opts, signs, 0), recipe_rht(gp, opts, signs, 0)
        xv = _token_block_values(f32_bits(xp), rn, unit_group, groups, NVFP4_TILE)
        gv2 = _token_block_values(f32_bits(gp), gcast, unit_group, groups, NVFP4_TILE,
                                  None if ww is None else ww[:, :n])
        grad_r = _product(xv, gv2, padded_sizes, _PER_GROUP, out_sharding=sr)
    return (bits_to_dtype(f32_bits(grad_l), lhs.dtype), bits_to_dtype(f32_bits(grad_r), rhs.dtype),
            (None, None))


register_family("ragged", _ragged_fwd, _ragged_bwd)

__all__ = ["ragged_dot"]
