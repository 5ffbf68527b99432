"""Quantized matrix products: :func:`dot_general`, :func:`matmul`.

The public entry points validate their arguments once (a :class:`~lowprec._options.DotSpec`
and its ``check_call``) and hand them to the quantized dot of ``_qdot.py`` (forward and
training path) or to the decode-time MXFP4 routes of ``_gemv.py``.
"""

from __future__ import annotations

from typing import Any, Union

import jax
import jax.numpy as jnp

from ._format import FormatLike
from ._mxarray import MXArray
from ._options import DotSpec
from ._qdot import dot_general_jit, shape_of
from ._scale_rules import ScaleRule
from .kernels._dispatch import kernels_enabled

Operand = Union[jax.Array, MXArray]


def dot_general(
    lhs: Operand,
    rhs: Operand,
    dimension_numbers,
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
    out_sharding=None,
    scale_options=None,
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
      scale_rule: MX scale rule (``"floor"``, ``"ceil"``, ``"even"``, ``"rceil"``; None:
        ``"floor"``) for every MX quantization done here, backward included; ``"rceil"``
        matches NVIDIA/JAX. A format whose scales take no rule (NVFP4) ignores it.
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
      scale_options: as for :func:`~lowprec.quantize_mx`, for every MX quantization done
        here (backward included): the options value of the formats' scale scheme, or a dict
        of its fields (E8M0: ``scale_rule``; NVFP4: ``nvfp4_step``); a field the scheme of
        one of those formats does not take is refused, as ``quantize_mx`` refuses it.

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
        preferred_element_type, kernels_enabled(), scale_options=scale_options,
    )
    call = spec.check_call(lhs, rhs, dimension_numbers, out_sharding)
    return dot_general_jit(call.lhs, call.rhs, call.dn, call.spec, call.out_sharding)


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
