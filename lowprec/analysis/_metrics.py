"""Error metrics of an approximation against its reference: ``metric(reference, approx)``.

Scalar metrics return a Python ``float`` when called on concrete arrays and a 0-d JAX array
while traced (inside ``jit``, ``vmap`` or ``grad``), so they compose with JAX and drop
straight into a pandas column. Each takes an optional boolean ``where`` mask (broadcast to
``reference``), like NumPy's reductions: only the selected elements count.

Non-finite values are never hidden. A NaN or inf in ``approx`` (e.g. E4M3 overflow, which
gives NaN under the default policy) makes the error metrics NaN/inf; :func:`overflow_rate`
and :func:`nan_rate` count such elements, and :func:`error_stats` reports them beside
metrics taken over the finite pairs.

Differences ``approx - reference`` are float32 subtractions, exact when ``approx`` is a
rounding of ``reference`` to a coarser grid (Sterbenz) — the case these tools are for. XLA's
CPU backend flushes float32 subnormals in arithmetic, so errors below 2^-126 (only BF16/TF32
subnormals reach there) read as 0 on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._common import scalar



def _metric_dtype(*arrays):
    dt = jnp.result_type(*arrays)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"metrics take floating-point arrays, got dtype {dt}; convert with "
            ".astype(jnp.float32)"
        )
    return jnp.promote_types(dt, jnp.float32)


def _pair(reference, approx, where=None):
    reference, approx = jnp.asarray(reference), jnp.asarray(approx)
    if reference.shape != approx.shape:
        raise ValueError(
            f"reference and approx must have the same shape, got {reference.shape} and "
            f"{approx.shape}"
        )
    dt = _metric_dtype(reference, approx)
    if where is None:
        mask = jnp.ones(reference.shape, bool)
    else:
        where = jnp.asarray(where)
        if where.dtype != bool:
            raise TypeError(f"where must be a boolean mask, got dtype {where.dtype}")
        mask = jnp.broadcast_to(where, reference.shape)
    return reference.astype(dt), approx.astype(dt), mask


def _count(mask, dtype):
    return jnp.sum(mask).astype(dtype)


@jax.jit
def _sqnr(r, a, m):
    zero = jnp.zeros((), r.dtype)
    scale = jnp.max(jnp.where(m, jnp.abs(r), zero), initial=0.0)
    scale = jnp.where(scale > 0, scale, jnp.ones((), r.dtype))
    signal = jnp.sum(jnp.where(m, jnp.square(r / scale), zero))
    noise = jnp.sum(jnp.where(m, jnp.square((a - r) / scale), zero))
    return jnp.where(noise == 0, jnp.inf, 10 * jnp.log10(signal / noise))


def sqnr_db(reference, approx, *, where=None):
    """Signal-to-quantization-noise ratio in dB: ``10 log10(Σ ref² / Σ (approx − ref)²)``.

    Both sums are taken after dividing by max |ref|, so squares cannot overflow even for
    BF16-sized values. An exact approximation gives ``+inf``; a NaN in ``approx`` gives NaN
    (pass ``where=jnp.isfinite(approx)`` to measure the rest, and count the NaNs with
    :func:`nan_rate`).

    Args:
      reference: the exact values.
      approx: their approximation (same shape).
      where: optional boolean mask of the elements to include.

    Returns:
      A Python float (a 0-d array while traced).

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([3.0, -4.0])      # signal power 25
        >>> round(sqnr_db(x, x + jnp.array([0.5, 0.0])), 4)   # noise 0.25 -> 20 dB
        20.0
    """
    return scalar(_sqnr(*_pair(reference, approx, where)))


@jax.jit
def _max_abs(r, a, m):
    return jnp.max(jnp.where(m, jnp.abs(a - r), 0), initial=0.0)


def max_abs_error(reference, approx, *, where=None):
    """``max |approx − reference|`` (0 when nothing is selected).

    Example:
        >>> import jax.numpy as jnp
        >>> max_abs_error(jnp.array([1.0, 2.0]), jnp.array([1.25, 1.5]))
        0.5
    """
    return scalar(_max_abs(*_pair(reference, approx, where)))


@jax.jit
def _mean_abs(r, a, m):
    return jnp.sum(jnp.where(m, jnp.abs(a - r), 0)) / jnp.maximum(_count(m, r.dtype), 1)


def mean_abs_error(reference, approx, *, where=None):
    """``mean |approx − reference|``.

    Example:
        >>> import jax.numpy as jnp
        >>> mean_abs_error(jnp.array([1.0, 2.0]), jnp.array([1.25, 1.5]))
        0.375
    """
    return scalar(_mean_abs(*_pair(reference, approx, where)))


@jax.jit
def _mean_err(r, a, m):
    return jnp.sum(jnp.where(m, a - r, 0)) / jnp.maximum(_count(m, r.dtype), 1)


def mean_error(reference, approx, *, where=None):
    """Signed mean error ``mean(approx − reference)``: the bias of a rounding scheme.

    Example:
        >>> import jax.numpy as jnp
        >>> mean_error(jnp.array([1.0, 2.0]), jnp.array([1.25, 1.5]))
        -0.125
    """
    return scalar(_mean_err(*_pair(reference, approx, where)))


@jax.jit
def _rms(r, a, m):
    return jnp.sqrt(jnp.sum(jnp.where(m, jnp.square(a - r), 0)) / jnp.maximum(_count(m, r.dtype), 1))


def rms_error(reference, approx, *, where=None):
    """Root-mean-square error ``sqrt(mean((approx − reference)²))``.

    Example:
        >>> import jax.numpy as jnp
        >>> rms_error(jnp.zeros(4), jnp.array([1.0, -1.0, 1.0, -1.0]))
        1.0
    """
    return scalar(_rms(*_pair(reference, approx, where)))


def _relative(r, a):
    err = jnp.abs(a - r)
    zero = r == 0
    safe = jnp.where(zero, jnp.ones((), r.dtype), jnp.abs(r))
    return jnp.where(zero, jnp.where(err == 0, 0, jnp.inf).astype(r.dtype), err / safe)


_relative_jit = jax.jit(_relative)


def relative_error(reference, approx):
    """Elementwise ``|approx − reference| / |reference|`` (an array).

    Where ``reference`` is 0 the result is 0 if ``approx`` is 0 too, else ``inf``.

    Example:
        >>> import jax.numpy as jnp
        >>> relative_error(jnp.array([2.0, 0.0, 0.0]), jnp.array([2.5, 0.0, 1.0])).tolist()
        [0.25, 0.0, inf]
    """
    r, a, _ = _pair(reference, approx)
    return _relative_jit(r, a)


@jax.jit
def _max_rel(r, a, m):
    m = m & (r != 0)
    return jnp.max(jnp.where(m, _relative(r, a), 0), initial=0.0)


def max_rel_error(reference, approx, *, where=None):
    """Largest relative error over the selected elements with ``reference != 0`` (0 if none).

    Example:
        >>> import jax.numpy as jnp
        >>> max_rel_error(jnp.array([2.0, 4.0, 0.0]), jnp.array([2.5, 4.0, 1.0]))
        0.25
    """
    return scalar(_max_rel(*_pair(reference, approx, where)))


@jax.jit
def _mean_rel(r, a, m):
    m = m & (r != 0)
    return jnp.sum(jnp.where(m, _relative(r, a), 0)) / jnp.maximum(_count(m, r.dtype), 1)


def mean_rel_error(reference, approx, *, where=None):
    """Mean relative error over the selected elements with ``reference != 0`` (0 if none).

    Example:
        >>> import jax.numpy as jnp
        >>> mean_rel_error(jnp.array([2.0, 4.0, 0.0]), jnp.array([2.5, 4.0, 1.0]))
        0.125
    """
    return scalar(_mean_rel(*_pair(reference, approx, where)))


@jax.jit
def _rate(event, m):
    return jnp.sum(event & m).astype(jnp.float32) / jnp.maximum(jnp.sum(m), 1).astype(jnp.float32)


def underflow_rate(reference, approx, *, where=None):
    """Fraction of the (selected) elements that are nonzero in ``reference`` but 0 in ``approx``.

    Example:
        >>> import jax.numpy as jnp
        >>> import lowprec
        >>> x = jnp.array([0.0, 0.1, 0.2, 1.0])
        >>> underflow_rate(x, lowprec.quantize(x, "e2m1"))   # 0.1, 0.2 flush to 0
        0.5
    """
    r, a, m = _pair(reference, approx, where)
    return scalar(_rate((r != 0) & (a == 0), m))


def overflow_rate(reference, approx, *, where=None):
    """Fraction of the (selected) elements with a finite ``reference`` and a non-finite ``approx``.

    This is what overflow does under the IEEE-style policies: E4M3 turns |x| > 464 into NaN,
    E5M2 and FP16 turn large values into ±inf.

    Example:
        >>> import jax.numpy as jnp
        >>> import lowprec
        >>> x = jnp.array([1.0, 300.0, 500.0, 1000.0])
        >>> overflow_rate(x, lowprec.quantize(x, "e4m3"))   # 500 and 1000 become NaN
        0.5
    """
    r, a, m = _pair(reference, approx, where)
    return scalar(_rate(jnp.isfinite(r) & ~jnp.isfinite(a), m))


def nan_rate(reference, approx, *, where=None):
    """Fraction of the (selected) elements that are NaN in ``approx`` but not in ``reference``.

    Counts E4M3 overflow (NaN by default) and the elements of an MX block made NaN by an
    inf elsewhere in the block.

    Example:
        >>> import jax.numpy as jnp
        >>> nan_rate(jnp.array([1.0, jnp.nan, 3.0]), jnp.array([jnp.nan, jnp.nan, 3.0]))
        0.3333333432674408
    """
    r, a, m = _pair(reference, approx, where)
    return scalar(_rate(jnp.isnan(a) & ~jnp.isnan(r), m))


@jax.jit
def _clip(x, limit):
    return jnp.mean((jnp.abs(x) > limit).astype(jnp.float32))


def clipping_rate(x, limit):
    """Fraction of the elements of ``x`` with ``|x| > limit`` (beyond the representable range).

    Args:
      x: values before quantization.
      limit: the largest representable magnitude, a scalar (e.g. ``fmt.max_finite``) or
        an array broadcastable to ``x`` (per-block MX limits: see :func:`mx_clipping_rate`).

    Example:
        >>> import jax.numpy as jnp
        >>> clipping_rate(jnp.array([1.0, -500.0, 448.0, 449.0]), 448.0)
        0.5
    """
    return scalar(_clip(jnp.asarray(x), jnp.asarray(limit)))


_STAT_KEYS = (
    "sqnr_db",
    "max_abs_error",
    "mean_abs_error",
    "rms_error",
    "mean_error",
    "max_rel_error",
    "mean_rel_error",
    "underflow_rate",
    "overflow_rate",
    "nan_rate",
)


@jax.jit
def error_metrics(r, a):
    """Every scalar metric of :func:`error_stats` as 0-d arrays (jitted; float32 inputs)."""
    finite = jnp.isfinite(r) & jnp.isfinite(a)
    everything = jnp.ones_like(finite)
    return {
        "sqnr_db": _sqnr(r, a, finite),
        "max_abs_error": _max_abs(r, a, finite),
        "mean_abs_error": _mean_abs(r, a, finite),
        "rms_error": _rms(r, a, finite),
        "mean_error": _mean_err(r, a, finite),
        "max_rel_error": _max_rel(r, a, finite),
        "mean_rel_error": _mean_rel(r, a, finite),
        "underflow_rate": _rate((r != 0) & (a == 0) & finite, everything),
        "overflow_rate": _rate(jnp.isfinite(r) & ~jnp.isfinite(a), everything),
        "nan_rate": _rate(jnp.isnan(a) & ~jnp.isnan(r), everything),
    }


def error_stats(reference, approx) -> dict:
    """All scalar metrics at once, as a dict of Python floats in a fixed order.

    The error metrics (``sqnr_db``, ``max_abs_error``, ``mean_abs_error``, ``rms_error``,
    ``mean_error`` — the signed bias —, ``max_rel_error``, ``mean_rel_error``) are taken
    over the elements where both arrays are finite; the others are counted by
    ``overflow_rate`` (finite reference, non-finite approx) and ``nan_rate`` (NaN approx,
    non-NaN reference). The three rates, ``underflow_rate`` included, are fractions of all
    elements. So an overflow shows up as a rate instead of turning the SQNR into NaN.

    Example:
        >>> import jax.numpy as jnp
        >>> s = error_stats(jnp.array([1.0, 2.0, 500.0]), jnp.array([1.25, 1.5, jnp.nan]))
        >>> list(s)[:3]
        ['sqnr_db', 'max_abs_error', 'mean_abs_error']
        >>> s["max_abs_error"], s["mean_error"], round(s["nan_rate"], 4)
        (0.5, -0.125, 0.3333)
    """
    r, a, _ = _pair(reference, approx)
    out = error_metrics(r, a)
    return {k: scalar(out[k]) for k in _STAT_KEYS}
