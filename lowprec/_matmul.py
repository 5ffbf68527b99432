"""Quantized matmul and its training path: :func:`dot_general` and :func:`matmul`.

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

Training: a custom VJP. ``backward="ste"`` differentiates the float dot of the quantized
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
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import lowprec_formats as _data

from ._codec import _decode_bits, _encode_bits, _exactly_representable
from ._format import ElementFormat, MXFormat, element_format, mx_format
from ._mx import (
    DEFAULT_SCALE_RULE,
    MXArray,
    _blocked,
    _check_scale_rule,
    _scale_bits,
    _unblocked,
    quantize_mx,
)
from ._pack import unpack_fp4
from ._rounding import check_overflow, check_rounding

#: Element formats an operand can be rounded to (E8M0 is a scale format, not an operand).
OPERAND_ELEMENT_FORMATS: tuple[str, ...] = tuple(n for n in _data.ELEMENT_FORMATS if n != "e8m0")
#: Every accepted operand format name (``None`` = leave the operand as it is).
OPERAND_FORMAT_NAMES: tuple[str, ...] = tuple(_data.MX_FORMATS) + OPERAND_ELEMENT_FORMATS
#: ``backward=`` choices of :func:`dot_general`.
BACKWARD_MODES: tuple[str, ...] = ("ste", "quantized")
_OUTPUT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
_INPUT_DTYPES = _OUTPUT_DTYPES

FormatLike = Union[None, str, MXFormat, ElementFormat]
Operand = Union[jax.Array, MXArray]
_CANON_DN = (((2,), (2,)), ((0,), (0,)))  # (B, M, K) x (B, N, K) -> (B, M, N)


# -- configuration --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static, hashable description of one quantized dot (the keyword arguments, resolved)."""

    lhs: Optional[Union[MXFormat, ElementFormat]]
    rhs: Optional[Union[MXFormat, ElementFormat]]
    grad: Optional[Union[MXFormat, ElementFormat]]
    scale_rule: str
    rounding: str
    overflow: str
    pad: bool
    backward: str
    out_dtype: np.dtype


def _valid_formats() -> str:
    return "valid formats: None, " + ", ".join(repr(n) for n in OPERAND_FORMAT_NAMES)


def _resolve_format(fmt: FormatLike, role: str):
    """Format name/object → MXFormat, ElementFormat or None; clear errors otherwise."""
    if fmt is None or isinstance(fmt, MXFormat):
        return fmt
    if isinstance(fmt, ElementFormat):
        if fmt.name == "e8m0":
            raise ValueError(
                f"{role}: e8m0 is a scale format, not an operand format; {_valid_formats()}"
            )
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"{role} must be a format name, a format object or None, got {fmt!r}")
    canonical = _data.ALIASES.get(fmt.lower())
    if canonical in _data.MX_FORMATS:
        return mx_format(canonical)
    if canonical in OPERAND_ELEMENT_FORMATS:
        return element_format(canonical)
    if canonical == "e8m0":
        raise ValueError(
            f"{role}: {fmt!r} is a scale format, not an operand format; {_valid_formats()}"
        )
    raise ValueError(f"unknown {role} {fmt!r}; {_valid_formats()}")


def _element_of(fmt):
    return fmt.element if isinstance(fmt, MXFormat) else fmt


# -- dimension numbers and canonical (B, M, K) layout ------------------------------------------


def _shape_of(x) -> tuple:
    return tuple(x.shape)


