"""A-priori error bounds: per element for quantization, per output for a quantized matmul."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._options import ElementCast
from ._common import array_first, as_f32
from .._bits import pow2_f32 as pow2
from ._ulp import grid, grid_max, is_factor, scaled_ulp, ulp_exponent

_NEAREST = ("nearest_even", "nearest_away", "nearest_toward_zero")
# NVFP4's recipe rounds twice in float32 around the element's rounding (x / factor, then
# element × factor), each by at most 2^-24 relative; the bound and its own float32
# arithmetic add a few more roundings of the same size: 2^-20·|x| covers them all.
_FACTOR_SLACK = 2.0**-20


@functools.partial(jax.jit, static_argnums=(1, 2))
def _bound_jit(x, fmt, rounding, scale):
    half = rounding in _NEAREST
    if is_factor(scale):
        step = scaled_ulp(fmt, x, scale) * (0.5 if half else 1.0)
    else:  # built from bits: exact also where the spacing is a float32 subnormal
        step = pow2(ulp_exponent(fmt, x, scale) - (1 if half else 0))
    clip = jnp.abs(x) - grid_max(fmt, scale)
    # A select, not jnp.maximum: XLA:CPU's arithmetic reads a float32 subnormal as zero, so
    # maximum(step, clip) would turn a subnormal step (bf16's 2^-134 near zero) into 0; the
    # select passes step's bits through. A NaN clip (x NaN) stays NaN, as maximum's would.
    bound = jnp.where((clip > step) | jnp.isnan(clip), clip, step)
    if is_factor(scale):
        bound = bound + jnp.float32(_FACTOR_SLACK) * jnp.abs(x)
    return bound


def quantization_error_bound(
    *args,
    rounding: str = "nearest_even",
    scale_exp=None,
    axis: int = -1,
    scale_rule=None,
) -> jax.Array:
    """``quantization_error_bound(x, fmt)``: a bound on ``|q(x) − x|`` per element, with saturation.

    ``max(step, |x| − max_finite)`` with step = half the spacing at x (round to nearest)
    or the whole spacing (directed and stochastic modes); the second term is the clipping
    error of values beyond the largest finite one (``overflow="saturate"``, as in MX). For an
    MX format the grid and the max are those of x's block, scaled by its shared exponent
    (so ``floor``'s clipping of block maxima is included); for NVFP4 by the block's float32
    factor tensor_scale × block_scale, plus 2^-20·|x| for the float32 roundings of its
    recipe (the quotient x / factor and the product element × factor).

    Args:
      x: values to quantize (rounded to float32 first).
      fmt: element or MX format, or its name.
      rounding: the element rounding mode.
      scale_exp: element formats only: scale the grid by 2^scale_exp.
      axis, scale_rule: MX formats only, as for :func:`lowprec.quantize_mx` (None:
        ``"floor"``; NVFP4 takes none).

    Example:
        >>> import jax.numpy as jnp
        >>> quantization_error_bound(jnp.array([1.0, 300.0, 1000.0]), "e4m3").tolist()
        [0.0625, 16.0, 552.0]
        >>> quantization_error_bound(jnp.array([1.0]), "e4m3", rounding="stochastic").tolist()
        [0.125]
        >>> x = jnp.concatenate([jnp.array([7.9, 1.0, 0.1]), jnp.zeros(29)])
        >>> quantization_error_bound(x, "mxfp4")[:3].tolist()   # scale 2^0: clip 1.9, ulp/2
        [1.9000000953674316, 0.25, 0.25]
    """
    x, fmt = array_first("quantization_error_bound", *args)
    x = as_f32(x)
    elem, s = grid(x, fmt, scale_exp, axis, scale_rule)
    rounding = ElementCast(elem, rounding).rounding
    return _bound_jit(x, elem, rounding, s)


def dot_error_bound(a, b, err_a, err_b, *, accumulation_eps: float = 2.0**-24) -> jax.Array:
    """Worst-case bound on ``|q(a) @ q(b) − a @ b|`` for a matmul of quantized inputs.

    With elementwise input-error bounds ``|q(a) − a| ≤ err_a``, ``|q(b) − b| ≤ err_b``
    and products computed exactly (true in float32 for all formats of ≤ 11 significant
    bits), a length-K sum accumulated with unit roundoff u in any order satisfies::

        |ŷ − y| ≤ |a|·err_b + err_a·|b| + err_a·err_b          (input quantization)
                 + γ_K · (|a| + err_a)·(|b| + err_b),   γ_K = K u / (1 − K u)

    Args:
      a, b: the exact operands (1-D or 2-D, as for ``jnp.matmul``).
      err_a, err_b: elementwise bounds of their quantization errors, e.g. from
        :func:`quantization_error_bound`.
      accumulation_eps: unit roundoff of the accumulator (2^-24 for float32).

    Returns:
      The bound, shaped like ``a @ b`` (evaluated in float32 at HIGHEST precision; its own
      rounding is negligible next to the bound's slack).

    Example:
        >>> import jax.numpy as jnp
        >>> a = jnp.array([1.0, 2.0]); b = jnp.array([3.0, 4.0])
        >>> float(dot_error_bound(a, b, 0.5 * a * 2**-3, 0.5 * b * 2**-3, accumulation_eps=0))
        1.41796875
    """
    a, b, err_a, err_b = (as_f32(v, name) for v, name in
                          ((a, "a"), (b, "b"), (err_a, "err_a"), (err_b, "err_b")))
    ku = a.shape[-1] * float(accumulation_eps)
    if ku >= 1:
        raise ValueError(
            f"K·u = {ku} ≥ 1 (K = {a.shape[-1]}, u = {accumulation_eps}): the accumulation "
            "bound is void; use a smaller K or a more precise accumulator"
        )
    return _dot_bound_jit(a, b, err_a, err_b, ku / (1 - ku))


@jax.jit
def _dot_bound_jit(a, b, err_a, err_b, gamma):
    mm = functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST)
    inputs = mm(jnp.abs(a), err_b) + mm(err_a, jnp.abs(b)) + mm(err_a, err_b)
    return inputs + jnp.float32(gamma) * mm(jnp.abs(a) + err_a, jnp.abs(b) + err_b)
