"""MX block helpers: the shared exponent each element sees, and the rate of clipped elements.

Everything here takes the array first and the MX format second, as :func:`lowprec.quantize_mx`.
"""

from __future__ import annotations

import functools
from typing import Union

import jax
import jax.numpy as jnp
from jax import lax

from .._bits import E8M0_BIAS, times_pow2
from .._blocks import normalize_axis
from .._format import MXFormat, MXFormatLike, mx_format
from .._mx import dequantize, quantize_mx, shared_exponents
from .._scale_rules import DEFAULT_SCALE_RULE
from ._common import as_f32, scalar


def with_block_size(fmt: MXFormat, block_size) -> MXFormat:
    """``fmt`` with ``block_size`` elements per block, or a clear error while unsupported."""
    if block_size is None or block_size == fmt.block_size:
        return fmt
    try:  # block sizes other than the format's own arrive with mx_format(name, block_size=)
        return mx_format(fmt.name, block_size=int(block_size))
    except TypeError:
        raise ValueError(
            f"block_size={block_size} is not available yet: this lowprec builds {fmt.name!r} "
            f"with blocks of {fmt.block_size} only (other sizes need "
            f"mx_format({fmt.name!r}, block_size=...)); use block_size={fmt.block_size}"
        ) from None


def _per_element(exps, fmt: MXFormat, axis: int, n: int):
    """Per-block shared exponents -> one per element along ``axis``, padding dropped."""
    exps = jnp.repeat(exps, fmt.block_size, axis=axis)
    return lax.slice_in_dim(exps, 0, n, axis=axis)


def roundtrip(x, fmt: MXFormat, axis: int, scale_rule, rounding: str = "nearest_even", key=None):
    """``(fake-quantized x, per-element shared exponent)`` from one ``quantize_mx`` call.

    ``x`` is zero-padded to whole blocks (zeros change no block maximum) and the padding is
    dropped again. Works under ``jit`` and ``vmap``.
    """
    x = as_f32(x)
    mx = quantize_mx(x, fmt, axis=axis, scale_rule=scale_rule, rounding=rounding, pad=True, key=key)
    exps = mx.scales.astype(jnp.int32) - E8M0_BIAS  # 0xFF (a NaN/inf block) gives 128
    return dequantize(mx), _per_element(exps, mx.fmt, mx.axis, x.shape[mx.axis])


def mx_scale_exponents(
    x, fmt: MXFormatLike, *, axis: int = -1, scale_rule=DEFAULT_SCALE_RULE
) -> jax.Array:
    """Per-element shared exponent (scale code − 127) that :func:`lowprec.quantize_mx` picks.

    :func:`lowprec.shared_exponents` (one per block) repeated over each block's elements:
    same shape as ``x``; a block holding NaN/inf (scale code 0xFF) gets 128. The axis is
    zero-padded to a multiple of the block size if needed (zeros do not change a block max).

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.concatenate([jnp.full(32, 1.0), jnp.full(32, 100.0)])
        >>> s = mx_scale_exponents(x, "mxfp8_e4m3")   # floor(log2 amax) - 8
        >>> int(s[0]), int(s[-1])
        (-8, -2)
    """
    fmt = mx_format(fmt)
    x = as_f32(x)
    if x.ndim == 0:
        raise ValueError("mx_scale_exponents needs at least a 1-D array (blocks run along an axis)")
    axis = normalize_axis(axis, x.ndim)
    exps = shared_exponents(x, fmt, axis=axis, scale_rule=scale_rule, pad=True)
    return _per_element(exps, fmt, axis, x.shape[axis])


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _mx_clip(x, fmt, axis, scale_rule):
    s = mx_scale_exponents(x, fmt, axis=axis, scale_rule=scale_rule)
    limit = jnp.where(s > E8M0_BIAS, jnp.inf, times_pow2(jnp.float32(fmt.element.max_finite), s))
    return jnp.mean((jnp.abs(x) > limit).astype(jnp.float32))


def mx_clipping_rate(
    x, fmt: MXFormatLike, *, axis: int = -1, scale_rule=DEFAULT_SCALE_RULE
):
    """Fraction of elements whose magnitude exceeds their block's range ``max_elem·2^scale``.

    Those elements saturate to ± the element maximum. With ``scale_rule="floor"`` a block
    max above 1.75·2^emax_elem (FP8) or 1.5·2^emax_elem (FP4) is clipped; ``ceil`` and
    ``rceil`` never clip.

    Returns:
      A Python float (a 0-d array while traced).

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.concatenate([jnp.full(31, 0.1), jnp.array([7.9]), jnp.full(32, 1.0)])
        >>> mx_clipping_rate(x, "mxfp4")   # 7.9 > 6·2^0: one of 64
        0.015625
        >>> mx_clipping_rate(x, "mxfp4", scale_rule="ceil")
        0.0
    """
    fmt = mx_format(fmt)
    x = as_f32(x)
    if x.ndim == 0:
        raise ValueError("mx_clipping_rate needs at least a 1-D array (blocks run along an axis)")
    return scalar(_mx_clip(x, fmt, normalize_axis(axis, x.ndim), scale_rule))