def _normalize_dn(dimension_numbers, lhs_shape, rhs_shape):
    """Validates ``((lc, rc), (lb, rb))`` against the shapes; returns it as tuples of ints."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(d) for d in dims) for dims in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise ValueError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, "
            f"rhs_batch)) as in lax.dot_general, got {dimension_numbers!r}"
        ) from None
    for side, shape, contract, batch in (("lhs", lhs_shape, lc, lb), ("rhs", rhs_shape, rc, rb)):
        nd = len(shape)
        dims = contract + batch
        if any(not 0 <= d < nd for d in dims):
            raise ValueError(
                f"{side} dimension numbers {dims} out of range for {side} of shape {shape} "
                "(use non-negative axes)"
            )
        if len(set(dims)) != len(dims):
            raise ValueError(
                f"{side} contracting {contract} and batch {batch} dims must be distinct"
            )
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(
            f"lhs and rhs need as many contracting ({len(lc)} vs {len(rc)}) and batch "
            f"({len(lb)} vs {len(rb)}) dimensions"
        )
    for kind, ld, rd in (("contracting", lc, rc), ("batch", lb, rb)):
        for a, b in zip(ld, rd):
            if lhs_shape[a] != rhs_shape[b]:
                raise ValueError(
                    f"mismatched shapes: lhs {kind} axis {a} has length {lhs_shape[a]} but rhs "
                    f"{kind} axis {b} has length {rhs_shape[b]} (lhs {lhs_shape}, rhs {rhs_shape})"
                )
    return (lc, rc), (lb, rb)


def _canon_perm(nd: int, contract, batch):
    free = [d for d in range(nd) if d not in contract and d not in batch]
    return list(batch) + free + list(contract), free


def _canonicalize(x, contract, batch):
    """Transposes/reshapes an operand to (B, M, K) like ``jax.nn.scaled_dot_general`` does.

    Contracting dimensions are flattened in the order given, so MX blocks of a float operand
    run along that flattened axis. An MXArray must have exactly one contracting dimension,
    its block axis (checked before), and keeps its codes: only uint8 arrays are moved.
    """
    shape = _shape_of(x)
    perm, free = _canon_perm(len(shape), contract, batch)
    b = math.prod(shape[d] for d in batch)
    m = math.prod(shape[d] for d in free)
    k = math.prod(shape[d] for d in contract)
    if not isinstance(x, MXArray):
        return jnp.transpose(x, perm).reshape(b, m, k)
    el = jnp.transpose(x.elements, perm)
    sc = jnp.transpose(x.scales, perm)
    el = el.reshape(b, m, el.shape[-1])
    sc = sc.reshape(b, m, sc.shape[-1])
    return MXArray(el, sc, x.fmt, 2, (b, m, k), x.scale_rule)


# -- operand decoding ---------------------------------------------------------------------------


def _mx_bits(mx: MXArray):
    """Exact float32 bit patterns (uint32) of an MXArray's values, padding dropped."""
    codes = unpack_fp4(mx.elements, mx.axis) if mx.fmt.packed else mx.elements
    vb = _blocked(_decode_bits(mx.fmt.element, codes), mx.axis, mx.fmt.block_size)
    sb = jnp.moveaxis(mx.scales, mx.axis, -1)[..., None]
    bits = _unblocked(_scale_bits(vb, sb), mx.axis)
    return lax.slice_in_dim(bits, 0, mx.shape[mx.axis], axis=mx.axis)


def _f32_bits(x):
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _bits_to_f32(bits):
    return lax.bitcast_convert_type(bits, jnp.float32)


def _bits_to_bf16(bits):
    # Truncation: exact because this is only used when the low 16 bits are all zero.
    return lax.bitcast_convert_type(
        lax.shift_right_logical(bits, jnp.uint32(16)).astype(jnp.uint16), jnp.bfloat16
    )


def _mx_bf16_exact(mx: MXArray):
    """Whether bfloat16 holds every value of ``mx`` exactly (a sufficient test, scalar bool).

    A scale code of at least ``1 - log2(min_subnormal)`` (10 for E4M3, 17 for E5M2, 2 for
    E2M1) keeps even the smallest nonzero element at or above 2^-126, in bfloat16's normal
    range, where a ≤ 3-bit significand is exact. Blocks holding only zeros are exact at any
    scale; they matter because an all-zero block carries scale code 0 (2^-127) and would
    otherwise force the float32 path for nothing. One fused pass over the uint8 codes and
    scales decides; blocks with tiny scales and nonzero elements go to float32 even when
    bfloat16 would happen to hold them (rare, and still exact).
    """
    elem = mx.fmt.element
    threshold = 1 - (elem.emin - elem.mantissa_bits)
    mag_mask = 0x77 if mx.fmt.packed else (1 << elem.magnitude_bits) - 1  # drop sign bits
    per_block = mx.fmt.block_size // 2 if mx.fmt.packed else mx.fmt.block_size
    nonzero = _blocked((mx.elements & mag_mask) != 0, mx.axis, per_block).any(axis=-1)
    scales = jnp.moveaxis(mx.scales, mx.axis, -1)
    return jnp.all((scales >= threshold) | ~nonzero)


