"""Error analysis: metrics, per-format value tables and a-priori error bounds.

Everything here is a pure function. The metrics take a reference array and its
approximation (``reference, approx``) and are jittable; functions that need a format take
it first for element formats (``fmt, x``, as :func:`lowprec.quantize`) and second for MX
formats (``x, fmt``, as :func:`lowprec.quantize_mx`).

Exactness notes. Powers of two (ULPs, MX scales) are built from bits, never with
``exp2``/``log2`` in floating point. Differences ``approx - reference`` are float32
subtractions, exact when ``approx`` is a rounding of ``reference`` to a coarser grid
(Sterbenz) — the case these tools are for. XLA's CPU backend flushes float32 subnormals
in arithmetic, so errors below 2^-126 (only BF16/TF32 subnormals reach there) read as 0
on CPU.
"""

from __future__ import annotations

import functools
import math
from typing import Iterable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._codec import decode, quantize
from ._format import ELEMENT_FORMAT_NAMES, ElementFormat, MXFormat, element_format, mx_format
from ._bits import E8M0_BIAS as _E8M0_BIAS
from ._mx import quantize_mx
from ._options import ElementCast
from ._rounding import check_rounding
from ._scale_rules import DEFAULT_SCALE_RULE

FormatLike = Union[str, ElementFormat]
MXFormatLike = Union[str, MXFormat]

_NEAREST = ("nearest_even", "nearest_away")

__all__ = [
    "clipping_rate",
    "dot_error_bound",
    "error_stats",
    "format_info",
    "format_table",
    "markdown_table",
    "max_abs_error",
    "max_rel_error",
    "mean_abs_error",
    "mean_error",
    "mean_rel_error",
    "mx_clipping_rate",
    "mx_error_bound",
    "mx_scale_exponents",
    "quantization_error_bound",
    "quantized_cumsum",
    "relative_error",
    "representable_values",
    "rms_error",
    "rounding_neighbors",
    "sqnr_db",
    "stochastic_rounding_stats",
    "ulp",
    "ulp_error",
    "underflow_rate",
    "value_spacing",
]


# --------------------------------------------------------------------------------------
# exact powers of two and exponents from float32 bits
# --------------------------------------------------------------------------------------
def _pow2(n):
    """float32 2^n from bits, exact for n in [-149, 127]; 0 below, inf above."""
    n = jnp.asarray(n, jnp.int32)
    normal = lax.shift_left(jnp.clip(n + 127, 1, 254).astype(jnp.uint32), jnp.uint32(23))
    sub = lax.shift_left(jnp.uint32(1), jnp.clip(n + 149, 0, 22).astype(jnp.uint32))
    bits = jnp.where(n >= -126, normal, jnp.where(n >= -149, sub, jnp.uint32(0)))
    bits = jnp.where(n > 127, jnp.uint32(0x7F80_0000), bits)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _times_pow2(v, n):
    """``v * 2^n`` for float32 ``v`` and int ``n``: exact whenever the result is normal.

    The factor is applied in two halves, each a normal float32, so 2^n itself never has
    to be representable (n is clipped to [-252, 252], far beyond float32's range).
    """
    n = jnp.clip(jnp.asarray(n, jnp.int32), -252, 252)
    a = jnp.floor_divide(n, 2)
    return (jnp.asarray(v, jnp.float32) * _pow2(a)) * _pow2(n - a)


def _floor_log2(x):
    """floor(log2 |x|) of a float32 array from its bits (int32; 0 gives -150)."""
    bits = lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32) & 0x7FFF_FFFF
    efield = lax.shift_right_logical(bits, jnp.uint32(23)).astype(jnp.int32)
    sig = jnp.where(efield > 0, (bits & 0x7F_FFFF) | 0x80_0000, bits & 0x7F_FFFF)
    return jnp.maximum(efield, 1) - 150 + 31 - lax.clz(sig).astype(jnp.int32)


def _as_f32(x):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"expected a floating-point array, got dtype {x.dtype}")
    return x.astype(jnp.float32)


def _ulp_exponent(fmt: ElementFormat, x, scale_exp=None):
    """Exponent n of the spacing 2^n of ``fmt``'s grid (scaled by 2^scale_exp) at |x|."""
    e = _floor_log2(x)
    s = 0 if scale_exp is None else jnp.asarray(scale_exp, jnp.int32)
    return jnp.clip(e - s, fmt.emin, fmt.emax) - fmt.mantissa_bits + s


