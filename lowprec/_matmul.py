"""Quantized matrix products: :func:`dot_general`, :func:`matmul`, :func:`mxfp4_gemv`.

The public entry points validate their arguments once (into a :class:`~lowprec._qdot.DotSpec`)
and hand them to the quantized dot of ``_qdot.py`` (forward and training path) or to the
decode-time MXFP4 routes of ``_gemv.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from ._format import FormatLike
from ._gemv import mxfp4_matmul
from ._gemv_pallas import default_config
from ._mxarray import MXArray
from ._options import MXCast
from ._qdot import (
    BACKWARD_MODES,
    INPUT_DTYPES,
    OPERAND_FORMAT_NAMES,
    DotSpec,
    dot_general_jit,
    normalize_dn,
    shape_of,
)
from ._scale_rules import DEFAULT_SCALE_RULE, ScaleRule
from ._sharding import check_dot_operand, out_sharding_arg

Operand = Union[jax.Array, MXArray]


def _check_operand(x, spec: DotSpec, role: str, contract):
    """Validates one operand; returns ``(x, spec)`` with an MXArray's own format filled in."""
    cast = getattr(spec, role)
    if isinstance(x, MXArray):
        fmt = None if cast is None else cast.fmt
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
        return x, spec.with_mx_operand(role, x.fmt)
    x = jnp.asarray(x)
    if np.dtype(x.dtype) not in INPUT_DTYPES:
        raise TypeError(
            f"{role} must be a float32, bfloat16 or float16 array or an MXArray, got dtype "
            f"{x.dtype}; convert it with .astype(jnp.float32)"
        )
    return x, spec


def dot_general(
    lhs: Operand,
    rhs: Operand,
    dimension_numbers,
    *,
    lhs_format: FormatLike = None,
    rhs_format: FormatLike = None,
    scale_rule: Union[str, ScaleRule] = DEFAULT_SCALE_RULE,
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    pad: bool = False,
    preferred_element_type=jnp.float32,
    backward: str = "ste",
    grad_format: FormatLike = None,
    out_sharding=None,
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
      out_sharding: as for :func:`jax.lax.dot_general` (a PartitionSpec on the mesh of
        ``jax.set_mesh``, or a NamedSharding): the output's sharding, given to the inner dot
        (needed on ``Explicit`` mesh axes when both operands shard the contraction). The
        backward dots shard each gradient as its operand, as JAX's own transpose does.

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
    spec = DotSpec.create(
        lhs_format, rhs_format, grad_format, scale_rule, rounding, overflow, pad, backward,
        preferred_element_type,
    )
    lhs_shape = shape_of(lhs) if isinstance(lhs, MXArray) else jnp.shape(lhs)
    rhs_shape = shape_of(rhs) if isinstance(rhs, MXArray) else jnp.shape(rhs)
    dn = normalize_dn(dimension_numbers, tuple(lhs_shape), tuple(rhs_shape))
    (lc, rc), _ = dn
    lhs, spec = _check_operand(lhs, spec, "lhs", lc)
    rhs, spec = _check_operand(rhs, spec, "rhs", rc)
    for role, x, contract in (("lhs", lhs, lc), ("rhs", rhs, rc)):
        cast = getattr(spec, role)  # MX blocks must not straddle shard boundaries
        check_dot_operand(x, None if cast is None else cast.fmt, contract, role)
    k = math.prod(lhs_shape[d] for d in lc)
    for role, x in (("lhs", lhs), ("rhs", rhs)):
        cast = getattr(spec, role)
        needs_blocks = isinstance(cast, MXCast) and not isinstance(x, MXArray)
        if needs_blocks and k % cast.fmt.block_size and not spec.pad:
            raise ValueError(
                f"{role}: contraction length {k} is not a multiple of the MX block size "
                f"{cast.fmt.block_size}; pass pad=True to zero-pad the blocks (zeros add nothing "
                "to the dot), or use a multiple of 32"
            )
    return dot_general_jit(lhs, rhs, dn, spec, out_sharding_arg(out_sharding))


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
    a_shape = shape_of(a) if isinstance(a, MXArray) else jnp.shape(a)
    b_shape = shape_of(b) if isinstance(b, MXArray) else jnp.shape(b)
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


def mxfp4_gemv(
    w: MXArray, x, *, block_rows: Optional[int] = None, interpret: Optional[bool] = None
) -> jax.Array:
    """``x @ W.T`` for an MXFP4 weight W [N, K] and bfloat16 activations x [..., K], as a
    Pallas kernel (the decode-time product: a vector or a few tokens).

    The weight stays packed (4.25 bits per element) all the way into a split-K kernel that
    decodes nibbles and scales in registers; any K works (tiles are masked, nothing is
    padded in memory). On a CUDA GPU, :func:`dot_general` and :func:`matmul` take this
    route by themselves for up to 16 tokens of bfloat16 activations without a format.
    Accuracy is that of :func:`dot_general` (exact products, float32 sums):
    |y − exact| ≤ K·2^-23·Σ|w_i x_i|, plus K·2^-149 for scales near 2^-127.

    Args:
      w: MXFP4 :class:`~lowprec.MXArray` of shape [N, K], blocked along axis 1 (the gpt-oss
        layout: ``quantize_mx(w, "mxfp4", axis=-1)`` or ``from_gpt_oss``).
      x: bfloat16 array of shape [K] (a vector: W x) or [..., K] (tokens).
      block_rows: weight rows per program (a power of two); default: chosen from the shape.
      interpret: run the kernel in the Pallas interpreter. Default: on unless the default
        backend is a GPU (the interpreter is slow; on CPU :func:`dot_general` is faster).

    Returns:
      float32 array [N] for a vector x, else [..., N].

    Example:
        >>> import jax.numpy as jnp
        >>> import lowprec
        >>> w = lowprec.quantize_mx(jnp.ones((4, 64)), "mxfp4")
        >>> mxfp4_gemv(w, jnp.full((64,), 0.5, jnp.bfloat16)).tolist()
        [32.0, 32.0, 32.0, 32.0]
        >>> mxfp4_gemv(w, jnp.ones((2, 64), jnp.bfloat16)).shape
        (2, 4)
    """
    if not isinstance(w, MXArray) or w.fmt.name != "mxfp4" or w.ndim != 2 or w.axis != 1:
        raise ValueError(
            "mxfp4_gemv takes an MXFP4 MXArray of shape [N, K] blocked along axis 1 "
            "(quantize_mx(w, 'mxfp4', axis=-1)); use dot_general for other operands"
        )
    x = jnp.asarray(x)
    n, k = w.shape
    if x.dtype != jnp.bfloat16 or x.ndim == 0 or x.shape[-1] != k:
        raise TypeError(
            f"x must be a bfloat16 array of shape ({k},) or (..., {k}), got "
            f"{x.dtype}{list(x.shape)}"
        )
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    x2 = x.reshape(-1, k)
    cfg = default_config(x2.shape[0], n, k)
    if block_rows is not None:
        try:
            cfg = dataclasses.replace(cfg, block_n=block_rows)
        except ValueError as e:
            raise ValueError(f"block_rows: {e}") from None
    y = mxfp4_matmul(x2, w, "pallas", cfg=cfg, interpret=bool(interpret))
    return y.reshape(*x.shape[:-1], n)