def _quantize_operand(x, fmt, spec: _Spec, what: str):
    """Quantizes a canonical (B, M, K) float operand along K.

    Returns ``(operand, kind)``: an MXArray with kind ``"dynamic"`` (bfloat16 unless a value
    falls out of its range), or float32 bits (uint32) with kind ``"bf16"``/``"f32"`` (the
    narrowest dtype holding every value exactly, known from the format alone).
    """
    if isinstance(x, MXArray):
        return x, "dynamic"
    if fmt is None:
        return _f32_bits(x), "bf16" if x.dtype == jnp.bfloat16 else "f32"
    if isinstance(fmt, MXFormat):
        k = x.shape[-1]
        if k % fmt.block_size and not spec.pad:
            raise ValueError(
                f"{what}: contraction length {k} is not a multiple of the MX block size "
                f"{fmt.block_size}; pass pad=True to zero-pad the blocks (zeros add nothing to "
                "the dot), or use a multiple of 32"
            )
        mx = quantize_mx(
            x, fmt, axis=-1, scale_rule=spec.scale_rule, rounding=spec.rounding, pad=spec.pad
        )
        return mx, "dynamic"
    codes = _encode_bits(fmt, x.astype(jnp.float32), spec.rounding, spec.overflow, None)
    bits = _decode_bits(fmt, codes)
    return bits, "bf16" if _exactly_representable(fmt, jnp.bfloat16) else "f32"


def _operand_bits(op):
    return _mx_bits(op) if isinstance(op, MXArray) else op


def _dot(a, b, **kwargs):
    """(B, M, K) x (B, N, K) -> (B, M, N) float32; a plain 2-D dot when B == 1 (XLA:CPU runs
    2-D dots through a faster kernel than batched ones)."""
    if a.shape[0] == 1:
        dn = (((1,), (1,)), ((), ()))
        return lax.dot_general(a[0], b[0], dn, preferred_element_type=jnp.float32, **kwargs)[None]
    return lax.dot_general(a, b, _CANON_DN, preferred_element_type=jnp.float32, **kwargs)


def _dot_bf16(lop, rop):
    return _dot(_bits_to_bf16(_operand_bits(lop)), _bits_to_bf16(_operand_bits(rop)))


def _dot_f32(lop, rop):
    a, b = _bits_to_f32(_operand_bits(lop)), _bits_to_f32(_operand_bits(rop))
    return _dot(a, b, precision=lax.Precision.HIGHEST)


def _qdot_canonical(lhs, rhs, lfmt, rfmt, spec: _Spec, what: str):
    """Quantized (B, M, K) x (B, N, K) -> (B, M, N) float32, no autodiff rule of its own."""
    lop, lkind = _quantize_operand(lhs, lfmt, spec, f"{what} lhs")
    rop, rkind = _quantize_operand(rhs, rfmt, spec, f"{what} rhs")
    if "f32" in (lkind, rkind):
        return _dot_f32(lop, rop)
    if lkind == rkind == "bf16":
        return _dot_bf16(lop, rop)
    ok = jnp.bool_(True)
    for op, kind in ((lop, lkind), (rop, rkind)):
        if kind == "dynamic":
            ok = ok & _mx_bf16_exact(op)
    # Both branches take the codes, so each decodes inside its own fusion.
    return lax.cond(ok, _dot_bf16, _dot_f32, lop, rop)


def _float_values(x):
    """Exact float32 values of a canonical operand (an MXArray is dequantized)."""
    if isinstance(x, MXArray):
        return _bits_to_f32(_mx_bits(x))
    return x.astype(jnp.float32)


def _quantized_values(x, fmt, spec: _Spec):
    """float32 values of the operand as the forward dot saw them."""
    op, _ = _quantize_operand(x, fmt, spec, "forward")
    return _bits_to_f32(_operand_bits(op))


