"""The quantized dot product behind :func:`lowprec.dot_general`, and its training path.

Each operand is a float array (quantized here, along the contraction axis), an
:class:`~lowprec.MXArray` already blocked along its contraction axis, or left alone.
The product is computed in three steps, each chosen so that the result is the exact
dot product of the quantized values up to float32 accumulation error only:

1. Decode the operands bit-exactly (integer arithmetic on codes and scales, never a
   ``float8`` dtype), which is why this runs on CPU, where XLA has no FP8 GEMM and
   ``jax.nn.scaled_dot_general`` has no lowering, and why XLA cannot elide the
   quantization under ``jit`` on GPU (openxla/xla#41605: ``convert(convert(x, f8), f32)``
   folds to ``x``; there is no such pair here).
2. Feed the values to the dot in **bfloat16** when that is exact: an E4M3/E5M2/E2M1 value
   has at most 3 mantissa bits (bfloat16 has 7) and 2^s × value keeps that significand, so it
   is a bfloat16 value unless it lands below bfloat16's normal range (2^-126) with bits
   below 2^-133. That is ruled out at run time, per operand, in one pass over the codes:
   every block either has a scale code keeping even its smallest nonzero element at or
   above 2^-126, or holds only zeros (scale codes alone would not do: an all-zero block
   carries code 0 = 2^-127). ``lax.cond`` then picks the bfloat16 dot, or the float32
   dot if any block fails. FP16/TF32 operands, which bfloat16 cannot hold, use float32
   statically.
3. ``lax.dot_general(..., preferred_element_type=float32)``: products of bfloat16 values
   are exact in float32, so the only error is float32 accumulation,
   |result − exact| ≤ K·2^-23·Σ|a_i b_i| (plus one rounding if the output is bfloat16).
   Float32 dots use ``precision=HIGHEST`` so no backend rounds operands to TF32/bf16.

Subnormal caveat: XLA on CPU flushes float32 subnormals in arithmetic, so values or
products below 2^-126 become zero there on either path; GPUs keep them, which is where
the float32 fallback matters.

Training: :func:`training_dot`, the one custom VJP of every lowprec training dot (below;
its dense family is this dot). ``backward="ste"`` differentiates the float dot of the quantized
values (straight-through the quantizers). ``backward="quantized"`` makes both backward
dots quantized dots as in MX training recipes (microxcaling's linear layer): for
y = x·w with x [T, K], w [K, N] and cotangent g [T, N], grad_x = Q(g)·Q(w)ᵀ with g and
w blocked along N (grad_x reduces over output features) and grad_w = Q(x)ᵀ·Q(g) with x
and g blocked along T (grad_w reduces over tokens). Operands are re-quantized from their
float values along these new axes (a pre-quantized operand is dequantized first).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._bits import E8M0_BIAS, bits_to_bf16_truncating, bits_to_f32, f32_bits
from ._decode import decode_bits
from ._dtypes import bits_to_dtype, exactly_representable, input_bits
from ._encode import encode_bits
from ._format import MXFormat
from ._gemv import decode_time_route
from ._gpu_gemm import (FP8_DTYPES, apply_tensor_scales, block_bf16_exact, block_values_bf16,
                        fp8_pair, fp8_values)
from ._mx_decode import fast_decode_applies, fast_decode_exact, mx_value_bits, mx_value_bits_fast
from ._mx_encode import padded_bits, quantize_mxarray, zero_padded
from ._mxarray import MXArray
from ._options import DotSpec, ElementCast, MXCast, OperandCast
from ._scale_rules import rceil_code
from ._sharding import (dot_out_sharding, explicit_sharding, merge_dims, merged_sharding,
                        split_out_sharding, without_leading)
from .kernels import _nvfp4_cpu
from .kernels._dispatch import (cpu_mx_fused_values, cpu_nvfp4_fused_values, gpu_gemm_routes,
                                mxdot_kernel, on_cpu, on_cuda)
from .kernels._mx_fake_cpu import fake_quantize as mx_fake_quantize_cpu
from .kernels._mxdot_pallas import mxdot_pallas

# -- dimension numbers and canonical (B, M, K) layout ------------------------------------------


def shape_of(x) -> tuple:
    return tuple(x.shape)


def _canon_perm(nd: int, contract, batch):
    free = [d for d in range(nd) if d not in contract and d not in batch]
    return list(batch) + free + list(contract), free


def _canonicalize(x, contract, batch):
    """Reshapes an operand to 3-D, (B, M, K) or (B, K, M); returns it and its contraction axis.

    Contracting dimensions are flattened in the order given, so MX blocks of a float operand
    run along that flattened axis (as in ``jax.nn.scaled_dot_general``). Nothing is moved
    when the operand's dimensions already come as (batch, free, contracting) — contraction
    axis 2, e.g. activations [T, K] — or as (batch, contracting, free) — contraction axis 1,
    e.g. a weight [K, N]: the dot takes either layout as it is. Other orders are transposed
    to (B, M, K). An MXArray must have exactly one contracting dimension, its block axis
    (checked before), and keeps its codes: only uint8 arrays are reshaped (or moved). On
    ``Explicit`` mesh axes each merged dim is sharded by the mesh axes of the dims it merges
    (:func:`~lowprec._sharding.merge_dims`: [B@x, S, D] gives (1, (B S)@x, D), no data moved).
    """
    shape = shape_of(x)
    nd = len(shape)
    perm, free = _canon_perm(nd, contract, batch)
    b = math.prod(shape[d] for d in batch)
    m = math.prod(shape[d] for d in free)
    k = math.prod(shape[d] for d in contract)
    ca = 2
    if perm != list(range(nd)) and list(batch) + list(contract) + free == list(range(nd)):
        perm, ca = list(range(nd)), 1
    # The dims of the transposed operand, grouped as they merge into its three.
    nb, nk = len(batch), len(contract)
    inner = (nb, nd - nk) if ca == 2 else (nb, nb + nk)
    groups = [range(inner[0]), range(*inner), range(inner[1], nd)]
    if not isinstance(x, MXArray):
        x = jnp.transpose(x, perm)
        return merge_dims(x, (b, m, k) if ca == 2 else (b, k, m), groups), ca

    def canon(codes):
        codes = jnp.transpose(codes, perm)
        kc = codes.shape[len(batch)] if ca == 1 else codes.shape[-1]  # padded/packed length
        return merge_dims(codes, (b, m, kc) if ca == 2 else (b, kc, m), groups)

    full = (b, m, k) if ca == 2 else (b, k, m)
    return MXArray(canon(x.elements), canon(x.scales), x.fmt, ca, full, x.scale_rule,
                   x.tensor_scale), ca


def _free(ca: int) -> int:
    """The free axis of a canonical operand whose contraction axis is ``ca``."""
    return 3 - ca


# -- operand decoding ---------------------------------------------------------------------------


def _mx_bits(mx: MXArray):
    """Exact float32 bit patterns (uint32) of an MXArray's values, padding dropped."""
    return mx_value_bits(mx.elements, mx.scales, mx.fmt, mx.axis, mx.shape[mx.axis],
                         mx.tensor_scale)


