"""ULPs: the spacing of a format's grid at each value, and errors measured in that unit.

For a block format the grid is the element format's, scaled by each block's scale (the
"right grid" for MX: a value's ULP depends on its block, not only on itself): 2^shared_exp
for E8M0-scaled formats, the float32 factor tensor_scale × block_scale for NVFP4.

A per-element *scale* below is None (the format's own grid), an int32 exponent array (an
exact power-of-two scale) or a float32 factor array (NVFP4; NaN for a NaN block).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._bits import E8M0_BIAS, times_pow2
from .._bits import pow2_f32 as pow2
from .._format import ElementFormat, MXFormat, resolve_format
from ._common import array_first, as_f32, floor_log2
from ._mx_stats import roundtrip


def ulp_exponent(fmt: ElementFormat, x, scale_exp=None):
    """Exponent n of the spacing 2^n of ``fmt``'s grid (scaled by 2^scale_exp) at |x|.

    The binade of x is clamped to [emin, top]: below emin the subnormal spacing, above the
    top finite binade its spacing. For a format whose values are all "subnormal" (the MX
    INT8 element k/64, P3109 with P = K: emax < emin) the one spacing is 2^(emin − M).
    """
    e = floor_log2(x)
    s = 0 if scale_exp is None else jnp.asarray(scale_exp, jnp.int32)
    return jnp.clip(e - s, fmt.emin, max(fmt.emax, fmt.emin)) - fmt.mantissa_bits + s


def is_factor(scale) -> bool:
    """Whether a per-element scale is a float32 factor (NVFP4) rather than an exponent."""
    return scale is not None and jnp.issubdtype(scale.dtype, jnp.floating)


def scaled_ulp(fmt: ElementFormat, x, scale):
    """Spacing of ``fmt``'s grid scaled by ``scale`` (None, exponents or factors) at |x|.

    With a factor f the spacing is f · 2^n, n the exponent at x / f; that quotient is a
    float32 division, so an |x| within a float32 rounding of f·2^k may be given either
    neighbouring binade's spacing (the error of such an x is ≈ 0 in either unit).
    """
    if not is_factor(scale):
        return pow2(ulp_exponent(fmt, x, scale))
    return jnp.where(jnp.isnan(scale), jnp.nan, scale * pow2(ulp_exponent(fmt, x / scale)))


def error_in_ulps(fmt: ElementFormat, x, q, scale):
    """``|q − x|`` over the scaled spacing at x: an exact exponent shift unless ``scale``
    is a float32 factor (then a division)."""
    if not is_factor(scale):
        return times_pow2(jnp.abs(q - x), -ulp_exponent(fmt, x, scale))
    return jnp.abs(q - x) / scaled_ulp(fmt, x, scale)


def grid_max(fmt: ElementFormat, scale):
    """The largest finite magnitude of ``fmt``'s grid scaled by ``scale`` (inf for a NaN/inf
    block: nothing in it counts as clipped)."""
    top = jnp.float32(fmt.max_finite)
    if scale is None:
        return top
    if is_factor(scale):  # rounded to float32: only |x| within one rounding of it can differ
        return jnp.where(jnp.isnan(scale), jnp.inf, top * scale)
    return jnp.where(scale > E8M0_BIAS, jnp.inf, times_pow2(top, scale))


def grid(x, fmt, scale_exp, axis: int, scale_rule):
    """(element format, per-element scale: None, exponents or NVFP4 factors) for ``fmt``."""
    fmt = resolve_format(fmt)
    if isinstance(fmt, MXFormat):
        if scale_exp is not None:
            raise ValueError(
                "scale_exp is computed from the blocks for an MX format; pass it only with "
                f"an element format (e.g. {fmt.element.name!r})"
            )
        return fmt.element, roundtrip(x, fmt, axis, scale_rule)[1]
    if scale_exp is not None:
        scale_exp = jnp.asarray(scale_exp, jnp.int32)
    return fmt, scale_exp


@functools.partial(jax.jit, static_argnums=1)
def _ulp_jit(x, fmt, scale):
    return scaled_ulp(fmt, as_f32(x), scale)


def ulp(*args, scale_exp=None, axis: int = -1, scale_rule=None) -> jax.Array:
    """``ulp(x, fmt)``: the spacing of ``fmt``'s values around ``|x|`` (float32, exact powers of two).

    The spacing in the binade [2^e, 2^(e+1)) of x is 2^(e − mantissa_bits), with e clamped
    to [emin, emax]: values below the normal range get the subnormal spacing, values above
    the largest finite one the spacing of the top binade. For an MX format, the element
    grid scaled by the shared exponent of x's block; for NVFP4 by the block's float32
    factor tensor_scale × block_scale (then not a power of two). The MX INT8 element
    (k/64) has one spacing, 2^-6.

    Args:
      x: float array (rounded to float32 first).
      fmt: element or MX format, or its name.
      scale_exp: element formats only: an int array broadcastable to x, the grid of ``fmt``
        scaled by 2^scale_exp (e.g. :func:`mx_scale_exponents`).
      axis, scale_rule: MX formats only: the block axis and the rule choosing the scales
        (None: ``"floor"``; NVFP4 takes none).

    Returns:
      float32 array shaped like ``x``; spacings beyond float32's range are inf (or 0).

    Example:
        >>> import jax.numpy as jnp
        >>> ulp(jnp.array([1.0, 1.9, 300.0, 1000.0, 0.001]), "e4m3").tolist()
        [0.125, 0.125, 32.0, 32.0, 0.001953125]
        >>> x = jnp.concatenate([jnp.array([6.0, 1.0]), jnp.zeros(30)])
        >>> ulp(x, "mxfp4")[:2].tolist()   # block scale 2^0: FP4's own grid
        [2.0, 0.5]
        >>> ulp(jnp.array([0.01, 1.9]), "ocp_int8").tolist()   # MXINT8's element: k/64
        [0.015625, 0.015625]
    """
    x, fmt = array_first("ulp", *args)
    x = as_f32(x)
    elem, s = grid(x, fmt, scale_exp, axis, scale_rule)
    return _ulp_jit(x, elem, s)


@functools.partial(jax.jit, static_argnums=2)
def _ulp_error_jit(x, q, fmt, scale):
    return error_in_ulps(fmt, x, q, scale)


def ulp_error(*args, scale_exp=None, axis: int = -1, scale_rule=None) -> jax.Array:
    """``ulp_error(x, q, fmt)``: elementwise ``|q − x|`` in units of ``fmt``'s spacing at ``x``.

    Round-to-nearest gives at most 0.5 for in-range x; directed and stochastic rounding
    less than 1; saturated (clipped) values more. The division by the spacing is an exact
    exponent shift. For an MX format the unit is the spacing of the scaled element grid of
    x's block, so one call measures MX quantization in ULPs (NVFP4: a float division by
    the spacing, whose scale is not a power of two). Non-finite ``q`` gives NaN/inf.

    Args:
      x: exact values (rounded to float32 first).
      q: their approximations, e.g. ``lowprec.quantize(...)`` or
        ``lowprec.fake_quantize_mx(...)``.
      fmt: element or MX format, or its name.
      scale_exp, axis, scale_rule: as for :func:`ulp`.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([1.0625, 1.06, 300.0])
        >>> ulp_error(x, jnp.array([1.0, 1.0, 288.0]), "e4m3").tolist()
        [0.5, 0.4799995422363281, 0.375]
    """
    x, q, fmt = array_first("ulp_error", *args)
    x, q = as_f32(x), as_f32(q, "q")
    if x.shape != q.shape:
        raise ValueError(f"x and q must have the same shape, got {x.shape} and {q.shape}")
    elem, s = grid(x, fmt, scale_exp, axis, scale_rule)
    return _ulp_error_jit(x, q, elem, s)