def _metric_dtype(*arrays):
    dt = jnp.result_type(*arrays)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"metrics take floating-point arrays, got dtype {dt}")
    return jnp.promote_types(dt, jnp.float32)


def _pair(reference, approx):
    reference, approx = jnp.asarray(reference), jnp.asarray(approx)
    if reference.shape != approx.shape:
        raise ValueError(
            f"reference and approx must have the same shape, got {reference.shape} and "
            f"{approx.shape}"
        )
    dt = _metric_dtype(reference, approx)
    return reference.astype(dt), approx.astype(dt)


# --------------------------------------------------------------------------------------
# metrics (reference, approx) -> scalar; all jittable
# --------------------------------------------------------------------------------------
@jax.jit
def sqnr_db(reference, approx) -> jax.Array:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(Σ ref² / Σ (approx − ref)²)``.

    Both sums are taken after dividing by max |ref|, so squares cannot overflow even for
    BF16-sized values. An exact approximation gives ``+inf``.

    Args:
      reference: the exact values.
      approx: their approximation (same shape).

    Returns:
      A scalar (float32, or float64 for float64 inputs).

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([3.0, -4.0])      # signal power 25
        >>> round(float(sqnr_db(x, x + jnp.array([0.5, 0.0]))), 4)  # noise 0.25 -> 20 dB
        20.0
    """
    r, a = _pair(reference, approx)
    scale = jnp.max(jnp.abs(r))
    scale = jnp.where(scale > 0, scale, jnp.ones((), r.dtype))
    signal = jnp.sum(jnp.square(r / scale))
    noise = jnp.sum(jnp.square((a - r) / scale))
    return jnp.where(noise == 0, jnp.inf, 10 * jnp.log10(signal / noise))


@jax.jit
def max_abs_error(reference, approx) -> jax.Array:
    """``max |approx − reference|``.

    Example:
        >>> import jax.numpy as jnp
        >>> float(max_abs_error(jnp.array([1.0, 2.0]), jnp.array([1.25, 1.5])))
        0.5
    """
    r, a = _pair(reference, approx)
    return jnp.max(jnp.abs(a - r))


@jax.jit
def mean_abs_error(reference, approx) -> jax.Array:
    """``mean |approx − reference|``.

    Example:
        >>> import jax.numpy as jnp
        >>> float(mean_abs_error(jnp.array([1.0, 2.0]), jnp.array([1.25, 1.5])))
        0.375
    """
    r, a = _pair(reference, approx)
    return jnp.mean(jnp.abs(a - r))


@jax.jit
def mean_error(reference, approx) -> jax.Array:
    """Signed mean error ``mean(approx − reference)``: the bias of a rounding scheme.

    Example:
        >>> import jax.numpy as jnp
        >>> float(mean_error(jnp.array([1.0, 2.0]), jnp.array([1.25, 1.5])))
        -0.125
    """
    r, a = _pair(reference, approx)
    return jnp.mean(a - r)


@jax.jit
def rms_error(reference, approx) -> jax.Array:
    """Root-mean-square error ``sqrt(mean((approx − reference)²))``.

    Example:
        >>> import jax.numpy as jnp
        >>> float(rms_error(jnp.zeros(4), jnp.array([1.0, -1.0, 1.0, -1.0])))
        1.0
    """
    r, a = _pair(reference, approx)
    return jnp.sqrt(jnp.mean(jnp.square(a - r)))


@jax.jit
def relative_error(reference, approx) -> jax.Array:
    """Elementwise ``|approx − reference| / |reference|``.

    Where ``reference`` is 0 the result is 0 if ``approx`` is 0 too, else ``inf``.

    Example:
        >>> import jax.numpy as jnp
        >>> relative_error(jnp.array([2.0, 0.0, 0.0]), jnp.array([2.5, 0.0, 1.0])).tolist()
        [0.25, 0.0, inf]
    """
    r, a = _pair(reference, approx)
    err = jnp.abs(a - r)
    zero = r == 0
    safe = jnp.where(zero, jnp.ones((), r.dtype), jnp.abs(r))
    return jnp.where(zero, jnp.where(err == 0, 0, jnp.inf).astype(r.dtype), err / safe)


@jax.jit
def max_rel_error(reference, approx) -> jax.Array:
    """Largest relative error over the elements with ``reference != 0`` (0 if none).

    Example:
        >>> import jax.numpy as jnp
        >>> float(max_rel_error(jnp.array([2.0, 4.0, 0.0]), jnp.array([2.5, 4.0, 1.0])))
        0.25
    """
    r, a = _pair(reference, approx)
    rel = relative_error(r, a)
    return jnp.max(jnp.where(r != 0, rel, 0), initial=0.0)


@jax.jit
def mean_rel_error(reference, approx) -> jax.Array:
    """Mean relative error over the elements with ``reference != 0`` (0 if none).

    Example:
        >>> import jax.numpy as jnp
        >>> float(mean_rel_error(jnp.array([2.0, 4.0, 0.0]), jnp.array([2.5, 4.0, 1.0])))
        0.125
    """
    r, a = _pair(reference, approx)
    nz = r != 0
    rel = jnp.where(nz, relative_error(r, a), 0)
    return jnp.sum(rel) / jnp.maximum(jnp.sum(nz), 1).astype(rel.dtype)


@jax.jit
def underflow_rate(reference, approx) -> jax.Array:
    """Fraction of all elements that are nonzero in ``reference`` but 0 in ``approx``.

    Example:
        >>> import jax.numpy as jnp
        >>> import lowprec
        >>> x = jnp.array([0.0, 0.1, 0.2, 1.0])
        >>> float(underflow_rate(x, lowprec.quantize(x, "e2m1")))  # 0.1, 0.2 flush to 0
        0.5
    """
    r, a = _pair(reference, approx)
    return jnp.mean(((r != 0) & (a == 0)).astype(jnp.float32))


@jax.jit
def clipping_rate(x, limit) -> jax.Array:
    """Fraction of all elements of ``x`` with ``|x| > limit`` (beyond the representable range).

    Args:
      x: values before quantization.
      limit: the largest representable magnitude, a scalar (e.g. ``fmt.max_finite``) or
        an array broadcastable to ``x`` (per-block MX limits: see :func:`mx_clipping_rate`).

    Example:
        >>> import jax.numpy as jnp
        >>> float(clipping_rate(jnp.array([1.0, -500.0, 448.0, 449.0]), 448.0))
        0.5
    """
    x = jnp.asarray(x)
    return jnp.mean((jnp.abs(x) > limit).astype(jnp.float32))


@jax.jit
def error_stats(reference, approx) -> dict:
    """All scalar metrics at once: a dict of 0-d arrays.

    Keys (sorted, as ``jit`` returns them): ``max_abs_error``, ``max_rel_error``,
    ``mean_abs_error``, ``mean_error`` (signed: the bias), ``mean_rel_error``,
    ``rms_error``, ``sqnr_db``, ``underflow_rate``.

    Example:
        >>> import jax.numpy as jnp
        >>> s = error_stats(jnp.array([1.0, 2.0]), jnp.array([1.25, 1.5]))
        >>> {k: float(v) for k, v in s.items() if k.startswith("m")}
        {'max_abs_error': 0.5, 'max_rel_error': 0.25, 'mean_abs_error': 0.375, 'mean_error': -0.125, 'mean_rel_error': 0.25}
    """
    return {
        "sqnr_db": sqnr_db(reference, approx),
        "max_abs_error": max_abs_error(reference, approx),
        "mean_abs_error": mean_abs_error(reference, approx),
        "rms_error": rms_error(reference, approx),
        "mean_error": mean_error(reference, approx),
        "max_rel_error": max_rel_error(reference, approx),
        "mean_rel_error": mean_rel_error(reference, approx),
        "underflow_rate": underflow_rate(reference, approx),
    }


# --------------------------------------------------------------------------------------
# ULPs and a-priori rounding-error bounds
# --------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def _ulp_jit(fmt, x, scale_exp):
    return _pow2(_ulp_exponent(fmt, _as_f32(x), scale_exp))


def ulp(fmt: FormatLike, x, *, scale_exp=None) -> jax.Array:
    """The spacing of ``fmt``'s values around ``|x|`` (float32, exact powers of two).

    The spacing in the binade [2^e, 2^(e+1)) of x is 2^(e − mantissa_bits), with e clamped
    to [emin, emax]: values below the normal range get the subnormal spacing, values above
    the largest finite one the spacing of the top binade.

    Args:
      fmt: element format or name.
      x: float array (rounded to float32 first).
      scale_exp: optional int array broadcastable to x: the grid of ``fmt`` scaled by
        2^scale_exp (an MX block's shared exponent, see :func:`mx_scale_exponents`).

    Returns:
      float32 array; spacings beyond float32's range are inf (or 0).

    Example:
        >>> import jax.numpy as jnp
        >>> ulp("e4m3", jnp.array([1.0, 1.9, 300.0, 1000.0, 0.001])).tolist()
        [0.125, 0.125, 32.0, 32.0, 0.001953125]
    """
    fmt = element_format(fmt)
    if scale_exp is not None:
        scale_exp = jnp.asarray(scale_exp, jnp.int32)
    return _ulp_jit(fmt, jnp.asarray(x), scale_exp)


@functools.partial(jax.jit, static_argnums=0)
def _ulp_error_jit(fmt, x, q, scale_exp):
    x, q = _as_f32(x), _as_f32(q)
    n = _ulp_exponent(fmt, x, scale_exp)
    return _times_pow2(jnp.abs(q - x), -n)


def ulp_error(fmt: FormatLike, x, q, *, scale_exp=None) -> jax.Array:
    """Elementwise error ``|q − x|`` in units of ``fmt``'s spacing at ``x`` (see :func:`ulp`).

    Round-to-nearest gives at most 0.5 for in-range x; directed and stochastic rounding
    less than 1. The division by the spacing is an exact exponent shift.

    Args:
      fmt: element format or name.
      x: exact values (float32).
      q: their approximations, e.g. ``lowprec.quantize(x, fmt)``.
      scale_exp: optional per-element shared exponent (MX), as for :func:`ulp`.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([1.0625, 1.06, 300.0])
        >>> ulp_error("e4m3", x, jnp.array([1.0, 1.0, 288.0])).tolist()
        [0.5, 0.4799995422363281, 0.375]
    """
    fmt = element_format(fmt)
    x, q = jnp.asarray(x), jnp.asarray(q)
    if x.shape != q.shape:
        raise ValueError(f"x and q must have the same shape, got {x.shape} and {q.shape}")
    if scale_exp is not None:
        scale_exp = jnp.asarray(scale_exp, jnp.int32)
    return _ulp_error_jit(fmt, x, q, scale_exp)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _bound_jit(fmt, x, rounding, scale_exp):
    x = _as_f32(x)
    n = _ulp_exponent(fmt, x, scale_exp)
    step = _pow2(n - 1) if rounding in _NEAREST else _pow2(n)
    max_scaled = jnp.float32(fmt.max_finite)
    if scale_exp is not None:
        max_scaled = _times_pow2(max_scaled, scale_exp)
    return jnp.maximum(step, jnp.abs(x) - max_scaled)


def quantization_error_bound(
    fmt: FormatLike, x, *, rounding: str = "nearest_even", scale_exp=None
) -> jax.Array:
    """A-priori bound on ``|q(x) − x|`` per element, for rounding with saturation.

    ``max(step, |x| − max_finite)`` with step = half the spacing at x (round to nearest)
    or the whole spacing (directed and stochastic modes); the second term is the clipping
    error of values beyond the largest finite one (``overflow="saturate"``, as in MX).
    With ``scale_exp`` the grid and max are scaled by 2^scale_exp (MX blocks).

    Example:
        >>> import jax.numpy as jnp
        >>> quantization_error_bound("e4m3", jnp.array([1.0, 300.0, 1000.0])).tolist()
        [0.0625, 16.0, 552.0]
        >>> quantization_error_bound("e4m3", jnp.array([1.0]), rounding="stochastic").tolist()
        [0.125]
    """
    fmt = element_format(fmt)
    rounding = check_rounding(fmt, rounding)
    if scale_exp is not None:
        scale_exp = jnp.asarray(scale_exp, jnp.int32)
    return _bound_jit(fmt, jnp.asarray(x), rounding, scale_exp)


# --------------------------------------------------------------------------------------
# MX helpers
# --------------------------------------------------------------------------------------
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
    x = jnp.asarray(x)
    mx = quantize_mx(x, fmt, axis=axis, scale_rule=scale_rule, pad=True)
    axis = mx.axis
    exps = mx.scales.astype(jnp.int32) - _E8M0_BIAS
    exps = jnp.repeat(exps, fmt.block_size, axis=axis)
    return lax.slice_in_dim(exps, 0, x.shape[axis], axis=axis)


def mx_clipping_rate(
    x, fmt: MXFormatLike, *, axis: int = -1, scale_rule: str = DEFAULT_SCALE_RULE
) -> jax.Array:
    """Fraction of elements whose magnitude exceeds their block's range ``max_elem·2^scale``.

    Those elements saturate to ± the element maximum. With ``scale_rule="floor"`` a block
    max above 1.75·2^emax_elem (FP8) or 1.5·2^emax_elem (FP4) is clipped; ``ceil`` and
    ``rceil`` never clip.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.concatenate([jnp.full(31, 0.1), jnp.array([7.9]), jnp.full(32, 1.0)])
        >>> float(mx_clipping_rate(x, "mxfp4"))   # 7.9 > 6·2^0: one of 64
        0.015625
        >>> float(mx_clipping_rate(x, "mxfp4", scale_rule="ceil"))
        0.0
    """
    fmt = mx_format(fmt)
    x = jnp.asarray(x)
    s = mx_scale_exponents(x, fmt, axis=axis, scale_rule=scale_rule)
    limit = jnp.where(s > _E8M0_BIAS, jnp.inf, _times_pow2(jnp.float32(fmt.element.max_finite), s))
    return clipping_rate(x, limit)


def mx_error_bound(
    x,
    fmt: MXFormatLike,
    *,
    axis: int = -1,
    scale_rule: str = DEFAULT_SCALE_RULE,
    rounding: str = "nearest_even",
) -> jax.Array:
    """A-priori bound on the error of each element of ``fake_quantize_mx(x, fmt, ...)``.

    :func:`quantization_error_bound` of the element format on the grid scaled by each
    block's shared exponent (clipping included).

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.concatenate([jnp.array([7.9, 1.0, 0.1]), jnp.zeros(29)])
        >>> mx_error_bound(x, "mxfp4")[:3].tolist()   # scale 2^0: clip 1.9, ulp/2 0.25, 0.25
        [1.9000000953674316, 0.25, 0.25]
    """
    fmt = mx_format(fmt)
    s = mx_scale_exponents(x, fmt, axis=axis, scale_rule=scale_rule)
    return quantization_error_bound(fmt.element, x, rounding=rounding, scale_exp=s)


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
        :func:`quantization_error_bound` or :func:`mx_error_bound`.
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
    a, b, err_a, err_b = (_as_f32(v) for v in (a, b, err_a, err_b))
    ku = a.shape[-1] * float(accumulation_eps)
    if ku >= 1:
        raise ValueError(f"K·u = {ku} ≥ 1: the accumulation bound is void")
    return _dot_bound_jit(a, b, err_a, err_b, ku / (1 - ku))


@jax.jit
def _dot_bound_jit(a, b, err_a, err_b, gamma):
    mm = functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST)
    inputs = mm(jnp.abs(a), err_b) + mm(err_a, jnp.abs(b)) + mm(err_a, err_b)
    return inputs + jnp.float32(gamma) * mm(jnp.abs(a) + err_a, jnp.abs(b) + err_b)


# --------------------------------------------------------------------------------------
# stochastic rounding and accumulation
# --------------------------------------------------------------------------------------
def rounding_neighbors(fmt: FormatLike, x) -> tuple[jax.Array, jax.Array]:
    """The two values of ``fmt`` bracketing ``x``: ``(round down, round up)`` with saturation.

    Example:
        >>> import jax.numpy as jnp
        >>> lo, hi = rounding_neighbors("e4m3", jnp.array([1.03125, 2.0]))
        >>> lo.tolist(), hi.tolist()
        ([1.0, 2.0], [1.125, 2.0])
    """
    lo = quantize(x, fmt, rounding="down", overflow="saturate", dtype=jnp.float32)
    hi = quantize(x, fmt, rounding="up", overflow="saturate", dtype=jnp.float32)
    return lo, hi


@functools.partial(jax.jit, static_argnums=(0, 3))
def _sr_stats(fmt, x, key, num_samples):
    keys = jax.random.split(key, num_samples)
    draw = jax.vmap(
        lambda k: quantize(x, fmt, rounding="stochastic", overflow="saturate", key=k,
                           dtype=jnp.float32)
    )
    samples = draw(keys)
    mean = jnp.mean(samples, axis=0)
    var = jnp.var(samples, axis=0, ddof=1)
    lo, hi = rounding_neighbors(fmt, x)
    return {
        "mean": mean,
        "bias": mean - x,
        "variance": var,
        "expected_variance": (x - lo) * (hi - x),
        "lo": lo,
        "hi": hi,
    }


def stochastic_rounding_stats(fmt: FormatLike, x, *, key, num_samples: int = 1024) -> dict:
    """Monte-Carlo bias and variance of stochastic rounding of each element of ``x``.

    Draws ``num_samples`` independent roundings. For x between neighbours lo < hi,
    stochastic rounding picks hi with probability (x − lo)/(hi − lo), so E[q] = x and
    Var[q] = (x − lo)(hi − x); the estimates should match within sampling error
    (std of the bias estimate: sqrt(Var/num_samples)).

    Args:
      fmt: element format or name.
      x: values to round (float32).
      key: PRNG key, split into ``num_samples`` keys.
      num_samples: number of independent roundings of each element.

    Returns:
      dict of arrays shaped like x: ``mean``, ``bias`` (mean − x), ``variance`` (sample,
      ddof=1), ``expected_variance``, ``lo``, ``hi``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> s = stochastic_rounding_stats("e4m3", jnp.array([1.03125]), key=jax.random.key(0))
        >>> s["expected_variance"].tolist()   # (1/32)·(3/32)
        [0.0029296875]
        >>> bool(abs(s["bias"][0]) < 4 * (3 / 1024 / 1024) ** 0.5)
        True
    """
    fmt = element_format(fmt)
    return _sr_stats(fmt, _as_f32(x), key, int(num_samples))


@functools.partial(jax.jit, static_argnums=(0, 2))
def _cumsum_jit(fmt, increments, rounding, key, init):
    n = increments.shape[0]
    init = jnp.broadcast_to(init, increments.shape[1:]).astype(jnp.float32)
    if rounding == "stochastic":
        keys = jax.random.split(key, n)

        def step(s, xs):
            inc, k = xs
            s = quantize(s + inc, fmt, rounding="stochastic", overflow="saturate", key=k)
            return s, s

        _, sums = lax.scan(step, init, (increments, keys))
    else:

        def step(s, inc):
            s = quantize(s + inc, fmt, rounding=rounding, overflow="saturate")
            return s, s

        _, sums = lax.scan(step, init, increments)
    return sums


def quantized_cumsum(
    fmt: FormatLike,
    increments,
    *,
    rounding: str = "nearest_even",
    key: Optional[jax.Array] = None,
    init=0.0,
) -> jax.Array:
    """Running sums with an accumulator stored in ``fmt``: ``s ← q(s + x_i)``.

    Models a low-precision accumulator (e.g. a BF16 weight receiving many small updates).
    Each sum ``s + x_i`` is formed in float32, then rounded to ``fmt`` (with saturation).
    Sums over axis 0; trailing axes are independent accumulators (e.g. trials).

    Args:
      fmt: accumulator format.
      increments: float array [n, ...].
      rounding: rounding mode of each step; ``"stochastic"`` needs ``key`` (split into one
        key per step).
      key: PRNG key for stochastic rounding.
      init: initial value, broadcast to ``increments.shape[1:]``.

    Returns:
      float32 array [n, ...]: the accumulator after each step.

    Example:
        >>> import jax.numpy as jnp
        >>> inc = jnp.full(8, 0.25)
        >>> quantized_cumsum("e2m1", inc, init=2.0).tolist()   # 2.25 rounds back to 2
        [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    """
    cast = ElementCast(fmt, rounding)
    cast.check_key(key)
    fmt, rounding = cast.fmt, cast.rounding
    increments = _as_f32(increments)
    if increments.ndim == 0:
        raise ValueError("increments needs at least one axis (the summation axis 0)")
    return _cumsum_jit(fmt, increments, rounding, key, jnp.asarray(init, jnp.float32))


# --------------------------------------------------------------------------------------
# value tables
# --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _all_finite_values(name: str) -> np.ndarray:
    fmt = element_format(name)
    codes = np.arange(1 << fmt.code_bits, dtype=np.uint32)
    values = np.asarray(decode(codes.astype(fmt.code_dtype), fmt))  # float32, exact
    # Drop NaN/inf before widening (signalling-NaN patterns would raise FP 'invalid').
    values = values[np.isfinite(values)].astype(np.float64)
    values = np.unique(values + 0.0)  # + 0.0 turns -0 into +0
    values.flags.writeable = False
    return values


def representable_values(fmt: FormatLike, *, negative: bool = False) -> np.ndarray:
    """All distinct finite values of ``fmt``, sorted (NumPy float64, exact).

    Args:
      fmt: element format or name.
      negative: include the negative values (default: only values ≥ 0).

    Example:
        >>> representable_values("e2m1").tolist()
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
        >>> len(representable_values("e4m3", negative=True))   # 256 codes - 2 NaN - one -0
        253
    """
    values = _all_finite_values(element_format(fmt).name)
    return values.copy() if negative else values[values >= 0].copy()


def value_spacing(fmt: FormatLike) -> tuple[np.ndarray, np.ndarray]:
    """Positive finite values of ``fmt`` and the gap from each to the next one.

    Returns:
      ``(values, gaps)``: ``values[i] > 0`` and ``gaps[i] = values[i+1] − values[i]``
      (the largest value has no successor and is left out).

    Example:
        >>> v, g = value_spacing("e2m1")
        >>> v.tolist(), g.tolist()
        ([0.5, 1.0, 1.5, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 1.0, 1.0, 2.0])
    """
    values = representable_values(fmt)
    values = values[values > 0]
    return values[:-1], np.diff(values)


def format_info(fmt: FormatLike) -> dict:
    """Range and precision of an element format, as a dict of Python numbers.

    Keys: ``name``, ``bits``, ``exponent_bits``, ``mantissa_bits``, ``max_finite``,
    ``min_normal``, ``min_subnormal`` (smallest positive value), ``eps`` (gap above 1),
    ``unit_roundoff`` (eps/2: max relative error of round-to-nearest in the normal range),
    ``decimal_digits`` (log10 2^(mantissa_bits+1)), ``dynamic_range_binades``
    (log2 max_finite/min_subnormal), ``normal_binades`` (emax − emin + 1),
    ``finite_values`` (distinct finite values, ±0 counted once), ``inf``, ``nan``.

    Example:
        >>> info = format_info("e4m3")
        >>> info["max_finite"], info["min_subnormal"], info["finite_values"]
        (448.0, 0.001953125, 253)
        >>> round(info["dynamic_range_binades"], 2)
        17.81
    """
    fmt = element_format(fmt)
    return {
        "name": fmt.name,
        "bits": fmt.code_bits,
        "exponent_bits": fmt.exponent_bits,
        "mantissa_bits": fmt.mantissa_bits,
        "max_finite": fmt.max_finite,
        "min_normal": fmt.min_normal,
        "min_subnormal": fmt.min_subnormal,
        "eps": fmt.eps,
        "unit_roundoff": fmt.eps / 2,
        "decimal_digits": (fmt.mantissa_bits + 1) * math.log10(2),
        "dynamic_range_binades": math.log2(fmt.max_finite) - math.log2(fmt.min_subnormal),
        "normal_binades": fmt.emax - fmt.emin + 1,
        "finite_values": int(len(_all_finite_values(fmt.name))),
        "inf": fmt.inf,
        "nan": fmt.nan != "none",
    }


def format_table(fmts: Iterable[FormatLike] = ELEMENT_FORMAT_NAMES) -> list[dict]:
    """:func:`format_info` of each format (default: every element format).

    Example:
        >>> [row["max_finite"] for row in format_table(["e4m3", "e5m2", "e2m1"])]
        [448.0, 57344.0, 6.0]
    """
    return [format_info(f) for f in fmts]


def _fmt_cell(v, floatfmt: str) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (float, np.floating)):
        return format(float(v), floatfmt)
    return str(v)


def markdown_table(
    rows: Sequence[Mapping], columns: Optional[Sequence[str]] = None, *, floatfmt: str = ".4g"
) -> str:
    """Renders a list of dicts as a Markdown table (for ``IPython.display.Markdown``).

    Example:
        >>> print(markdown_table([{"name": "e2m1", "max": 6.0}, {"name": "e4m3", "max": 448.0}]))
        | name | max |
        |---|---|
        | e2m1 | 6 |
        | e4m3 | 448 |
    """
    rows = list(rows)
    if columns is None:
        columns = list(rows[0]) if rows else []
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt_cell(row[c], floatfmt) for c in columns) + " |")
    return "\n".join(lines)