def _bf16_capable(fmt: MXFormat) -> bool:
    """Whether blocks of ``fmt`` can be decoded by the fast decode into bfloat16 (static):
    E8M0 scales and elements with at most bfloat16's 7 mantissa bits."""
    return fast_decode_applies(fmt) and fmt.element.mantissa_bits <= 7


def mx_bf16_exact(mx: MXArray):
    """Whether bfloat16 holds every value of ``mx`` exactly (a sufficient test, scalar bool).

    A scale code of at least ``1 - log2(min_subnormal)`` (10 for E4M3, 17 for E5M2, 2 for
    E2M1) keeps even the smallest nonzero element at or above 2^-126, in bfloat16's normal
    range, where a ≤ 3-bit significand is exact. Blocks holding only zeros are exact at any
    scale; they matter because an all-zero block carries scale code 0 (2^-127) and would
    otherwise force the float32 path for nothing. This is the condition under which the
    fast decode (one float multiply per element) is exact (``_mx_decode.fast_decode_exact``):
    the scales decide alone when all are large, the codes are read only otherwise. Blocks
    with tiny scales and nonzero elements go to float32 even when bfloat16 would happen to
    hold them (rare, and still exact).
    """
    if not _bf16_capable(mx.fmt):
        return jnp.bool_(False)
    return fast_decode_exact(mx.elements, mx.scales, mx.fmt, mx.axis)


