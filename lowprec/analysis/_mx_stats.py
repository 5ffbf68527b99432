"""MX block helpers: the shared exponent each element sees, and the rate of clipped elements.

Everything here takes the array first and the MX format second, as :func:`lowprec.quantize_mx`.
"""

from __future__ import annotations

import functools
from typing import Union

import jax
import jax.numpy as jnp
from jax import lax

from .._format import MXFormat, mx_format
from .._mx import DEFAULT_SCALE_RULE, dequantize, quantize_mx
from ._common import _E8M0_BIAS, as_f32, scalar, times_pow2

MXFormatLike = Union[str, MXFormat]


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


def _expand(scales, fmt: MXFormat, axis: int, n: int):
    """Per-block scale codes -> per-element shared exponents (0xFF -> 128), unpadded."""
    exps = scales.astype(jnp.int32) - _E8M0_BIAS
    exps = jnp.repeat(exps, fmt.block_size, axis=axis)
    return lax.slice_in_dim(exps, 0, n, axis=axis)


def roundtrip(x, fmt: MXFormat, axis: int, scale_rule: str, rounding: str = "nearest_even", key=None):
    """``(fake-quantized x, per-element shared exponent)`` from one ``quantize_mx`` call.

    ``x`` is zero-padded to whole blocks (zeros change no block maximum) and the padding is
    dropped again. Works under ``jit`` and ``vmap``.
    """
    x = as_f32(x)
    mx = quantize_mx(x, fmt, axis=axis, scale_rule=scale_rule, rounding=rounding, pad=True, key=key)
    return dequantize(mx), _expand(mx.scales, mx.fmt, mx.axis, x.shape[mx.axis])


def mx_scale_exponents(
    x, fmt: MXFormatLike, *, axis: int = -1, scale_rule: str = DEFAULT_SCALE_RULE
) -> jax.Array:
    """Per-element shared exponent (scale code − 127) that :func:`lowprec.quantize_mx` picks.

    Same shape as ``x``; a block holding NaN/inf (scale code 0xFF) gets 128. The axis is
    zero-padded to a multiple of the block size if needed (zeros do not change a block max).

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.concatenate([jnp.full(32, 1.0), jnp.full(32, 100.0)])
        >>> s = mx_scale_exponents(x, "mxfp8_e4m3")   # floor(log2 amax) - 8
        >>> int(s[0]), int(s[-1])
        (-8, -2)
    """
    fmt = mx_format(fmt)
    return roundtrip(x, fmt, axis, scale_rule)[1]


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _mx_clip(x, fmt, axis, scale_rule):
    s = roundtrip(x, fmt, axis, scale_rule)[1]
    limit = jnp.where(s > _E8M0_BIAS, jnp.inf, times_pow2(jnp.float32(fmt.element.max_finite), s))
    return jnp.mean((jnp.abs(x) > limit).astype(jnp.float32))


def mx_clipping_rate(
    x, fmt: MXFormatLike, *, axis: int = -1, scale_rule: str = DEFAULT_SCALE_RULE
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
    axis = axis % x.ndim
    return scalar(_mx_clip(x, fmt, axis, scale_rule))
