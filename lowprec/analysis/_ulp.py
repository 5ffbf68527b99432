"""ULPs: the spacing of a format's grid at each value, and errors measured in that unit.

For an MX format the grid is the element format's, scaled by each block's shared exponent
(the "right grid" for MX: a value's ULP depends on its block, not only on itself).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .._bits import pow2_f32 as pow2
from .._bits import times_pow2
from .._format import ElementFormat, MXFormat, resolve_format
from .._scale_rules import DEFAULT_SCALE_RULE
from ._common import array_first, as_f32, floor_log2
from ._mx_stats import roundtrip


def ulp_exponent(fmt: ElementFormat, x, scale_exp=None):
    """Exponent n of the spacing 2^n of ``fmt``'s grid (scaled by 2^scale_exp) at |x|."""
    e = floor_log2(x)
    s = 0 if scale_exp is None else jnp.asarray(scale_exp, jnp.int32)
    return jnp.clip(e - s, fmt.emin, fmt.emax) - fmt.mantissa_bits + s


def grid(x, fmt, scale_exp, axis: int, scale_rule: str):
    """(element format, per-element scale exponent or None) for ``fmt`` at ``x``."""
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
def _ulp_jit(x, fmt, scale_exp):
    return pow2(ulp_exponent(fmt, as_f32(x), scale_exp))


def ulp(*args, scale_exp=None, axis: int = -1, scale_rule: str = DEFAULT_SCALE_RULE) -> jax.Array:
    """``ulp(x, fmt)``: the spacing of ``fmt``'s values around ``|x|`` (float32, exact powers of two).

    The spacing in the binade [2^e, 2^(e+1)) of x is 2^(e − mantissa_bits), with e clamped
    to [emin, emax]: values below the normal range get the subnormal spacing, values above
    the largest finite one the spacing of the top binade. For an MX format, the element
    grid scaled by the shared exponent of x's block.

    Args:
      x: float array (rounded to float32 first).
      fmt: element or MX format, or its name.
      scale_exp: element formats only: an int array broadcastable to x, the grid of ``fmt``
        scaled by 2^scale_exp (e.g. :func:`mx_scale_exponents`).
      axis, scale_rule: MX formats only: the block axis and the rule choosing the scales.

    Returns:
      float32 array shaped like ``x``; spacings beyond float32's range are inf (or 0).

    Example:
        >>> import jax.numpy as jnp
        >>> ulp(jnp.array([1.0, 1.9, 300.0, 1000.0, 0.001]), "e4m3").tolist()
        [0.125, 0.125, 32.0, 32.0, 0.001953125]
        >>> x = jnp.concatenate([jnp.array([6.0, 1.0]), jnp.zeros(30)])
        >>> ulp(x, "mxfp4")[:2].tolist()   # block scale 2^0: FP4's own grid
        [2.0, 0.5]
    """
    x, fmt = array_first("ulp", *args)
    x = as_f32(x)
    elem, s = grid(x, fmt, scale_exp, axis, scale_rule)
    return _ulp_jit(x, elem, s)


@functools.partial(jax.jit, static_argnums=2)
def _ulp_error_jit(x, q, fmt, scale_exp):
    n = ulp_exponent(fmt, x, scale_exp)
    return times_pow2(jnp.abs(q - x), -n)


def ulp_error(*args, scale_exp=None, axis: int = -1, scale_rule: str = DEFAULT_SCALE_RULE) -> jax.Array:
    """``ulp_error(x, q, fmt)``: elementwise ``|q − x|`` in units of ``fmt``'s spacing at ``x``.

    Round-to-nearest gives at most 0.5 for in-range x; directed and stochastic rounding
    less than 1; saturated (clipped) values more. The division by the spacing is an exact
    exponent shift. For an MX format the unit is the spacing of the scaled element grid of
    x's block, so one call measures MX quantization in ULPs. Non-finite ``q`` gives NaN/inf.

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
