"""MX block helpers: the scale each element sees, and the rate of clipped elements.

Everything here takes the array first and the MX format second, as :func:`lowprec.quantize_mx`.
The OCP MX formats (E8M0 scales) give each element a shared exponent; NVFP4 gives it a float32
factor, tensor_scale × block_scale (its block scales are E4M3 values, not powers of two).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._bits import E8M0_BIAS, times_pow2
from .._blocks import normalize_axis
from .._format import MXFormat, MXFormatLike, mx_format
from .._mx import dequantize, quantize_mx, shared_exponents
from .._scale_rules import DEFAULT_SCALE_RULE
from ._common import as_f32, scalar


def _per_element(per_block, fmt: MXFormat, axis: int, n: int):
    """Per-block scales -> one per element along ``axis``, padding dropped."""
    per_block = jnp.repeat(per_block, fmt.block_size, axis=axis)
    return lax.slice_in_dim(per_block, 0, n, axis=axis)


def roundtrip(x, fmt: MXFormat, axis: int, scale_rule, rounding: str = "nearest_even", key=None):
    """``(fake-quantized x, per-element scale)`` from one ``quantize_mx`` call.

    The scale is what the format's scale scheme says each element is scaled by: the shared
    exponent (int32; a NaN/inf block, scale code 0xFF, gives 128) for E8M0-scaled formats,
    the float32 factor tensor_scale × block_scale for NVFP4.
    ``x`` is zero-padded to whole blocks (zeros change no block maximum) and the padding is
    dropped again. Works under ``jit`` and ``vmap``.
    """
    x = as_f32(x)
    mx = quantize_mx(x, fmt, axis=axis, scale_rule=scale_rule, rounding=rounding, pad=True, key=key)
    per_block = mx.fmt.scheme.element_scale(mx.scales, mx.tensor_scale)
    return dequantize(mx), _per_element(per_block, mx.fmt, mx.axis, x.shape[mx.axis])


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
    top = jnp.float32(fmt.element.max_finite)
    if fmt.scheme.exponent_scales:  # the shared exponents alone, without quantizing
        s = mx_scale_exponents(x, fmt, axis=axis, scale_rule=scale_rule)
        limit = jnp.where(s > E8M0_BIAS, jnp.inf, times_pow2(top, s))
    else:
        _, f = roundtrip(x, fmt, axis, None)
        limit = jnp.where(jnp.isnan(f), jnp.inf, top * f)
    return jnp.mean((jnp.abs(x) > limit).astype(jnp.float32))


def mx_clipping_rate(x, fmt: MXFormatLike, *, axis: int = -1, scale_rule=None):
    """Fraction of elements whose magnitude exceeds their block's range ``max_elem·scale``.

    Those elements saturate to ± the element maximum. With ``scale_rule="floor"`` (the
    default, None) a block max above 1.75·2^emax_elem (FP8) or 1.5·2^emax_elem (FP4) is
    clipped; ``ceil`` and ``rceil`` never clip. NVFP4 (no scale rule) clips a block max
    that its E4M3 block scale, rounded to nearest, leaves above 6 × tensor_scale × scale.

    Returns:
      A Python float (a 0-d array while traced).

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.concatenate([jnp.full(31, 0.1), jnp.array([7.9]), jnp.full(32, 1.0)])
        >>> mx_clipping_rate(x, "mxfp4")   # 7.9 > 6·2^0: one of 64
        0.015625
        >>> mx_clipping_rate(x, "mxfp4", scale_rule="ceil")
        0.0
        >>> y = jnp.array([2688.0] + [0.0] * 15 + [6.3] + [0.0] * 15)   # tensor scale 1
        >>> mx_clipping_rate(y, "nvfp4")   # block 2: scale e4m3(6.3 / 6) = 1, 6.3 > 6
        0.03125
    """
    fmt = mx_format(fmt)
    x = as_f32(x)
    if x.ndim == 0:
        raise ValueError("mx_clipping_rate needs at least a 1-D array (blocks run along an axis)")
    return scalar(_mx_clip(x, fmt, normalize_axis(axis, x.ndim), scale_rule))
