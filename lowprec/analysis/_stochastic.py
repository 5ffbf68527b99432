"""Stochastic rounding: bracketing neighbours, Monte-Carlo bias and variance, and a
low-precision accumulator (``s ← q(s + x_i)``)."""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from .._codec import quantize
from .._format import element_format
from .._options import ElementCast
from ._common import array_first, as_f32


def _neighbors(x, fmt):
    lo = quantize(x, fmt, rounding="down", overflow="saturate", dtype=jnp.float32)
    hi = quantize(x, fmt, rounding="up", overflow="saturate", dtype=jnp.float32)
    return lo, hi


def rounding_neighbors(*args) -> tuple[jax.Array, jax.Array]:
    """``rounding_neighbors(x, fmt)``: the values of ``fmt`` bracketing ``x``, ``(down, up)``.

    With saturation: values beyond the largest finite one get it as both neighbours.

    Example:
        >>> import jax.numpy as jnp
        >>> lo, hi = rounding_neighbors(jnp.array([1.03125, 2.0]), "e4m3")
        >>> lo.tolist(), hi.tolist()
        ([1.0, 2.0], [1.125, 2.0])
    """
    x, fmt = array_first("rounding_neighbors", *args)
    return _neighbors(as_f32(x), element_format(fmt))


@functools.partial(jax.jit, static_argnums=(1, 3))
def _sr_stats(x, fmt, key, num_samples):
    keys = jax.random.split(key, num_samples)
    draw = jax.vmap(
        lambda k: quantize(x, fmt, rounding="stochastic", overflow="saturate", key=k,
                           dtype=jnp.float32)
    )
    samples = draw(keys)
    mean = jnp.mean(samples, axis=0)
    var = jnp.var(samples, axis=0, ddof=1)
    lo, hi = _neighbors(x, fmt)
    return {
        "mean": mean,
        "bias": mean - x,
        "variance": var,
        "expected_variance": (x - lo) * (hi - x),
        "lo": lo,
        "hi": hi,
    }


def stochastic_rounding_stats(*args, key, num_samples: int = 1024) -> dict:
    """``stochastic_rounding_stats(x, fmt, key=...)``: Monte-Carlo bias and variance per element.

    Draws ``num_samples`` independent roundings. For x between neighbours lo < hi,
    stochastic rounding picks hi with probability (x − lo)/(hi − lo), so E[q] = x and
    Var[q] = (x − lo)(hi − x); the estimates should match within sampling error
    (std of the bias estimate: sqrt(Var/num_samples)).

    Args:
      x: values to round (float32).
      fmt: element format or name.
      key: PRNG key, split into ``num_samples`` keys.
      num_samples: number of independent roundings of each element (at least 2).

    Returns:
      dict of arrays shaped like x: ``mean``, ``bias`` (mean − x), ``variance`` (sample,
      ddof=1), ``expected_variance``, ``lo``, ``hi``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> s = stochastic_rounding_stats(jnp.array([1.03125]), "e4m3", key=jax.random.key(0))
        >>> s["expected_variance"].tolist()   # (1/32)·(3/32)
        [0.0029296875]
        >>> bool(abs(s["bias"][0]) < 4 * (3 / 1024 / 1024) ** 0.5)
        True
    """
    x, fmt = array_first("stochastic_rounding_stats", *args)
    if int(num_samples) < 2:
        raise ValueError(f"num_samples must be at least 2 (a variance needs two), got {num_samples}")
    return _sr_stats(as_f32(x), element_format(fmt), key, int(num_samples))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _cumsum_jit(increments, fmt, rounding, key, init):
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
    *args,
    rounding: str = "nearest_even",
    key: Optional[jax.Array] = None,
    init=0.0,
) -> jax.Array:
    """``quantized_cumsum(increments, fmt)``: running sums kept in ``fmt``, ``s ← q(s + x_i)``.

    Models a low-precision accumulator (e.g. a BF16 weight receiving many small updates).
    Each sum ``s + x_i`` is formed in float32, then rounded to ``fmt`` (with saturation).
    Sums over axis 0; trailing axes are independent accumulators (e.g. trials).

    Args:
      increments: float array [n, ...].
      fmt: accumulator format.
      rounding: rounding mode of each step; ``"stochastic"`` needs ``key`` (split into one
        key per step).
      key: PRNG key for stochastic rounding.
      init: initial value, broadcast to ``increments.shape[1:]``.

    Returns:
      float32 array [n, ...]: the accumulator after each step.

    Example:
        >>> import jax.numpy as jnp
        >>> inc = jnp.full(8, 0.25)
        >>> quantized_cumsum(inc, "e2m1", init=2.0).tolist()   # 2.25 rounds back to 2
        [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    """
    increments, fmt = array_first("quantized_cumsum", *args)
    cast = ElementCast(fmt, rounding)
    cast.check_key(key)
    increments = as_f32(increments, "increments")
    if increments.ndim == 0:
        raise ValueError("increments needs at least one axis (the summation axis 0)")
    return _cumsum_jit(increments, cast.fmt, cast.rounding, key, jnp.asarray(init, jnp.float32))