def _quantize_operand(x, cast: OperandCast, ca: int):
    """Quantizes a canonical float operand along its contraction axis ``ca`` (whole blocks
    or ``pad``: checked by ``DotSpec.check_call`` / ``check_backward``).

    Returns ``(operand, kind)``: an MXArray with kind ``"dynamic"`` (bfloat16 unless a value
    falls out of its range) or ``"f32"`` (a block format bfloat16 cannot hold), or float32
    bits (uint32) with kind ``"bf16"``/``"f32"`` (the narrowest dtype holding every value
    exactly, known from the format alone).
    """
    if isinstance(x, MXArray):
        return x, "dynamic" if _bf16_capable(x.fmt) else "f32"
    if cast is None:
        return input_bits(x), "bf16" if x.dtype == jnp.bfloat16 else "f32"
    if isinstance(cast, MXCast):
        block = cast.fmt.block_size
        padded = -(-x.shape[ca] // block) * block
        mx = quantize_mxarray(padded_bits(x, ca, padded), cast, ca, tuple(x.shape), None)
        return mx, "dynamic" if _bf16_capable(cast.fmt) else "f32"
    codes = encode_bits(cast.fmt, input_bits(x), cast.rounding, cast.overflow, None)
    bits = decode_bits(cast.fmt, codes)
    return bits, "bf16" if exactly_representable(cast.fmt, jnp.bfloat16) else "f32"


def _portable_operand(x, cast: OperandCast, ca: int):
    """:func:`_quantize_operand` for the portable dot. An NVFP4 operand (kind ``"f32"``:
    its values only feed a float32 dot) is, where ``kernels/_dispatch`` says, the float32
    bits of its values from the native kernel's fused quantize-and-decode on CPU (one custom
    call in place of XLA's encoder and decoder, each a ``lax.cond`` of two formulations:
    ~1,700 HLO instructions per operand), the same bits as the codes decoded."""
    if (isinstance(x, MXArray) or not isinstance(cast, MXCast) or _bf16_capable(cast.fmt)
            or not cpu_nvfp4_fused_values(x, cast)):
        return _quantize_operand(x, cast, ca)

    def kernel(v):
        n = v.shape[ca]
        padded = -(-n // cast.fmt.block_size) * cast.fmt.block_size
        # +0.0 padding: no block maximum or tensor scale changes
        values = _nvfp4_cpu.fake_quantize(zero_padded(v, ca, padded), cast, ca)
        return f32_bits(lax.slice_in_dim(values, 0, n, axis=ca))

    def xla(v):
        return _operand_bits(_quantize_operand(v, cast, ca)[0])

    return on_cpu(kernel, xla, x), "f32"


def _operand_bits(op):
    return _mx_bits(op) if isinstance(op, MXArray) else op


def _contract(a, ca: int, b, cb: int, out_sharding=None, **kwargs):
    """float32 dot of 3-D operands over a's axis ``ca`` and b's axis ``cb``, batched over
    axis 0: (B, a's free, b's free). A plain 2-D dot when B == 1 (XLA:CPU runs 2-D dots
    through a faster kernel than batched ones). ``out_sharding`` (3-D, Explicit mesh axes)
    goes to the dot itself, which reduces a sharded contraction into that layout."""
    if a.shape[0] == 1:
        dn = (((ca - 1,), (cb - 1,)), ((), ()))
        out = lax.dot_general(a[0], b[0], dn, preferred_element_type=jnp.float32,
                              out_sharding=without_leading(out_sharding), **kwargs)
        return out[None]
    dn = (((ca,), (cb,)), ((0,), (0,)))
    return lax.dot_general(a, b, dn, preferred_element_type=jnp.float32,
                           out_sharding=out_sharding, **kwargs)


def _bf16_values(op, factor):
    if isinstance(op, MXArray):
        # Fast decode, then truncation to bfloat16: both exact, as this branch runs only
        # when mx_bf16_exact holds.
        n = op.shape[op.axis]
        bits = mx_value_bits_fast(op.elements, op.scales, op.fmt, op.axis, n,
                                  canonical_nan=False, factor=factor)
        return bits_to_bf16_truncating(bits)
    return bits_to_bf16_truncating(op)  # a format whose values are all bfloat16


def _factor(op):
    """An MX operand's block factors 2^(s - 127), computed once before the branch that uses
    them (else None)."""
    if isinstance(op, MXArray) and _bf16_capable(op.fmt):
        return op.fmt.scheme.fast_decoder().scale_factors(op.scales)
    return None


def _dot_bf16(layout, lop, rop, factors=(None, None), out_sharding=None, kernels=True):
    la, ra = layout

    def xla(lop, rop):
        return _contract(_bf16_values(lop, factors[0]), la, _bf16_values(rop, factors[1]), ra,
                         out_sharding)

    if not mxdot_kernel(layout, lop, rop, kernels, out_sharding):
        return xla(lop, rop)

    def fused(lop, rop):
        return mxdot_pallas(lop.elements[0], lop.scales[0], rop.elements[0], rop.scales[0],
                            fa=lop.fmt, fb=rop.fmt)[None]

    # On CUDA the codes are decoded in the GEMM's operand load (kernels/_mxdot_pallas.py): XLA
    # writes each decoded bfloat16 operand to memory and reads it back. (Only with
    # the policy's fused_mxdot on: on an H200 the kernel was still slower than XLA's route.)
    return on_cuda(fused, xla, lop, rop)


def _dot_f32(layout, lop, rop, factors=None, out_sharding=None):
    la, ra = layout
    a, b = bits_to_f32(_operand_bits(lop)), bits_to_f32(_operand_bits(rop))
    return _contract(a, la, b, ra, out_sharding, precision=lax.Precision.HIGHEST)


def _qdot_canonical(lhs, rhs, lcast: OperandCast, rcast: OperandCast, layout: tuple = (2, 2),
                    out_sharding=None, kernels: bool = True):
    """Quantized dot of canonical operands contracted over their axes ``layout = (la, ra)``
    (default: (B, M, K) x (B, N, K)) → (B, M, N) float32, no autodiff rule of its own;
    ``kernels``: the kernel policy (a Pallas kernel for the bfloat16 branch, the GPU GEMM
    routes). Where XLA lowers for CUDA, a product with a GPU route (:func:`_gpu_route`)
    takes it; elsewhere, and for every other product, the portable formulation."""
    route = None
    if gpu_gemm_routes(kernels):
        route = _gpu_route(lhs, rhs, lcast, rcast, layout, out_sharding, kernels)
    portable = functools.partial(_qdot_portable, lcast=lcast, rcast=rcast, layout=layout,
                                 out_sharding=out_sharding, kernels=kernels)
    if route is None:
        return portable(lhs, rhs)
    return on_cuda(route, portable, lhs, rhs)


def _gpu_kind(x, cast: OperandCast):
    """How an operand enters a GPU GEMM (static): ``"fp8"`` (an FP8 element format),
    ``"block"`` (a block format whose values ``_gpu_gemm.block_values_bf16`` gives as
    bfloat16), ``"bf16"`` (values bfloat16 holds, known from the format or dtype) or None
    (float32 is needed: a float32 operand used as it is, FP16/TF32 formats)."""
    if isinstance(x, MXArray) or isinstance(cast, MXCast):
        return "block" if block_bf16_exact(x.fmt if isinstance(x, MXArray) else cast.fmt) else None
    if cast is None:
        return "bf16" if x.dtype == jnp.bfloat16 else None
    if cast.fmt.name in FP8_DTYPES:
        return "fp8"
    return "bf16" if exactly_representable(cast.fmt, jnp.bfloat16) else None


def _gpu_route(lhs, rhs, lcast: OperandCast, rcast: OperandCast, layout: tuple, out_sharding,
               kernels: bool = True):
    """The CUDA formulation of a canonical quantized dot, or None where the portable one is
    already what the GPU should run (a bfloat16 GEMM of formats bfloat16 holds) or float32
    is needed (docs/design.md §13, GPU GEMMs):

    * two FP8 element formats cuBLASLt pairs (E4M3 x E4M3, E4M3 x E5M2): the codes of
      lowprec's encoder as float8 operands, FP8 GEMM (``_gpu_gemm.fp8_values``);
    * otherwise, when one operand is a block format and both enter as bfloat16: each block
      operand decoded to bfloat16 in one pass with no branch (the portable route checks at
      run time whether bfloat16 is exact and keeps a float32 GEMM for when it is not; NVFP4
      always took float32), a bfloat16 GEMM, NVFP4 tensor scales on its float32 output.
    """
    la, ra = layout
    kinds = (_gpu_kind(lhs, lcast), _gpu_kind(rhs, rcast))
    if kinds == ("fp8", "fp8") and fp8_pair(lcast.fmt, rcast.fmt):
        def fp8(a, b):
            ca, cb = (encode_bits(c.fmt, input_bits(v), c.rounding, c.overflow, None)
                      for v, c in ((a, lcast), (b, rcast)))
            return _contract(fp8_values(ca, lcast.fmt), la, fp8_values(cb, rcast.fmt), ra,
                             out_sharding, precision=lax.Precision.HIGHEST)

        return fp8
    if None in kinds or "block" not in kinds:
        return None

    def operand(op):
        if isinstance(op, MXArray):
            return block_values_bf16(op)
        return bits_to_bf16_truncating(op), None  # a format (or dtype) bfloat16 holds

    def bf16(a, b):
        lop, _ = _quantize_operand(a, lcast, la)
        rop, _ = _quantize_operand(b, rcast, ra)
        if mxdot_kernel(layout, lop, rop, kernels, out_sharding):
            # The Pallas GEMM decoding in its operand load (kernels/_mxdot_pallas.py; off by
            # default, Policy.fused_mxdot: measured slower than this route's cuBLAS GEMM).
            return mxdot_pallas(lop.elements[0], lop.scales[0], rop.elements[0],
                                rop.scales[0], fa=lop.fmt, fb=rop.fmt)[None]
        av, af = operand(lop)
        bv, bf = operand(rop)
        return apply_tensor_scales(_contract(av, la, bv, ra, out_sharding), af, bf)

    return bf16


def _qdot_portable(lhs, rhs, lcast: OperandCast, rcast: OperandCast, layout: tuple,
                   out_sharding, kernels: bool):
    """The portable quantized dot (every backend; CUDA where no GPU route applies): exact
    products of decoded values, bfloat16 when it holds them (a run-time check for block
    formats), float32 otherwise, summed in float32. Where XLA lowers for CPU, E8M0 MX
    operands the native fused kernel serves (``kernels/_dispatch.cpu_mx_fused_values``)
    come from it: their values and, for the run-time check, per-block flags of the same
    condition (:func:`_fused_operand`); the same products and sums, so the same bits."""
    dot = functools.partial(_portable_dot, lcast=lcast, rcast=rcast, layout=layout,
                            out_sharding=out_sharding, kernels=kernels)
    fused = tuple(not isinstance(x, MXArray) and isinstance(c, MXCast)
                  and cpu_mx_fused_values(x, c) for x, c in ((lhs, lcast), (rhs, rcast)))
    if not any(fused):
        return dot(lhs, rhs)
    return on_cpu(functools.partial(dot, fused=fused), dot, lhs, rhs)


def _fused_operand(x, cast: MXCast, ca: int):
    """``(bits, kind, exact)`` of an E8M0 MX operand by the native fused kernel (CPU only):
    the float32 bits of its values (padding dropped), its kind as :func:`_quantize_operand`
    gives it, and (kind ``"dynamic"``) the scalar :func:`mx_bf16_exact` gives for its codes:
    every block's one-multiply decode exact."""
    values, fast = mx_fake_quantize_cpu(x, cast, ca)
    bits = f32_bits(values)
    if not _bf16_capable(cast.fmt):
        return bits, "f32", None
    return bits, "dynamic", jnp.all(fast != 0)


def _portable_dot(lhs, rhs, lcast: OperandCast, rcast: OperandCast, layout: tuple,
                  out_sharding, kernels: bool, fused: tuple = (False, False)):
    la, ra = layout
    ops = []
    for x, c, a, f in ((lhs, lcast, la, fused[0]), (rhs, rcast, ra, fused[1])):
        if f:
            ops.append(_fused_operand(x, c, a))
        else:
            op, kind = _portable_operand(x, c, a)
            ops.append((op, kind, None))
    (lop, lkind, _), (rop, rkind, _) = ops
    if "f32" in (lkind, rkind):
        return _dot_f32(layout, lop, rop, out_sharding=out_sharding)
    if lkind == rkind == "bf16":
        return _dot_bf16(layout, lop, rop, out_sharding=out_sharding, kernels=kernels)
    ok = jnp.bool_(True)
    for op, kind, exact in ops:
        if kind == "dynamic":
            ok = ok & (mx_bf16_exact(op) if exact is None else exact)
    # Both branches take the codes, so each decodes inside its own fusion.
    factors = (_factor(lop), _factor(rop))
    return lax.cond(
        ok, functools.partial(_dot_bf16, layout, out_sharding=out_sharding, kernels=kernels),
        functools.partial(_dot_f32, layout, out_sharding=out_sharding), lop, rop, factors,
    )


def _float_values(x):
    """Exact float32 values of a canonical operand (an MXArray is dequantized)."""
    if isinstance(x, MXArray):
        return bits_to_f32(_mx_bits(x))
    return bits_to_f32(input_bits(x))


def _quantized_values(x, cast: OperandCast, ca: int):
    """float32 values of the operand as the forward dot saw them."""
    op, _ = _quantize_operand(x, cast, ca)
    return bits_to_f32(_operand_bits(op))


# -- the one training dot ------------------------------------------------------------------------
#
# Every quantized training dot of lowprec (dot_general, ragged_dot, the recipes, delayed
# scaling, the NVFP4 training recipe) is ``training_dot``: one custom VJP, one options object
# (the DotSpec), and a *layout family* that says how the three products of a linear layer
# (forward, grad_lhs, grad_rhs) are laid out: "dense" (below: canonical (B, M, K) operands),
# "ragged" (_ragged.py: lhs [M, K] grouped over rhs [G, K, N]), "nvfp4" (_nvfp4_train.py: a
# linear layer's [T, K] x 2-D weight with 16 x 16 tiles and the Hadamard transform) and
# "delayed" (_delayed.py: FP8 codes under scales from an amax history). A family is a pair of
# functions, registered by its module (this module imports none of them):
#
#   forward(lhs, rhs, aux, spec, layout) -> (out, residuals)
#   backward(spec, layout, residuals, g) -> (grad_lhs, grad_rhs, grad_aux)
#
# ``aux`` is the dot's third input (None; a ragged dot's group sizes; the NVFP4 recipe's
# stochastic-rounding key; delayed scaling's state, whose "gradient" is the next state);
# ``layout`` a hashable tuple whose first item names the family (the rest is static data of
# the call: contraction axes, output sharding, dimension numbers).

_FAMILIES: dict = {}


def register_family(name: str, forward, backward) -> None:
    """Registers a layout family of :func:`training_dot` (see the comment above)."""
    _FAMILIES[name] = (forward, backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def training_dot(lhs, rhs, aux, spec: DotSpec, layout: tuple):
    """The quantized training dot of ``spec`` in the layout family ``layout[0]``: its
    forward product, and (as its VJP) its two backward products."""
    return _FAMILIES[layout[0]][0](lhs, rhs, aux, spec, layout)[0]


def _training_fwd(lhs, rhs, aux, spec: DotSpec, layout: tuple):
    return _FAMILIES[layout[0]][0](lhs, rhs, aux, spec, layout)


def _training_bwd(spec: DotSpec, layout: tuple, residuals, g):
    return _FAMILIES[layout[0]][1](spec, layout, residuals, g)


training_dot.defvjp(_training_fwd, _training_bwd)


# -- the dense family: canonical (B, M, K) / (B, K, M) operands -----------------------------------


def _dense_product(lhs, rhs, spec: DotSpec, layout: tuple, out_sharding):
    """The forward product of canonical operands contracted over ``layout = (la, ra)``:
    (B, M, N) float32."""
    def generic(a, b):
        return _qdot_canonical(a, b, spec.lhs, spec.rhs, layout, out_sharding, spec.kernels)

    # Decode-time MXFP4 weight x bfloat16 tokens: a kernel on CUDA GPUs (_gemv.py). It takes
    # (B, M, K) x (B, N, K) operands; one in the (B, K, ·) layout is transposed for it, in
    # the CUDA branch only (decided from shapes, so other backends see no transpose).
    la, ra = layout
    route = decode_time_route(_k_last_view(lhs, la), _k_last_view(rhs, ra), spec.lhs, spec.rhs,
                              spec.kernels)
    if route is None:
        return generic(lhs, rhs)
    return on_cuda(lambda a, b: route(_k_last(a, la), _k_last(b, ra)), generic, lhs, rhs)


def _pow2(e):
    """2^e as float32 for int32 e in [-126, 127], built from its bits (exact)."""
    return lax.bitcast_convert_type(lax.shift_left(e + 127, 23), jnp.float32)


def _tensor_exponent(x, cast: OperandCast):
    """Per-tensor scale exponent e (int32 scalar, in [-126, 127]) of ``tensor_scaling``: the
    MX ``rceil`` rule applied to the whole tensor, so that amax * 2^-e <= max_elem. 0 for
    operands not rounded to an element format."""
    if not isinstance(cast, ElementCast):
        return jnp.int32(0)
    amax_bits = jnp.max(lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) & 0x7FFF_FFFF)
    e = rceil_code(amax_bits, cast.fmt.max_finite_exact) - E8M0_BIAS
    return jnp.clip(e, -126, 127).astype(jnp.int32)


def _scaled(x, e):
    """x * 2^-e in float32 (exact while the result stays a normal float)."""
    return x.astype(jnp.float32) * _pow2(-e)


def _dense_forward(lhs, rhs, aux, spec: DotSpec, layout: tuple):
    _, lay, out_sharding = layout
    if spec.tensor_scaling:
        # Each operand divided by its power of two, the product multiplied back (exact).
        el, er = _tensor_exponent(lhs, spec.lhs), _tensor_exponent(rhs, spec.rhs)
        out = _dense_product(_scaled(lhs, el), _scaled(rhs, er), spec, lay, out_sharding)
        out = _times_pow2s(out, _pow2(el), _pow2(er)).astype(spec.out_dtype)
    else:
        out = bits_to_dtype(f32_bits(_dense_product(lhs, rhs, spec, lay, out_sharding)),
                            spec.out_dtype)
    # Residuals are the inputs themselves (float or codes); quantized values are recomputed
    # in the backward pass, which costs O(size) next to the O(size * N) dots.
    return out, (lhs, rhs)


def _k_last(op, ca: int):
    """A canonical operand in the (B, free, K) layout (transposed if it is (B, K, free))."""
    if ca == 2:
        return op
    if isinstance(op, MXArray):
        return op.transpose((0, 2, 1))
    return jnp.swapaxes(op, 1, 2)


def _k_last_view(op, ca: int):
    """:func:`_k_last`'s shapes and types only (for routing decisions): moves no data."""
    return op if ca == 2 else jax.eval_shape(lambda o: _k_last(o, ca), op)


def _cotangent(primal, grad):
    if isinstance(primal, MXArray):
        return None  # integer codes: no gradient
    return bits_to_dtype(f32_bits(grad), primal.dtype)


def _gradient_shardings(lhs, rhs):
    """On Explicit mesh axes each gradient is sharded as its operand, as lax.dot_general's
    transpose rule does (the weight gradient of a data-parallel layer sums over sharded
    tokens: reduced here)."""
    return tuple(None if isinstance(x, MXArray) else explicit_sharding(x) for x in (lhs, rhs))


def _ste_grads(spec: DotSpec, layout: tuple, lhs, rhs, g, values=None):
    """float32 (grad_lhs, grad_rhs) of the float dot of the operands' ``values`` (default:
    quantized as the forward quantized them): g [B, M, N] float32. Each gradient comes out
    in its operand's own layout: grad_lhs is (B, M, K) when the lhs is (la == 2), (B, K, M)
    otherwise; likewise for the rhs."""
    la, ra = layout
    fl, fr = _free(la), _free(ra)  # the free axes: M of lhs, N of rhs
    sl, sr = _gradient_shardings(lhs, rhs)
    if values is None:
        ql = _quantized_values(lhs, spec.lhs, la)
        qr = _quantized_values(rhs, spec.rhs, ra)
    else:
        ql, qr = values
    f32 = dict(precision=lax.Precision.HIGHEST)
    # grad_lhs[b,m,k] = sum_n g[b,m,n] rhs[b,n,k]; grad_rhs[b,n,k] = sum_m g[b,m,n] lhs[b,m,k].
    grad_l = (_contract(g, 2, qr, fr, sl, **f32) if la == 2
              else _contract(qr, fr, g, 2, sl, **f32))
    grad_r = (_contract(g, 1, ql, fl, sr, **f32) if ra == 2
              else _contract(ql, fl, g, 1, sr, **f32))
    return grad_l, grad_r


def _quantized_grads(spec: DotSpec, layout: tuple, lhs, rhs, g):
    """float32 (grad_lhs, grad_rhs) of ``backward="quantized"``: the cotangent in the grad
    cast and the operands re-quantized in their backward casts, each blocked along the
    reduction axis of its own backward dot (g [B, M, N] float32)."""
    la, ra = layout
    fl, fr = _free(la), _free(ra)
    sl, sr = _gradient_shardings(lhs, rhs)
    spec.check_backward(g.shape[1], g.shape[2])
    vl, vr = _float_values(lhs), _float_values(rhs)
    bl, br, k = spec.bwd_lhs, spec.bwd_rhs, spec.kernels
    # grad_lhs: g and rhs both blocked along N (g's axis 2, rhs's free axis).
    if la == 2:
        grad_l = _qdot_canonical(g, vr, spec.grad, br, (2, fr), sl, k)
    else:
        grad_l = _qdot_canonical(vr, g, br, spec.grad, (fr, 2), sl, k)
    # grad_rhs: g and lhs both blocked along M (g's axis 1, lhs's free axis).
    if ra == 2:
        grad_r = _qdot_canonical(g, vl, spec.grad, bl, (1, fl), sr, k)
    else:
        grad_r = _qdot_canonical(vl, g, bl, spec.grad, (fl, 1), sr, k)
    return grad_l, grad_r


def _rule_grads(spec: DotSpec, layout: tuple, lhs, rhs, g):
    """The gradients of ``spec.backward`` ("ste" or "quantized"), in the operands' dtypes
    (None for an MXArray): what differentiating the forward product gives, the per-tensor
    scales of ``tensor_scaling`` included (the chain rule through x * 2^-e and the product's
    2^(el + er), written out: every factor a power of two)."""
    if not spec.tensor_scaling:
        g = bits_to_f32(input_bits(g))  # (B, M, N)
        grads = (_ste_grads if spec.backward == "ste" else _quantized_grads)(
            spec, layout, lhs, rhs, g)
        return _cotangent(lhs, grads[0]), _cotangent(rhs, grads[1])
    el, er = _tensor_exponent(lhs, spec.lhs), _tensor_exponent(rhs, spec.rhs)
    ls, rs = _scaled(lhs, el), _scaled(rhs, er)
    g = g.astype(jnp.float32) * _pow2(er) * _pow2(el)
    inner = dataclasses.replace(spec, tensor_scaling=False, out_dtype=np.dtype(np.float32))
    gl, gr = _rule_grads(inner, layout, ls, rs, g)
    return (gl * _pow2(-el)).astype(lhs.dtype), (gr * _pow2(-er)).astype(rhs.dtype)


def _float_grads(layout: tuple, lhs, rhs, g):
    """float32 (grad_lhs, grad_rhs) of the float32 dot (``precision=HIGHEST``) of the
    unquantized operands (the float layer's own VJP; XLA drops the one a caller does not
    use)."""
    return _ste_grads(None, layout, lhs, rhs, g, (_float_values(lhs), _float_values(rhs)))


def _scaled_quantized_grads(spec: DotSpec, layout: tuple, lhs, rhs, g):
    """``backward="quantized"`` with ``tensor_scaling`` or backward casts of their own
    (float32 gradients; g float32): each of lhs, rhs, g is divided by its own power of two
    first (from its backward cast) and the gradients are multiplied back: grad_lhs = g . rhs^T
    = 2^(eg + er) (g_s . rhs_s^T), likewise for rhs."""
    bl, br = spec.bwd_lhs, spec.bwd_rhs
    el, er, eg = (_tensor_exponent(lhs, bl), _tensor_exponent(rhs, br),
                  _tensor_exponent(g, spec.grad))
    if spec.tensor_scaling:
        lhs, rhs, g = _scaled(lhs, el), _scaled(rhs, er), _scaled(g, eg)
    inner = dataclasses.replace(spec, lhs=bl, rhs=br, tensor_scaling=False,
                                out_dtype=np.dtype(np.float32))
    grad_l, grad_r = _rule_grads(inner, layout, lhs, rhs, g)
    if spec.tensor_scaling:
        grad_l = _times_pow2s(grad_l, _pow2(er), _pow2(eg))
        grad_r = _times_pow2s(grad_r, _pow2(el), _pow2(eg))
    return grad_l.astype(jnp.float32), grad_r.astype(jnp.float32)


def _times_pow2s(v, a, b):
    """float32 ``v`` times the powers of two ``a`` and ``b``: one after the other (exact
    while each product stays a normal float), or where XLA lowers for CUDA times their
    product, one scalar, which XLA folds into the FP8 GEMM that made ``v`` (cuBLASLt
    computes D = (scale_a · scale_b) · Σ a b itself). Of two multiplies XLA folded one and
    left the other as a pass over the float32 result: in the backward of a d = 4096
    transformer block, 1.6 of its 8.6 GB of non-GEMM traffic (compile for an H100). The two
    differ only where a · b leaves float32's normal range."""
    v = v.astype(jnp.float32)
    return on_cuda(lambda v, a, b: v * (a * b), lambda v, a, b: v * a * b, v, a, b)


def _own_rule(spec: DotSpec) -> bool:
    """Whether the backward products are not the plain rule of ``spec.backward``: a float32
    gradient (``high_precision_wgrad``/``dgrad``), or quantized backward dots with per-tensor
    scales or backward casts of their own."""
    if spec.high_precision_wgrad or spec.high_precision_dgrad:
        return True
    return spec.backward == "quantized" and (
        spec.tensor_scaling or spec.bwd_lhs != spec.lhs or spec.bwd_rhs != spec.rhs)


def _dense_backward(spec: DotSpec, layout: tuple, residuals, g):
    _, lay, _ = layout
    lhs, rhs = residuals
    if not _own_rule(spec):
        grad_l, grad_r = _rule_grads(spec, lay, lhs, rhs, g)
        return grad_l, grad_r, None
    g = g.astype(jnp.float32)
    if spec.high_precision_wgrad and spec.high_precision_dgrad:
        grad_l, grad_r = _float_grads(lay, lhs, rhs, g)
    elif spec.backward == "ste":  # with high_precision_wgrad
        grad_l, grad_r = _rule_grads(dataclasses.replace(spec, out_dtype=np.dtype(np.float32)),
                                     lay, lhs, rhs, g)
    else:
        grad_l, grad_r = _scaled_quantized_grads(spec, lay, lhs, rhs, g)
    if spec.high_precision_wgrad:
        # The weight gradient as a float32 dot of the unquantized operands (the float
        # layer's own VJP); XLA drops the one computed above.
        _, grad_r = _float_grads(lay, lhs, rhs, g)
    if spec.high_precision_dgrad:
        grad_l, _ = _float_grads(lay, lhs, rhs, g)
    return grad_l.astype(lhs.dtype), grad_r.astype(rhs.dtype), None


register_family("dense", _dense_forward, _dense_backward)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def dot_general_jit(lhs, rhs, dn, spec: DotSpec, out_sharding=None):
    """The quantized dot of validated operands in ``lax.dot_general``'s output layout;
    ``out_sharding`` (a NamedSharding of that layout, or None) is given to the inner dot."""
    (lc, rc), (lb, rb) = dn
    lshape, rshape = shape_of(lhs), shape_of(rhs)
    inner, constraint = split_out_sharding(out_sharding)
    # On Explicit axes the output takes the layout asked for, else the one lax.dot_general
    # gives these operands: the canonical (B, M, N) result is reshaped into it.
    final = inner if inner is not None else dot_out_sharding(_typed(lhs), _typed(rhs), dn)
    lhs, la = _canonicalize(lhs, lc, lb)
    rhs, ra = _canonicalize(rhs, rc, rb)
    _, lfree = _canon_perm(len(lshape), lc, lb)
    _, rfree = _canon_perm(len(rshape), rc, rb)
    # lax.dot_general's layout: batch dims, then lhs free dims, then rhs free dims.
    nb, nl = len(lb), len(lfree)
    groups = [list(range(nb)), list(range(nb, nb + nl)), list(range(nb + nl, nb + nl + len(rfree)))]
    out = training_dot(lhs, rhs, None, spec, ("dense", (la, ra), merged_sharding(inner, groups)))
    out_shape = [lshape[d] for d in lb] + [lshape[d] for d in lfree] + [rshape[d] for d in rfree]
    out = jnp.reshape(out, out_shape, out_sharding=final)
    return out if constraint is None else lax.with_sharding_constraint(out, constraint)


def _typed(x):
    """``x``, or for an MXArray the float array it stands for (shape and sharding only)."""
    if not isinstance(x, MXArray):
        return x
    return jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=explicit_sharding(x.elements))


