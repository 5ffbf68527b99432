"""One-call comparisons of formats on an input, over seeds, with confidence intervals.

:func:`compare` quantizes an input (an array, a named distribution or a function of a seed)
to each element and MX format and returns one pandas row per configuration: SQNR, errors,
ULP quantiles on the format's own grid, clip / underflow / overflow / NaN rates and bits per
element, as the mean over seeds with a Student-t confidence interval. :func:`paired_delta`
turns per-seed results into differences against a baseline (e.g. ``floor`` − ``rceil``),
whose intervals are much tighter than those of the absolute values because every seed
compares the same data.

Power-of-two block scales make every metric periodic in log2 of the input's scale σ, so a
distribution is drawn at a phase σ = 2^p, p ∈ [0, 1), of its own per seed: by default the n
seeds of a comparison take one phase from each n-th of the octave (``phase="stratified"``,
:func:`stratified_phases`), and every estimate and interval is for the **octave mean** — the
mean over a uniform phase and the data — fitted on the first harmonics of the phase
(:func:`confidence_interval`'s ``phases``), which takes the phase's systematic effect out of
the interval instead of counting it as noise; :func:`phase_sweep` reports the range over
fixed phases instead. Every frame carries its provenance in ``attrs`` (seeds, shape, phase
mode per input, confidence level, lowprec version and commit). Key columns use nullable
dtypes (``string``, ``Int64``: <NA> where a format has no scale rule or block size);
:func:`long_format` gives the tidy long table.

pandas is an optional dependency: ``pip install 'lowprec[analysis]'``.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from .._codec import quantize
from .._blocks import normalize_axis
from .._format import ElementFormat, MXFormat, mx_format, resolve_format
from .._options import ElementCast, check_block_input
from .._scale_rules import DEFAULT_SCALE_RULE, check_scale_rule
from ._common import as_f32, provenance, require_pandas
from ._metrics import error_metrics
from ._mx_stats import roundtrip
from ._ulp import error_in_ulps, grid_max


DISTRIBUTIONS: tuple[str, ...] = (
    "gaussian",
    "laplace",
    "uniform",
    "student-t(3)",
    "lognormal",
    "gauss+outliers",
)

METRICS: tuple[str, ...] = (
    "sqnr_db",
    "max_abs_error",
    "mean_abs_error",
    "max_rel_error",
    "mean_rel_error",
    "ulp_p50",
    "ulp_p99",
    "ulp_max",
    "clip_rate",
    "underflow_rate",
    "overflow_rate",
    "nan_rate",
    "bias",
    "rmse",
    "nmse",
    "cosine",
    "matmul_rel_error",
)
_KEYS = ("input", "format", "scale_rule", "block_size")
_RATES = ("clip_rate", "underflow_rate", "overflow_rate", "nan_rate")
# Ranges a metric cannot leave: its interval is clipped to them (a t interval need not know).
_RANGES = {**{m: (0.0, 1.0) for m in _RATES}, "cosine": (-1.0, 1.0), "nmse": (0.0, math.inf),
           "rmse": (0.0, math.inf), "matmul_rel_error": (0.0, math.inf)}
# Columns other than the metrics and their intervals, in order.
_ID_COLUMNS = ("input", "format", "scale_rule", "block_size", "bits_per_element", "n_seeds",
               "seed", "phase")
_MATMUL_N = 64          # columns of the fixed Gaussian operand of matmul_rel_error
_MATMUL_SEED = 0x6D6D   # "mm"
_DEFAULT_SEEDS = 10
_T_RE = re.compile(r"student-t\(\s*([0-9]*\.?[0-9]+)\s*\)$")


# ------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------
def sample(
    distribution: str,
    shape: Sequence[int] = (128, 1024),
    *,
    seed: int = 0,
    phase: Union[float, str] = "dither",
) -> np.ndarray:
    """Draws a float32 array from a named distribution (NumPy's PCG64 generator, seeded),
    at a random scale phase unless told otherwise.

    Names: ``"gaussian"`` (standard normal), ``"laplace"`` (scale 1), ``"uniform"`` on
    [−1, 1), ``"student-t(ν)"`` for any ν > 0 (heavy tails: finite variance needs ν > 2),
    ``"lognormal"`` (exp of a standard normal, random sign) and ``"gauss+outliers"``
    (standard normal with 0.1 % of the entries multiplied by 100).

    **The draw is scaled by σ = 2^p** (computed in float64, rounded once to float32), p the
    ``phase``. With power-of-two scales (every MX format, and element formats away from
    their range limits) every metric is periodic in log2 σ with period 1, and σ = 1 is one
    point of that period — a special one, where block maxima of uniform data sit just
    below a power of two. So by default (``phase="dither"``) p is drawn uniformly in
    [0, 1) from a stream of ``seed`` of its own (:func:`phase_of`): the values are those
    of the unit-scale draw times 2^p, and a study over seeds samples the octave. One array
    is still one phase: average over seeds, or use :func:`compare`, whose stratified phases
    give the octave mean with a tight interval, or :func:`phase_sweep` for the range.

    Args:
      distribution: one of the names above.
      shape: the shape drawn.
      seed: seed of the generator.
      phase: ``"dither"`` (default: p uniform in [0, 1), fixed by ``seed``), or a number p
        (``0.0``: the unit scale, NumPy's own draw; ``None`` means 0.0 too).

    Example:
        >>> x = sample("student-t(3)", (4, 32), seed=1)
        >>> x.shape, x.dtype.name
        ((4, 32), 'float32')
        >>> bool((sample("gaussian", (8,), seed=3) == sample("gaussian", (8,), seed=3)).all())
        True
        >>> p = phase_of("dither", 3)          # in [0, 1), fixed by the seed
        >>> unit = sample("gaussian", (8,), seed=3, phase=0.0)   # standard normal
        >>> bool(np.allclose(sample("gaussian", (8,), seed=3), unit * 2.0**p, rtol=1e-6))
        True
    """
    p = phase_of(phase, seed)
    rng = np.random.default_rng(seed)
    shape = tuple(int(s) for s in shape)
    name = distribution.strip().lower()
    if name in ("gaussian", "normal"):
        x = rng.standard_normal(shape)
    elif name == "laplace":
        x = rng.laplace(size=shape)
    elif name == "uniform":
        x = rng.uniform(-1.0, 1.0, shape)
    elif name == "lognormal":
        x = np.exp(rng.standard_normal(shape)) * rng.choice([-1.0, 1.0], shape)
    elif name == "gauss+outliers":
        x = rng.standard_normal(shape) * np.where(rng.random(shape) < 1e-3, 100.0, 1.0)
    elif _T_RE.match(name):
        dof = float(_T_RE.match(name).group(1))
        if dof <= 0:
            raise ValueError(f"student-t needs ν > 0, got {distribution!r}")
        x = rng.standard_t(dof, shape)
    else:
        raise ValueError(
            f"unknown distribution {distribution!r}; valid: {', '.join(DISTRIBUTIONS)} "
            "(student-t takes any ν, e.g. 'student-t(5)'), or pass an array or a function of "
            "a seed"
        )
    if p:
        x = x * 2.0**p
    return x.astype(np.float32)


_PHASE_STREAM = 0x70686173   # "phas": the phase's own stream, independent of the draw's


def phase_of(phase: Union[None, float, str], seed: Optional[int] = 0) -> float:
    """The log2 scale factor that ``phase`` means for ``seed`` (see :func:`sample`).

    None → 0.0; a finite number → itself; ``"dither"`` → a uniform draw in [0, 1) from
    NumPy's PCG64 seeded with ``(seed, 0x70686173)``, a stream separate from the data's.
    (``"stratified"`` phases depend on every seed of a study: :func:`stratified_phases`.)

    Example:
        >>> phase_of(None), phase_of(0.25)
        (0.0, 0.25)
        >>> 0 <= phase_of("dither", 7) < 1 and phase_of("dither", 7) == phase_of("dither", 7)
        True
    """
    if phase is None:
        return 0.0
    if isinstance(phase, str):
        if phase == "stratified":
            raise ValueError(
                "phase='stratified' depends on all the seeds of a study, not on one: use "
                "stratified_phases(seeds), or compare(..., phase='stratified')"
            )
        if phase != "dither":
            raise ValueError(
                "phase must be None, a number (log2 of the scale), 'dither' or 'stratified', "
                f"got {phase!r}"
            )
        if seed is None or int(seed) < 0:
            raise ValueError(f"phase='dither' needs a non-negative integer seed, got {seed!r}")
        return float(np.random.default_rng([int(seed), _PHASE_STREAM]).random())
    p = float(phase)
    if not math.isfinite(p):
        raise ValueError(f"phase must be finite (log2 of the scale), got {phase!r}")
    return p


def stratified_phases(seeds: Iterable[int]) -> np.ndarray:
    """One scale phase per seed, the i-th of n seeds in the i-th n-th of the octave.

    ``p_i = (i + u_i) / n`` with u_i = ``phase_of("dither", seed_i)``: each seed keeps a
    random position, but the n phases cover [0, 1) evenly (stratified sampling), so the mean
    over seeds of a metric that is periodic in log2 σ estimates its octave mean with much
    less variance than n independent phases, and the harmonic fit of
    :func:`confidence_interval` (``phases``) is well conditioned (the default of
    :func:`compare` for distributions).
    The phases depend on the seeds and their order only: every study run with the same
    seeds sees the same phases — harmless once they are spread, one per n-th of the octave.

    Example:
        >>> p = stratified_phases(range(4))
        >>> [int(k) for k in p * 4]            # one phase in each quarter
        [0, 1, 2, 3]
        >>> float(p[1]) == (1 + phase_of("dither", 1)) / 4
        True
    """
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("stratified_phases needs at least one seed")
    n = len(seeds)
    return np.array([(i + phase_of("dither", s)) / n for i, s in enumerate(seeds)])


def row_subsets(x, n: int, *, size: Optional[int] = None, seed: int = 0) -> Callable[[int], np.ndarray]:
    """Splits the rows (axis 0) of a fixed array into ``n`` disjoint random subsets.

    Returns a function ``i ↦ x[rows of subset i]`` for ``i`` in ``range(n)``: pass it to
    :func:`compare` with ``seeds=range(n)`` to put an interval on the metrics of a fixed
    (e.g. real) tensor — the spread over independent parts of it. Rows are kept whole, so
    MX blocks along the last axis are the tensor's own blocks (reshape a tensor to
    ``(-1, 32)`` to sample its blocks).

    Args:
      x: an array with at least two axes.
      n: number of subsets.
      size: rows per subset (``n * size`` rows are used); default: all rows, split as
        evenly as possible. Equal sizes give equal shapes, so :func:`compare` compiles once.
      seed: seed of the random assignment of rows to subsets.

    Example:
        >>> import numpy as np
        >>> parts = row_subsets(np.arange(12.0).reshape(6, 2), 3)
        >>> sorted(np.concatenate([parts(i)[:, 0] for i in range(3)]).tolist())
        [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        >>> row_subsets(np.zeros((10, 32)), 3, size=3)(2).shape
        (3, 32)
    """
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"row_subsets needs a 2-D or larger array, got shape {x.shape}")
    if not 1 <= n <= x.shape[0]:
        raise ValueError(f"n must be between 1 and the number of rows {x.shape[0]}, got {n}")
    order = np.random.default_rng(seed).permutation(x.shape[0])
    if size is None:
        parts = np.array_split(order, n)
    else:
        if size < 1 or n * size > x.shape[0]:
            raise ValueError(
                f"{n} subsets of {size} rows need {n * size} rows; x has {x.shape[0]}"
            )
        parts = [order[i * size:(i + 1) * size] for i in range(n)]

    def subset(i: int) -> np.ndarray:
        if not 0 <= i < n:
            raise ValueError(f"subset index must be in range({n}), got {i}")
        return x[np.sort(parts[i])]

    subset.__name__ = f"row_subsets(n={n})"
    return subset


# ------------------------------------------------------------------------------------------
# confidence intervals
# ------------------------------------------------------------------------------------------
def _t_two_sided_mass(t: float, dof: int) -> float:
    """P(|T| ≤ t) for Student's t with integer ``dof`` (Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(dof))
    c2 = math.cos(theta) ** 2
    if dof % 2:  # odd: (2/π)(θ + sinθ cosθ Σ_k a_k cos^(2k)θ), a_0 = 1, a_k = a_{k-1}·2k/(2k+1)
        term, total = 1.0, 1.0
        for k in range(1, (dof - 1) // 2):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        s = math.sin(theta) * math.cos(theta) * total if dof > 1 else 0.0
        return 2 / math.pi * (theta + s)
    term, total = 1.0, 1.0  # even: sinθ Σ_k b_k cos^(2k)θ, b_0 = 1, b_k = b_{k-1}(2k−1)/(2k)
    for k in range(1, dof // 2):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


@functools.lru_cache(maxsize=None)
def _t_quantile(level: float, dof: int) -> float:
    """t such that P(|T| ≤ t) = level (bisection to 1e-12)."""
    lo, hi = 0.0, 1.0
    while _t_two_sided_mass(hi, dof) < level:
        hi *= 2
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_two_sided_mass(mid, dof) < level:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


def confidence_interval(values, level: float = 0.95, *, phases=None,
                        harmonics: int = 2) -> tuple[float, float, float]:
    """``(estimate, low, high)``: Student-t confidence interval for the mean of ``values``.

    Without ``phases``: the mean, and the half width t·s/√n with s the sample standard
    deviation (ddof = 1) and t the two-sided ``level`` quantile of Student's t with n − 1
    degrees of freedom (independent values).

    With ``phases`` (the scale phase p_i ∈ [0, 1) each value was measured at, as
    :func:`compare` draws them): the values are taken as y_i = f(p_i) + e_i, f periodic in
    the phase (a metric of power-of-two scales is) and e_i independent noise, and the
    target is the **octave mean** ∫₀¹ f(p) dp + E[e]. The estimate is the intercept of the
    least-squares fit of y on 1, cos 2πkp, sin 2πkp for k = 1 … K — the mean corrected by
    control variates whose octave mean is 0 — with its ordinary least-squares standard error
    on n − 2K − 1 degrees of freedom. K is ``harmonics`` (default 2) or less, so that at
    least 3 degrees of freedom remain (K = 2 from 8 values, 1 from 6, none below). Where f
    varies over the octave (floor − rceil of MXFP4 on Gaussian data moves by 0.4 dB), the
    independent interval counts that systematic spread as noise; this one removes the part
    the harmonics explain. Its coverage is checked by simulation in the test suite
    (periodic f of several shapes, kinks included, stratified and independent phases).

    One value gives NaN bounds; a non-finite value gives a non-finite estimate and NaN bounds.

    Example:
        >>> m, lo, hi = confidence_interval([1.0, 2.0, 3.0])   # s = 1, t(0.975, 2) = 4.303
        >>> m, round(hi - m, 3)
        (2.0, 2.484)
        >>> p = np.arange(8) / 8                                 # y = 1 + 0.3 cos 2πp exactly
        >>> m, lo, hi = confidence_interval(1 + 0.3 * np.cos(2 * np.pi * p), phases=p)
        >>> round(m, 12), round(hi - lo, 12)                    # the octave mean, no noise
        (1.0, 0.0)
    """
    v = np.asarray(values, np.float64).ravel()
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if v.size == 0:
        raise ValueError("confidence_interval needs at least one value")
    design = None if phases is None else _harmonic_design(phases, v.size, harmonics)
    if v.size == 1 or not np.all(np.isfinite(v)):
        return float(np.mean(v)), math.nan, math.nan
    if design is None:
        mean = float(np.mean(v))
        half = _t_quantile(float(level), v.size - 1) * float(np.std(v, ddof=1)) / math.sqrt(v.size)
        return mean, mean - half, mean + half
    coef, *_ = np.linalg.lstsq(design, v, rcond=None)
    resid = v - design @ coef
    dof = v.size - design.shape[1]
    se = math.sqrt(float(resid @ resid) / dof * float(np.linalg.inv(design.T @ design)[0, 0]))
    half = _t_quantile(float(level), dof) * se
    est = float(coef[0])
    return est, est - half, est + half


def _harmonic_design(phases, n: int, harmonics: int) -> Optional[np.ndarray]:
    """The regression matrix [1, cos 2πkp, sin 2πkp]_{k ≤ K} of :func:`confidence_interval`,
    or None where no harmonic fits (fewer than 6 values, or phases too few and alike)."""
    p = np.asarray(phases, np.float64).ravel()
    if p.size != n:
        raise ValueError(f"phases must give one phase per value: {p.size} phases, {n} values")
    if not np.all(np.isfinite(p)):
        raise ValueError(f"phases must be finite, got {p.tolist()}")
    if not (isinstance(harmonics, (int, np.integer)) and harmonics >= 0):
        raise ValueError(f"harmonics must be a non-negative integer, got {harmonics!r}")
    k = min(int(harmonics), (n - 4) // 2)   # at least 3 degrees of freedom left
    while k > 0:
        cols = [np.ones(n)]
        for j in range(1, k + 1):
            cols += [np.cos(2 * np.pi * j * p), np.sin(2 * np.pi * j * p)]
        design = np.stack(cols, axis=1)
        if np.linalg.matrix_rank(design) == design.shape[1]:
            return design
        k -= 1
    return None


# ------------------------------------------------------------------------------------------
# the per-configuration evaluation
# ------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=3)
def _ulps_and_clip(x, q, s, elem):
    """ULP errors on the (scaled) element grid, NaN where q or x is not finite; clip rate."""
    finite = jnp.isfinite(x) & jnp.isfinite(q)
    ulps = jnp.where(finite, error_in_ulps(elem, x, q, s), jnp.nan)
    clip = jnp.mean((jnp.isfinite(x) & (jnp.abs(x) > grid_max(elem, s))).astype(jnp.float32))
    return ulps.ravel(), clip


@jax.jit
def _power_sums(r, a):
    """Σr², Σ(a−r)², Σa², Σra over the finite pairs (after dividing by max|r|, so no square
    overflows), and the number of finite pairs."""
    finite = jnp.isfinite(r) & jnp.isfinite(a)
    r0, a0 = jnp.where(finite, r, 0.0), jnp.where(finite, a, 0.0)
    scale = jnp.max(jnp.abs(r0), initial=0.0)
    scale = jnp.where(scale > 0, scale, 1.0)
    r0, a0 = r0 / scale, a0 / scale
    return (jnp.sum(r0 * r0), jnp.sum(jnp.square(a0 - r0)), jnp.sum(a0 * a0), jnp.sum(r0 * a0),
            jnp.sum(finite))


def _quantized(x, fmt, scale_rule, axis, rounding, overflow, key):
    """(fake-quantized x, per-element scale or None, element format)."""
    if isinstance(fmt, MXFormat):
        q, s = roundtrip(x, fmt, axis, scale_rule, rounding, key)
        return q, s, fmt.element
    q = quantize(x, fmt, rounding=rounding, overflow=overflow, key=key, dtype=jnp.float32)
    return q, None, fmt


def _evaluate(x, fmt, scale_rule, axis, rounding, overflow, key):
    # Built from lowprec's own jitted kernels (one compile per format and rule) and small
    # jitted tails shared by all configurations of a shape, rather than one big jit per
    # configuration: compilation, not arithmetic, dominates a comparison on CPU.
    q, s, elem = _quantized(x, fmt, scale_rule, axis, rounding, overflow, key)
    stats = dict(error_metrics(x, q))
    ulps, stats["clip_rate"] = _ulps_and_clip(x, q, s, elem)
    stats["_sums"] = _power_sums(x, q)
    # ULP quantiles are taken on the host: NumPy's partition-based quantile is O(n), XLA's
    # CPU sort is not (it dominated the whole evaluation).
    return stats, ulps, q


def _rows(a, axis: int) -> np.ndarray:
    """float32 [rows, K] view of ``a`` with ``axis`` (length K) last."""
    a = np.asarray(a, np.float32)
    return np.moveaxis(a, axis, -1).reshape(-1, a.shape[axis])


@functools.lru_cache(maxsize=16)
def _gaussian_operand(shape: tuple, axis: int) -> np.ndarray:
    """A fixed standard Gaussian float32 array of ``shape`` (seeded by the shape)."""
    return np.random.default_rng([*shape, _MATMUL_SEED]).standard_normal(shape).astype(np.float32)


@functools.lru_cache(maxsize=64)
def _matmul_operand(fmt, scale_rule, shape: tuple, axis: int, rounding: str, overflow: str):
    """(q(W), q(W) − W), float32 [K, n]: W's columns are the first n ≤ 64 length-K rows (along
    ``axis``) of :func:`_gaussian_operand`, quantized with the same configuration as x.
    Quantizing an array of x's own shape and axis reuses the kernels already compiled for x (a
    [K, 64] operand would compile them again); rows are independent blocks, so only NVFP4's
    one tensor scale sees the rows beyond the first 64. Cached per configuration and shape."""
    w = _gaussian_operand(shape, axis)
    key = jax.random.key(_MATMUL_SEED) if rounding == "stochastic" else None
    qw, _, _ = _quantized(jax.device_put(w), fmt, scale_rule, axis, rounding, overflow, key)
    w, qw = _rows(w, axis)[:_MATMUL_N].T, _rows(qw, axis)[:_MATMUL_N].T
    return qw, qw - w          # the difference is exact in float32 (a rounding to a coarser grid)


class _MatmulReference:
    """x's side of ``matmul_rel_error``, shared by every configuration of one input: x as
    [rows, K] float32, its rows without a non-finite value, and ‖x·W‖ over them."""

    def __init__(self, x, axis: int):
        self.axis, self.shape = axis, tuple(x.shape)
        self.x = _rows(x, axis)
        self.finite = np.isfinite(self.x).all(axis=1)
        self._norms = {}

    def norm(self, rows) -> float:
        key = rows.tobytes()
        if key not in self._norms:
            w = _rows(_gaussian_operand(self.shape, self.axis), self.axis)[:_MATMUL_N].T
            self._norms[key] = float(np.linalg.norm((self.x[rows] @ w).astype(np.float64)))
        return self._norms[key]

    def rel_error(self, q, fmt, scale_rule, rounding, overflow) -> float:
        """‖q(x)·q(W) − x·W‖_F / ‖x·W‖_F over the rows where x and q are finite (NaN if none).

        q(x)q(W) − xW = (q(x) − x)·q(W) + x·(q(W) − W): both differences are exact in
        float32, so the float32 products give the error to about 1e-6 of itself, without
        the cancellation of subtracting two nearly equal products."""
        qw, ew = _matmul_operand(fmt, scale_rule, self.shape, self.axis, rounding, overflow)
        q = _rows(q, self.axis)
        rows = self.finite & np.isfinite(q).all(axis=1)
        if not rows.any() or not np.isfinite(qw).all():
            return math.nan
        x, q = (self.x, q) if rows.all() else (self.x[rows], q[rows])
        err = (q - x) @ qw + x @ ew
        norm = self.norm(rows)
        return float(np.linalg.norm(err.astype(np.float64))) / norm if norm > 0 else math.nan


def _metrics_row(stats, ulps, matmul: float) -> dict:
    ulps = np.asarray(ulps, np.float64)
    ulps = ulps[np.isfinite(ulps)]
    if ulps.size:
        p50, p99 = np.quantile(ulps, [0.5, 0.99])
        top = ulps.max()
    else:
        p50 = p99 = top = math.nan
    row = {m: float(stats[m]) for m in METRICS if m in stats}
    row.update(ulp_p50=float(p50), ulp_p99=float(p99), ulp_max=float(top),
               bias=float(stats["mean_error"]), rmse=float(stats["rms_error"]),
               matmul_rel_error=matmul)
    signal, noise, qq, cross, n = (float(v) for v in stats["_sums"])
    row["nmse"] = noise / signal if signal > 0 else math.nan
    row["cosine"] = cross / math.sqrt(signal * qq) if signal > 0 and qq > 0 else math.nan
    if n == 0:   # nothing finite to score (e.g. everything overflowed): errors are undefined
        for m in ("sqnr_db", "max_abs_error", "mean_abs_error", "max_rel_error",
                  "mean_rel_error", "bias", "rmse"):
            row[m] = math.nan
    elif signal == 0:   # an all-zero signal: a ratio to it is undefined, not +inf
        row["sqnr_db"] = math.nan
    return {m: row[m] for m in METRICS}


# Nullable dtypes: an element format has no scale rule nor block size (<NA>), an array input
# no seed; never an object column holding None.
_DTYPES = {"input": "string", "format": "string", "scale_rule": "string", "block_size": "Int64",
           "bits_per_element": "float64", "n_seeds": "int64", "seed": "Int64", "phase": "float64",
           "baseline": "string", "metric": "string"}


def _frame(records, columns=None):
    """DataFrame of ``records`` with the key columns in nullable dtypes, the rest float64."""
    pd = require_pandas("compare")
    frame = pd.DataFrame.from_records(records, columns=columns)
    for col in frame.columns:
        dtype = _DTYPES.get(col, "float64")
        if col == "baseline" and all(isinstance(v, (int, np.integer)) for v in frame[col]):
            dtype = "Int64"   # paired over block sizes: the baseline is a size
        if col in _DTYPES and dtype in ("string", "Int64"):
            values = [None if _is_missing(v) else v for v in frame[col].tolist()]
            frame[col] = pd.array(values, dtype=dtype)
        else:
            frame[col] = frame[col].astype(dtype)
    return frame


def _is_missing(v) -> bool:
    if v is None:
        return True
    try:
        return bool(require_pandas("compare").isna(v))
    except (TypeError, ValueError):
        return False


def _inputs(x) -> dict:
    if isinstance(x, Mapping):
        if not x:
            raise ValueError("x is an empty mapping; give at least one input")
        return {str(k): v for k, v in x.items()}
    if isinstance(x, str):
        return {x: x}
    if callable(x):
        return {getattr(x, "__name__", "callable"): x}
    return {"array": x}


def _configs(formats, scale_rules, block_sizes):
    if isinstance(formats, (str, ElementFormat, MXFormat)):
        formats = [formats]
    if isinstance(scale_rules, str):
        scale_rules = [scale_rules]
    if block_sizes is None or isinstance(block_sizes, int):
        block_sizes = [block_sizes]
    scale_rules = [check_scale_rule(rule).value for rule in scale_rules]
    out = []
    for f in formats:
        fmt = resolve_format(f)
        if isinstance(fmt, ElementFormat):
            out.append((fmt, None, None, fmt.code_bits))
            continue
        for bs in block_sizes:
            mfmt = mx_format(fmt, bs)
            # NVFP4 has its own scale recipe: one row, no rule (<NA>), never a made-up one.
            rules = scale_rules if mfmt.scheme.takes_scale_rule else [None]
            for rule in rules:
                out.append((mfmt, rule, mfmt.block_size, mfmt.bits_per_element))
    if not out:
        raise ValueError("no configuration to compare: give at least one format")
    return out


def _check_data(data, label: str, configs, axis, pad: bool) -> int:
    """Validates one evaluated input; returns the normalized block axis."""
    if data.ndim == 0:
        raise ValueError(f"input {label!r} is a scalar; compare needs an array")
    ax = normalize_axis(axis, data.ndim)
    if data.size == 0:
        raise ValueError(
            f"input {label!r} is empty (shape {tuple(data.shape)}); compare needs at least one "
            "element (an empty input has no SQNR)"
        )
    if not np.isfinite(np.asarray(data)).any():   # on the host: no program per shape
        raise ValueError(
            f"input {label!r} has no finite element (all NaN/inf); there is nothing to score — "
            "compare measures errors over the finite elements"
        )
    for fmt, *_ in configs:   # the rule of quantize_mx: a partial block needs pad=True
        if isinstance(fmt, MXFormat):
            check_block_input(data.shape, np.float32, fmt, ax, pad, "compare")
    return ax


def _scaled(data, p: float):
    """data × 2^p, in float64 and rounded once to float32 (unchanged for p = 0)."""
    if not p:
        return data
    return jax.device_put((np.asarray(data, np.float64) * 2.0**p).astype(np.float32))


def compare(
    x,
    formats,
    *,
    scale_rules: Union[str, Iterable[str]] = (DEFAULT_SCALE_RULE.value, "rceil"),
    block_sizes: Union[None, int, Iterable[int]] = None,
    seeds: Union[None, int, Iterable[int]] = None,
    shape: Sequence[int] = (128, 1024),
    axis: int = -1,
    rounding: str = "nearest_even",
    overflow: str = "ieee",
    level: float = 0.95,
    per_seed: bool = False,
    phase: Union[None, float, str] = None,
    pad: bool = False,
):
    """Compares formats on an input: one pandas row per format × scale rule × block size.

    Columns: ``input``, ``format``, ``scale_rule`` and ``block_size`` (nullable ``string``
    and ``Int64``: <NA> for element formats; ``scale_rule`` is <NA> for NVFP4 too, whose block
    scales follow its own recipe), ``bits_per_element`` (block scale included, NVFP4's one
    tensor scale not), ``n_seeds``, then the metrics —
    ``sqnr_db``, ``max_abs_error``, ``mean_abs_error``, ``max_rel_error``,
    ``mean_rel_error`` (over the elements whose quantized value is finite), ``ulp_p50``,
    ``ulp_p99``, ``ulp_max`` (ULP error quantiles on the format's grid — for MX the element
    grid scaled by each block's exponent), ``clip_rate`` (|x| beyond the largest value of its
    grid), ``underflow_rate`` (nonzero → 0), ``overflow_rate`` (finite → inf or NaN, e.g. E4M3
    |x| > 464 under the default ``overflow="ieee"``), ``nan_rate`` (→ NaN), ``bias`` (mean of
    q − x), ``rmse``, ``nmse`` (Σ(q − x)² / Σx² = 10^(−SQNR/10)), ``cosine`` (cosine similarity
    of q and x) and ``matmul_rel_error``: ‖q(x)·q(W) − x·W‖_F / ‖x·W‖_F for a fixed standard
    Gaussian W of shape [K, n ≤ 64] (its columns the first rows of a seeded Gaussian array of
    x's own shape), quantized with the same configuration along the block axis of x, which the
    product contracts (length K; blocks of both operands along it, as in an MX matmul). It is
    formed from the exact differences q(x) − x and q(W) − W, so only the quantization of the
    two operands counts, not the arithmetic of the product. The error metrics are taken over the
    finite pairs (rows of finite pairs for the matmul); where no pair is finite they are NaN,
    and a signal of zeros has SQNR/NMSE/cosine NaN (undefined), never +inf.
    With several seeds each metric is the mean over seeds, with ``<metric>_lo`` /
    ``<metric>_hi`` columns bounding a ``level`` confidence interval (Student t; clipped to
    the metric's range: rates to [0, 1], cosine to [−1, 1]).

    **Scale phase.** MX scales are powers of two, so every metric is periodic in log2 of the
    input's scale σ with period 1, and a distribution drawn at σ = 1 measures one phase of
    that period only: MXFP8 E4M3 floor − rceil on Gaussian data runs from about −0.6 to −1.4
    dB over an octave of σ. So by default a distribution name is drawn at σ = 2^p with the n
    seeds' phases stratified over the octave (``phase="stratified"``: seed i of n in [i/n,
    (i+1)/n), see :func:`stratified_phases`), and each estimate and interval is **for the
    octave mean** — the metric's mean over a uniform phase and the data — from a fit on the
    first harmonics of the phase (:func:`confidence_interval`); arrays and functions keep
    their own scale. ``phase=0.0`` gives the unit scale; a number p scales every input by
    2^p; ``"dither"`` draws each seed's phase independently (less evenly spread);
    ``"stratified"`` and ``"dither"`` apply to arrays and functions too (then seeds vary the
    phase). :func:`phase_sweep` reports the range over phases instead of the mean. The
    frame's ``attrs`` record the seeds and phase mode of each input, the shape drawn, the
    level, lowprec's version and the git commit it ran from.

    Args:
      x: the input: an array (evaluated once), a distribution name (see :func:`sample`;
        drawn with ``shape`` for each seed), a function ``seed -> array``, or a mapping
        label → any of these to compare several inputs (the ``input`` column).
      formats: format names or objects, element and MX mixed.
      scale_rules: the MX scale rules to try (not applied to element formats, nor to NVFP4,
        which gets one row with ``scale_rule`` <NA>).
      block_sizes: block sizes to try for every block format (powers of two 2..1024,
        ``lowprec.BLOCK_SIZES``; FP6 needs at least 4); None (default): each format's own
        (32 for OCP MX, 16 for NVFP4). A size given this way appears in the format's name
        (``"mxfp4_b16"``) as well as in ``block_size``.
      seeds: an int n (``range(n)``) or the seeds themselves. Default: 10 seeds for a
        distribution name, a function or an input at a random phase, one evaluation for an
        array (then seeds are only allowed with ``rounding="stochastic"``, where they seed
        the rounding, or with a random phase).
      shape: the shape drawn for a distribution name.
      axis: the MX block axis (and the contraction axis of ``matmul_rel_error``); out of
        range raises.
      rounding, overflow: element rounding mode and overflow policy (MX elements always
        saturate). ``rounding="stochastic"`` uses ``jax.random.key(seed)``.
      level: confidence level of the intervals.
      per_seed: return one row per seed (``seed`` and ``phase`` columns, no intervals)
        instead; feed it to :func:`summarize` or :func:`paired_delta`.
      phase: the scale phase (above): None (default: stratified for distribution names,
        the own scale for arrays and functions), a number, ``"stratified"`` or ``"dither"``.
      pad: zero-pad a block axis whose length is not a multiple of the block size; without
        it such an input raises, as in :func:`lowprec.quantize_mx`.

    Returns:
      A pandas DataFrame.

    Example:
        >>> import numpy as np
        >>> df = compare("gaussian", ["e4m3", "mxfp4"], scale_rules=["floor", "rceil"],
        ...              seeds=3, shape=(8, 256))
        >>> df[["format", "scale_rule", "block_size"]].astype(object).fillna("-").values.tolist()
        [['e4m3', '-', '-'], ['mxfp4', 'floor', 32], ['mxfp4', 'rceil', 32]]
        >>> df["bits_per_element"].tolist(), df["n_seeds"].tolist()
        ([8.0, 4.25, 4.25], [3, 3, 3])
        >>> bool((df["sqnr_db_lo"] < df["sqnr_db"]).all())
        True
        >>> sweep = compare("gaussian", ["mxint8", "nvfp4"], scale_rules="rceil",
        ...                 block_sizes=[16, 64], seeds=2, shape=(8, 256))
        >>> sweep["format"].tolist(), sweep["block_size"].tolist()
        (['mxint8_b16', 'mxint8_b64', 'nvfp4', 'nvfp4_b64'], [16, 64, 16, 64])
        >>> big = compare(np.array([1.0, 500.0, 2.0, 3.0], np.float32), "e4m3")
        >>> big[["overflow_rate", "nan_rate"]].values.tolist()   # 500 -> NaN, counted
        [[0.25, 0.25]]
    """
    inputs = _inputs(x)
    configs = _configs(formats, scale_rules, block_sizes)
    for fmt, *_ in configs:   # validate the options once, before any work
        ElementCast(fmt.element if isinstance(fmt, MXFormat) else fmt, rounding, overflow)
    if phase is not None and phase != "stratified":
        phase_of(phase, 0)    # a bad phase fails before any work
    rows, seeds_of, phase_mode = [], {}, {}
    for label, source in inputs.items():
        is_array = not isinstance(source, str) and not callable(source)
        # None: stratify what is drawn at an arbitrary scale (a distribution name) only.
        src_phase = ("stratified" if isinstance(source, str) else None) if phase is None else phase
        random_phase = src_phase in ("dither", "stratified")
        varies = not is_array or rounding == "stochastic" or random_phase
        if seeds is None:
            seed_list = list(range(_DEFAULT_SEEDS)) if varies and (
                not is_array or random_phase) else [None]
        else:
            seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
            if not seed_list:
                raise ValueError("seeds is empty; give at least one seed")
            if not varies:
                raise ValueError(
                    f"seeds only vary a generated input (a distribution name or a function of "
                    f"a seed), stochastic rounding or a random phase; input {label!r} is a "
                    "fixed array. Drop seeds, or pass row_subsets(x, n) with seeds=range(n) "
                    "for an interval over parts of it"
                )
        if src_phase == "stratified":
            phases = stratified_phases(seed_list)
        else:
            phases = [phase_of(src_phase, s) for s in seed_list]
        seeds_of[label] = tuple(seed_list)
        phase_mode[label] = src_phase
        for seed, p in zip(seed_list, phases):
            p = float(p)
            if isinstance(source, str):
                data = sample(source, shape, seed=seed, phase=p)
            else:
                data = _scaled(as_f32(source(seed) if callable(source) else source), p)
            data = as_f32(data)
            ax = _check_data(data, label, configs, axis, pad)
            key = jax.random.key(0 if seed is None else seed) if rounding == "stochastic" else None
            mm_ref = _MatmulReference(np.asarray(data), ax)
            for fmt, rule, bs, bits in configs:
                stats, ulps, q = jax.device_get(
                    _evaluate(data, fmt, rule, ax, rounding, overflow, key))
                mm = mm_ref.rel_error(q, fmt, rule, rounding, overflow)
                rows.append({"input": label, "format": fmt.name, "scale_rule": rule,
                             "block_size": bs, "bits_per_element": float(bits), "seed": seed,
                             "phase": p, **_metrics_row(stats, ulps, mm)})
    frame = _frame(rows)
    frame.attrs.update(
        level=level, seeds=seeds_of, phase=phase_mode,
        shape=tuple(int(d) for d in shape) if any(isinstance(v, str) for v in inputs.values())
        else None,
        **provenance())
    if per_seed:
        return frame
    return summarize(frame, level=level)


def _key_value(v):
    """A groupby key as a plain Python value (None for a missing one)."""
    if _is_missing(v):
        return None
    return v.item() if isinstance(v, np.generic) else v


def summarize(per_seed_frame, *, level: float = 0.95):
    """Aggregates :func:`compare`'s ``per_seed=True`` output: mean and interval per configuration.

    Each ``<metric>_lo`` / ``_hi`` pair bounds a ``level`` interval **for the mean** over
    the seeds of the configuration — with random phases, for the octave mean (the mean over
    a uniform scale phase and the data), not a range that single phases or seeds stay in
    (:func:`phase_sweep` gives that). Where the seeds were drawn at different phases, the
    estimate and its interval come from the harmonic fit of :func:`confidence_interval`
    (``phases``); otherwise they are the mean and the independent interval. The frame's
    ``attrs`` keep the input's provenance (seeds, shape, phase modes, lowprec version and
    commit) and say which interval it is.

    Example:
        >>> runs = compare("laplace", "mxfp8_e4m3", scale_rules="rceil", seeds=4,
        ...                shape=(8, 256), per_seed=True)
        >>> len(runs), len(summarize(runs))
        (4, 1)
        >>> sorted(summarize(runs).attrs["phase"].items()), summarize(runs).attrs["seeds"]
        ([('laplace', 'stratified')], {'laplace': (0, 1, 2, 3)})
    """
    frame = per_seed_frame
    metrics = [m for m in METRICS if m in frame]
    out = []
    for keys, group in frame.groupby(list(_KEYS), dropna=False, sort=False):
        row = {k: _key_value(v) for k, v in zip(_KEYS, keys)}
        row["bits_per_element"] = float(group["bits_per_element"].iloc[0])
        row["n_seeds"] = int(len(group))
        phases = _group_phases(group)
        for m in metrics:
            mean, lo, hi = confidence_interval(group[m].to_numpy(np.float64), level, phases=phases)
            row[m] = mean
            if len(group) > 1:
                low, high = _RANGES.get(m, (-math.inf, math.inf))
                row[m + "_lo"], row[m + "_hi"] = max(lo, low), min(hi, high)
        out.append(row)
    result = _frame(out)
    result.attrs.update(per_seed_frame.attrs)
    result.attrs.update(level=level, interval=_interval_note(level))
    return result


def _interval_note(level: float) -> str:
    return (f"{100 * level:g} % Student-t interval for the mean over seeds; where the seeds "
            "were drawn at different scale phases, for the octave mean (estimate and interval "
            "from a least-squares fit on the first two harmonics of the phase)")


def _group_phases(group) -> Optional[np.ndarray]:
    """The phases of a group's rows when they are all different (a random phase per seed),
    else None (a fixed phase, or an input's own scale: independent values)."""
    if "phase" not in group:
        return None
    ph = group["phase"].to_numpy(np.float64)
    if ph.size < 2 or not np.all(np.isfinite(ph)) or np.unique(ph).size < ph.size:
        return None
    return ph


def _equals(series, value) -> np.ndarray:
    """``series == value`` as a plain bool array (<NA> compares unequal)."""
    return np.asarray(series.eq(value).fillna(False), bool)


def paired_delta(
    per_seed_frame,
    *,
    metric: str = "sqnr_db",
    within: str = "scale_rule",
    baseline: str = "rceil",
    level: float = 0.95,
):
    """Per-seed differences against a baseline, with a confidence interval: ``value − baseline``.

    Rows of :func:`compare`'s ``per_seed=True`` output that agree on every key column
    (``input``, ``format``, ``scale_rule``, ``block_size``) except ``within`` are paired seed
    by seed (with ``within="block_size"``, formats are matched without their ``_b<size>``
    suffix) with the row whose ``within`` equals ``baseline``. Pairing removes the spread of
    the data itself (and of a dithered scale phase: a seed fixes its phase), so a small but
    systematic difference gets a tight interval.

    The interval is for the mean difference over the paired seeds — with random phases,
    the octave mean, from the harmonic fit on the seeds' phases (see :func:`summarize`).

    Returns:
      A DataFrame with the key columns, ``baseline``, ``n_seeds``, ``delta`` (mean
      difference), ``delta_lo`` and ``delta_hi``; groups without a baseline row are left out.
      Its ``attrs`` are the input's (provenance) and the interval's description.

    Raises:
      ValueError: ``baseline`` is not a value of the ``within`` column (a typo would
        otherwise give an empty frame); the message lists the values present.

    Example:
        >>> runs = compare("gaussian", "mxfp8_e4m3", scale_rules=["floor", "rceil"],
        ...                seeds=5, shape=(8, 256), per_seed=True)
        >>> d = paired_delta(runs, metric="sqnr_db", within="scale_rule", baseline="rceil")
        >>> d["scale_rule"].tolist(), bool(d["delta_hi"].iloc[0] < 0)   # floor loses to rceil
        (['floor'], True)
    """
    if within not in _KEYS:
        raise ValueError(f"within must be one of {_KEYS}, got {within!r}")
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; valid: {METRICS}")
    present = [_key_value(v) for v in per_seed_frame[within].dropna().unique()]
    if not _equals(per_seed_frame[within], baseline).any():
        raise ValueError(
            f"baseline {baseline!r} is not a {within} of this frame (its {within} values: "
            f"{', '.join(map(repr, present)) or 'none'}); pick one of them, or run compare "
            f"with {baseline!r} among its {within}s"
        )
    others = [k for k in _KEYS if k != within]
    frame = per_seed_frame.copy()
    frame["_seed"] = frame["seed"].fillna(-1).astype("int64") if "seed" in frame else -1
    if within == "block_size":   # a size given to compare is part of the name: pair the base
        frame["format"] = frame["format"].str.replace(r"_b\d+$", "", regex=True)
    out = []
    for keys, group in frame.groupby(others, dropna=False, sort=False):
        is_base = _equals(group[within], baseline)
        base = group[is_base].set_index("_seed")[metric]
        if base.empty:
            continue
        for value, sub in group[~is_base].groupby(within, dropna=False, sort=False):
            s = sub.set_index("_seed")[metric]
            common = s.index.intersection(base.index)
            if len(common) == 0:
                continue
            d = s.loc[common].to_numpy(np.float64) - base.loc[common].to_numpy(np.float64)
            phases = _group_phases(sub.set_index("_seed").loc[common])
            mean, lo, hi = confidence_interval(d, level, phases=phases)
            row = {k: _key_value(v) for k, v in zip(others, keys)}
            row[within] = _key_value(value[0] if isinstance(value, tuple) else value)
            row.update({"baseline": baseline, "n_seeds": int(len(d)), "delta": mean,
                        "delta_lo": lo, "delta_hi": hi})
            out.append(row)
    columns = list(_KEYS) + ["baseline", "n_seeds", "delta", "delta_lo", "delta_hi"]
    result = _frame(out, columns=columns)
    result.attrs.update(per_seed_frame.attrs)
    result.attrs.update(level=level, interval=_interval_note(level))
    return result


def phase_sweep(
    x,
    formats,
    *,
    phases: Union[int, Iterable[float]] = 8,
    seeds: Union[int, Iterable[int]] = 4,
    metric: str = "sqnr_db",
    within: Optional[str] = "scale_rule",
    baseline=None,
    level: float = 0.95,
    **compare_kwargs,
):
    """``metric`` (and optionally a paired difference) at each of several fixed scale phases.

    Power-of-two scales make every metric periodic in log2 of the input's scale; this
    evaluates :func:`compare` at σ = 2^p for each phase p (``phases=n``: p = 0, 1/n, …,
    (n−1)/n) on the same seeds, so the range over an octave shows what a single σ hides.

    Args:
      x, formats, compare_kwargs: as for :func:`compare` (``phase`` and ``per_seed`` are
        set here).
      phases: the number of evenly spaced phases in [0, 1), or the phases themselves.
      seeds: seeds evaluated at every phase (default 4).
      metric: the metric reported.
      within, baseline: with a ``baseline`` (e.g. ``"rceil"``), also the paired difference
        ``metric − metric(baseline)`` over the seeds at each phase (:func:`paired_delta`).

    Returns:
      A DataFrame with the key columns, ``phase``, ``n_seeds``, ``<metric>``,
      ``<metric>_lo`` / ``_hi`` and, with a baseline, ``delta``, ``delta_lo``, ``delta_hi``
      (<NA>/NaN on the baseline's own rows). Take the range with
      ``groupby([...])["delta"].agg(["min", "max"])``.

    Example:
        >>> sw = phase_sweep("gaussian", "mxfp8_e4m3", scale_rules=["floor", "rceil"],
        ...                  phases=4, seeds=2, shape=(8, 256), baseline="rceil")
        >>> sw["phase"].tolist()
        [0.0, 0.0, 0.25, 0.25, 0.5, 0.5, 0.75, 0.75]
        >>> d = sw.dropna(subset=["delta"])["delta"]
        >>> bool((d < 0).all()), bool(d.max() - d.min() > 0.2)   # floor loses, by how much varies
        (True, True)
    """
    pd = require_pandas("compare")
    for k in ("phase", "per_seed"):
        if k in compare_kwargs:
            raise TypeError(f"phase_sweep sets {k!r} itself; drop it")
    if isinstance(phases, int):
        if phases < 1:
            raise ValueError(f"phases must be at least 1, got {phases}")
        phases = [k / phases for k in range(phases)]
    phases = [phase_of(float(p)) for p in phases]
    if not phases:
        raise ValueError("phases is empty; give at least one phase")
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; valid: {METRICS}")
    parts = []
    for p in phases:
        runs = compare(x, formats, seeds=seeds, phase=p, per_seed=True, level=level,
                       **compare_kwargs)
        summary = summarize(runs, level=level)
        cols = list(_KEYS) + ["n_seeds", metric] + [c for c in (metric + "_lo", metric + "_hi")
                                                     if c in summary]
        part = summary[cols].copy()
        part.insert(len(_KEYS), "phase", p)
        if baseline is not None:
            d = paired_delta(runs, metric=metric, within=within, baseline=baseline, level=level)
            d = d.drop(columns=["n_seeds"])
            part = part.merge(d, on=list(_KEYS), how="left", sort=False)
        parts.append(part)
    return pd.concat(parts, ignore_index=True)


def long_format(frame):
    """The tidy (long) form of a :func:`compare`/:func:`summarize`/:func:`phase_sweep` table.

    One row per configuration (and seed, for ``per_seed`` output) and metric: the id columns
    that are present (``input``, ``format``, ``scale_rule``, ``block_size``,
    ``bits_per_element``, ``n_seeds``, ``seed``, ``phase``, ``baseline``), then ``metric``,
    ``value``, ``lo`` and ``hi`` (NaN without an interval). Paired-difference columns
    (``delta``) become the metric ``"delta"``. Ready for ``to_csv`` or a plotting library.

    Example:
        >>> df = compare("gaussian", ["e4m3", "mxfp4"], scale_rules="rceil", seeds=2,
        ...              shape=(8, 256))
        >>> tidy = long_format(df)
        >>> list(tidy.columns)
        ['input', 'format', 'scale_rule', 'block_size', 'bits_per_element', 'n_seeds', 'metric', 'value', 'lo', 'hi']
        >>> len(tidy) == 2 * len(METRICS), tidy["metric"].iloc[0]
        (True, 'sqnr_db')
    """
    pd = require_pandas("compare")
    ids = [c for c in (*_ID_COLUMNS, "baseline") if c in frame]
    metrics = [m for m in (*METRICS, "delta") if m in frame]
    if not metrics:
        raise ValueError(
            f"no metric column in the frame (columns: {list(frame.columns)}); pass the output "
            "of compare, summarize, paired_delta or phase_sweep"
        )
    parts = []
    for m in metrics:
        part = frame[ids].copy()
        part["metric"] = pd.array([m] * len(frame), dtype="string")
        part["value"] = frame[m].to_numpy(np.float64)
        for end in ("lo", "hi"):
            col = f"{m}_{end}"
            part[end] = frame[col].to_numpy(np.float64) if col in frame else np.nan
        parts.append(part)
    out = pd.concat(parts, ignore_index=False)
    # configuration-major order: every metric of the first row, then the next row
    out = out.sort_index(kind="stable").reset_index(drop=True)
    return out