def _swap(x):
    return jnp.swapaxes(x, 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _qdot(lhs, rhs, spec: _Spec):
    out = _qdot_canonical(lhs, rhs, spec.lhs, spec.rhs, spec, "forward")
    return out.astype(spec.out_dtype)


def _qdot_fwd(lhs, rhs, spec: _Spec):
    # Residuals are the inputs themselves (float or codes); quantized values are recomputed
    # in the backward pass, which costs O(size) next to the O(size * N) dots.
    return _qdot(lhs, rhs, spec), (lhs, rhs)


def _cotangent(primal, grad):
    if isinstance(primal, MXArray):
        return None  # integer codes: no gradient
    return grad.astype(primal.dtype)


def _qdot_bwd(spec: _Spec, residuals, g):
    lhs, rhs = residuals
    g = g.astype(jnp.float32)  # (B, M, N)
    if spec.backward == "ste":
        ql = _quantized_values(lhs, spec.lhs, spec)  # (B, M, K)
        qr = _quantized_values(rhs, spec.rhs, spec)  # (B, N, K)
        f32 = dict(precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        grad_l = lax.dot_general(g, qr, (((2,), (1,)), ((0,), (0,))), **f32)
        grad_r = lax.dot_general(g, ql, (((1,), (1,)), ((0,), (0,))), **f32)
    else:
        fl, fr = _float_values(lhs), _float_values(rhs)
        # grad_lhs[b,m,k] = sum_n g[b,m,n] rhs[b,n,k]: g and rhs both blocked along N.
        what = "backward grad_lhs (reduces over rhs's free dims)"
        grad_l = _qdot_canonical(g, _swap(fr), spec.grad, spec.rhs, spec, what)
        # grad_rhs[b,n,k] = sum_m g[b,m,n] lhs[b,m,k]: g and lhs both blocked along M.
        what = "backward grad_rhs (reduces over lhs's free dims)"
        grad_r = _qdot_canonical(_swap(g), _swap(fl), spec.grad, spec.lhs, spec, what)
    return _cotangent(lhs, grad_l), _cotangent(rhs, grad_r)


_qdot.defvjp(_qdot_fwd, _qdot_bwd)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _dot_general_jit(lhs, rhs, dn, spec: _Spec):
    (lc, rc), (lb, rb) = dn
    lshape, rshape = _shape_of(lhs), _shape_of(rhs)
    out = _qdot(_canonicalize(lhs, lc, lb), _canonicalize(rhs, rc, rb), spec)
    _, lfree = _canon_perm(len(lshape), lc, lb)
    _, rfree = _canon_perm(len(rshape), rc, rb)
    # lax.dot_general's layout: batch dims, then lhs free dims, then rhs free dims.
    out_shape = [lshape[d] for d in lb] + [lshape[d] for d in lfree] + [rshape[d] for d in rfree]
    return out.reshape(out_shape)


# -- public API -------------------------------------------------------------------------------


def _check_operand(x, fmt, role: str, contract):
    """Validates one operand; returns ``(x, fmt)`` with an MXArray's own format filled in."""
    if isinstance(x, MXArray):
        if fmt is not None and fmt != x.fmt:
            raise ValueError(
                f"{role} is an MXArray in {x.fmt.name!r} but {role}_format={fmt.name!r} was "
                f"given; pass {role}_format=None (or {x.fmt.name!r}) for a pre-quantized operand"
            )
        if len(contract) != 1:
            raise ValueError(
                f"{role} is an MXArray and must contract over exactly one axis (its block axis "
                f"{x.axis}), got contracting dims {contract}"
            )
        if contract[0] != x.axis:
            raise ValueError(
                f"{role} is an MXArray blocked along axis {x.axis}, which is not its contracting "
                f"axis {contract[0]}: MX blocks must run along the contraction. Quantize it with "
                f"quantize_mx(..., axis={contract[0]})"
            )
        return x, x.fmt
    x = jnp.asarray(x)
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(
            f"{role} must be a float32, bfloat16 or float16 array or an MXArray, got dtype "
            f"{x.dtype}; convert it with .astype(jnp.float32)"
        )
    return x, fmt


def dot_general(
    lhs: Operand,
    rhs: Operand,
    dimension_numbers,
    *,
    lhs_format: FormatLike = None,
    rhs_format: FormatLike = None,
    scale_rule: str = DEFAULT_SCALE_RULE,
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    pad: bool = False,
    preferred_element_type=jnp.float32,
    backward: str = "ste",
    grad_format: FormatLike = None,
) -> jax.Array:
    """Quantized ``lax.dot_general``: exact products of quantized operands, float32 sums.

    Args:
      lhs, rhs: float32/bfloat16/float16 arrays (quantized here according to
        ``lhs_format``/``rhs_format``), or :class:`~lowprec.MXArray` operands already
        blocked along their (single) contracting axis.
      dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``
        as in :func:`jax.lax.dot_general`; the output has the same layout (batch dims,
        then lhs free dims, then rhs free dims).
      lhs_format, rhs_format: ``None`` (use the values as they are), an MX format
        (``"mxfp8_e4m3"``/``"mxfp8"``, ``"mxfp8_e5m2"``, ``"mxfp4"``: blocks of 32 along the
        contraction; several contracting dims are flattened in the order given first, as
        ``jax.nn.scaled_dot_general`` does) or an element format (``"e4m3"``, ``"e5m2"``,
        ``"e2m1"``, ``"bf16"``, ``"fp16"``, ``"tf32"``: each value rounded on its own, with
        no scaling). For an MXArray operand leave it ``None`` (its own format is used).
      scale_rule: MX scale rule (``"floor"``, ``"ceil"``, ``"even"``, ``"rceil"``) for every
        MX quantization done here, backward included; ``"rceil"`` matches NVIDIA/JAX.
      rounding: element rounding for quantizations done here (deterministic modes only;
        for stochastic rounding quantize with :func:`~lowprec.quantize_mx` and a key first).
      overflow: overflow policy of element-format operands (``"ieee"`` or ``"saturate"``;
        see :func:`~lowprec.encode`); MX elements always saturate.
      pad: zero-pad a contraction whose length is not a multiple of 32 (MX formats)
        instead of raising; zeros add nothing to the sums. Applies to the backward dots too.
      preferred_element_type: output dtype: float32 (default), bfloat16 or float16. The
        accumulation is float32 in every case; narrower outputs are rounded once at the end.
      backward: gradient rule. ``"ste"`` (default): the exact float32 gradient of the dot
        of the quantized values, straight through the quantizers. ``"quantized"``: both
        backward dots are quantized dots, the cotangent in ``grad_format`` and the
        operands re-quantized in their forward formats, all blocked along the backward
        reduction axes (grad_lhs reduces over rhs's free dims, e.g. output features;
        grad_rhs over lhs's free dims, e.g. tokens), as in MX training recipes.
      grad_format: format of the cotangent when ``backward="quantized"`` (``None`` keeps it
        in float32); e.g. ``"mxfp8_e4m3"`` or ``"mxfp8_e5m2"``.

    Returns:
      The dot product, shaped as :func:`jax.lax.dot_general`'s, in
      ``preferred_element_type``. MXArray operands get no gradient (they are codes).

    Raises:
      ValueError: unknown format/rule/mode names (the message lists the valid ones),
        malformed or mismatched dimension numbers, an MXArray blocked along a
        non-contracting axis, an MX contraction length not a multiple of 32 without ``pad``.
      TypeError: non-float operands or an unsupported output dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.ones((2, 64))
        >>> w = jnp.full((64, 3), 0.1)
        >>> y = dot_general(x, w, (((1,), (0,)), ((), ())),
        ...                 lhs_format="mxfp8_e4m3", rhs_format="mxfp4")
        >>> y.tolist()  # MXFP4 holds 0.1 as 6 * 2^-6 = 0.09375
        [[6.0, 6.0, 6.0], [6.0, 6.0, 6.0]]
    """
    lfmt = _resolve_format(lhs_format, "lhs_format")
    rfmt = _resolve_format(rhs_format, "rhs_format")
    gfmt = _resolve_format(grad_format, "grad_format")
    scale_rule = _check_scale_rule(scale_rule)
    overflow = check_overflow(overflow)
    if rounding == "stochastic":
        raise ValueError(
            "dot_general rounds deterministically; for stochastic rounding quantize the "
            "operand with quantize_mx(x, fmt, rounding='stochastic', key=...) and pass the MXArray"
        )
    for fmt in (lfmt, rfmt, gfmt):
        if fmt is not None:
            rounding = check_rounding(_element_of(fmt), rounding)
    if rounding not in _data.ROUNDING_MODES:
        raise ValueError(f"unknown rounding mode {rounding!r}; valid modes: {_data.ROUNDING_MODES}")
    if backward not in BACKWARD_MODES:
        raise ValueError(f"unknown backward mode {backward!r}; valid modes: {BACKWARD_MODES}")
    if grad_format is not None and backward != "quantized":
        raise ValueError("grad_format is only used with backward='quantized'")
    out_dtype = np.dtype(preferred_element_type)
    if out_dtype not in _OUTPUT_DTYPES:
        raise TypeError(
            f"preferred_element_type must be float32, bfloat16 or float16, got {out_dtype}"
        )
    lhs_shape = _shape_of(lhs) if isinstance(lhs, MXArray) else jnp.shape(lhs)
    rhs_shape = _shape_of(rhs) if isinstance(rhs, MXArray) else jnp.shape(rhs)
    dn = _normalize_dn(dimension_numbers, tuple(lhs_shape), tuple(rhs_shape))
    (lc, rc), _ = dn
    lhs, lfmt = _check_operand(lhs, lfmt, "lhs", lc)
    rhs, rfmt = _check_operand(rhs, rfmt, "rhs", rc)
    k = math.prod(lhs_shape[d] for d in lc)
    for role, fmt, x in (("lhs", lfmt, lhs), ("rhs", rfmt, rhs)):
        needs_blocks = isinstance(fmt, MXFormat) and not isinstance(x, MXArray)
        if needs_blocks and k % fmt.block_size and not pad:
            raise ValueError(
                f"{role}: contraction length {k} is not a multiple of the MX block size "
                f"{fmt.block_size}; pass pad=True to zero-pad the blocks (zeros add nothing "
                "to the dot), or use a multiple of 32"
            )
    spec = _Spec(lfmt, rfmt, gfmt, scale_rule, rounding, overflow, bool(pad), backward, out_dtype)
    return _dot_general_jit(lhs, rhs, dn, spec)


def matmul(a: Operand, b: Operand, **kwargs: Any) -> jax.Array:
    """Quantized ``a @ b``: a thin front end to :func:`dot_general`.

    Shapes: ``a`` [..., K] with ``b`` [K, N] (or [K]) — the linear-layer case, any
    number of leading (token) dims — or ``a`` [B..., M, K] with ``b`` [B..., K, N] with
    identical batch dims (no broadcasting). For an MX-quantized ``b`` of shape [K, N],
    blocks run along axis 0 (``quantize_mx(w, fmt, axis=0)``).

    Args:
      a, b: operands as for :func:`dot_general`.
      **kwargs: keyword arguments of :func:`dot_general` (``lhs_format``, ``rhs_format``,
        ``scale_rule``, ``backward``, ``grad_format``, ...).

    Example:
        >>> import jax.numpy as jnp
        >>> x = (jnp.arange(64.0) % 8).reshape(1, 64)  # 0..7: exact in MXFP8
        >>> w = jnp.ones((64, 2))
        >>> matmul(x, w, lhs_format="mxfp8_e4m3", rhs_format="mxfp8_e4m3").tolist()
        [[224.0, 224.0]]
    """
    a_shape = _shape_of(a) if isinstance(a, MXArray) else jnp.shape(a)
    b_shape = _shape_of(b) if isinstance(b, MXArray) else jnp.shape(b)
    na, nb = len(a_shape), len(b_shape)
    if na >= 1 and nb in (1, 2):
        dn = (((na - 1,), (0,)), ((), ()))
    elif na == nb >= 3:
        batch = tuple(range(na - 2))
        dn = (((na - 1,), (nb - 2,)), (batch, batch))
    else:
        raise ValueError(
            f"matmul takes a [..., K] @ b [K, N] or equal-rank batched [B..., M, K] @ "
            f"[B..., K, N]; got shapes {tuple(a_shape)} and {tuple(b_shape)}. Use dot_general "
            "for other layouts"
        )
    return dot_general(a, b, dn, **kwargs)


# -- Pallas kernel: MXFP4 weight x bfloat16 activation GEMV ----------------------------------


def _fp4_values(c):
    """E2M1 codes (int32 0..15) -> float32 values, with float arithmetic only (no tables,
    no bitcasts, so it lowers anywhere): e = 0 is the subnormal 0.5*m, else (1 + m/2) 2^(e-1)."""
    e = (c >> 1) & 3
    m = (c & 1).astype(jnp.float32)
    pow2 = jnp.where(e == 1, 1.0, jnp.where(e == 2, 2.0, 4.0)).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)
    return jnp.where(c >= 8, -mag, mag)


def _e8m0_values(s):
    """E8M0 codes (int32 0..255) -> float32 2^(s - 127); 0 -> 2^-127, 255 -> NaN."""
    normal = lax.bitcast_convert_type(s << 23, jnp.float32)
    tiny = jnp.float32(2.0**-127)
    return jnp.where(s == 0, tiny, jnp.where(s == 255, jnp.float32(jnp.nan), normal))


def _mxfp4_gemv_kernel(w_ref, s_ref, xe_ref, xo_ref, o_ref):
    # w_ref: (bn, G, 16) packed bytes; byte j of block g holds elements 32g+2j (low nibble)
    # and 32g+2j+1 (high nibble), which meet x's even/odd halves xe/xo: (G, 16) float32.
    p = w_ref[...].astype(jnp.int32)
    lo, hi = _fp4_values(p & 0xF), _fp4_values(p >> 4)
    # Products of an FP4 value (2 significant bits) and a bfloat16 value (8) are exact in
    # float32; the per-block partial sums are float32 sums, then scaled by 2^(s-127) (exact).
    partial = jnp.sum(lo * xe_ref[...][None] + hi * xo_ref[...][None], axis=-1)  # (bn, G)
    scales = _e8m0_values(s_ref[...].astype(jnp.int32))
    o_ref[...] = jnp.sum(partial * scales, axis=-1)


def mxfp4_gemv(
    w: MXArray, x, *, block_rows: int = 8, interpret: Optional[bool] = None
) -> jax.Array:
    """y = W x for an MXFP4 weight W [N, K] and a bfloat16 vector x [K], as a Pallas kernel.

    The weight stays packed (4.25 bits per element) all the way into the kernel, which
    decodes nibbles and scales in registers: the memory-bound decode-time matvec of MXFP4
    checkpoints (gpt-oss layout: blocks along the last axis). Each program handles
    ``block_rows`` rows. Accuracy is that of :func:`dot_general` (exact products, float32
    sums): |y − exact| ≤ K·2^-23·Σ|w_i x_i|.

    Args:
      w: MXFP4 :class:`~lowprec.MXArray` of shape [N, K], blocked along axis 1.
      x: bfloat16 array of shape [K].
      block_rows: rows per program (a power of two for GPU backends).
      interpret: run the kernel in the Pallas interpreter. Default: on unless the default
        backend is a GPU. (Only interpret mode has been run: on CPU in the tests; the GPU
        lowering follows Triton's rules — power-of-two block shapes, so K/32 must be a
        power of two there — but is untested.)

    Returns:
      float32 array [N].

    Example:
        >>> import jax.numpy as jnp
        >>> import lowprec
        >>> w = lowprec.quantize_mx(jnp.ones((4, 64)), "mxfp4")
        >>> mxfp4_gemv(w, jnp.full((64,), 0.5, jnp.bfloat16)).tolist()
        [32.0, 32.0, 32.0, 32.0]
    """
    from jax.experimental import pallas as pl

    if not isinstance(w, MXArray) or w.fmt.name != "mxfp4" or w.ndim != 2 or w.axis != 1:
        raise ValueError(
            "mxfp4_gemv takes an MXFP4 MXArray of shape [N, K] blocked along axis 1 "
            "(quantize_mx(w, 'mxfp4', axis=-1)); use dot_general for other operands"
        )
    x = jnp.asarray(x)
    n, k = w.shape
    if x.dtype != jnp.bfloat16 or x.shape != (k,):
        raise TypeError(
            f"x must be a bfloat16 vector of shape ({k},), got {x.dtype}{list(x.shape)}"
        )
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    groups = w.scales.shape[1]
    kp = groups * 32
    xf = jnp.pad(x.astype(jnp.float32), (0, kp - k))  # exact; padded elements are code 0
    xe, xo = xf[0::2].reshape(groups, 16), xf[1::2].reshape(groups, 16)
    rows = -(-n // block_rows) * block_rows
    w3 = jnp.pad(w.elements, ((0, rows - n), (0, 0))).reshape(rows, groups, 16)
    sc = jnp.pad(w.scales, ((0, rows - n), (0, 0)))
    y = pl.pallas_call(
        _mxfp4_gemv_kernel,
        out_shape=jax.ShapeDtypeStruct((rows,), jnp.float32),
        grid=(rows // block_rows,),
        in_specs=[
            pl.BlockSpec((block_rows, groups, 16), lambda i: (i, 0, 0)),
            pl.BlockSpec((block_rows, groups), lambda i: (i, 0)),
            pl.BlockSpec((groups, 16), lambda i: (0, 0)),
            pl.BlockSpec((groups, 16), lambda i: (0, 0)),
        ],
        out_specs=pl.BlockSpec((block_rows,), lambda i: (i,)),
        interpret=interpret,
    )(w3, sc, xe, xo)
    return y[:n]


__all__ = ["BACKWARD_MODES", "OPERAND_FORMAT_NAMES", "dot_general", "matmul", "mxfp4_gemv"]
