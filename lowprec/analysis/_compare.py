"""One-call comparisons of formats on an input, over seeds, with confidence intervals.

:func:`compare` quantizes an input (an array, a named distribution or a function of a seed)
to each element and MX format and returns one pandas row per configuration: SQNR, errors,
ULP quantiles on the format's own grid, clip / underflow / overflow / NaN rates and bits per
element, as the mean over seeds with a Student-t confidence interval. :func:`paired_delta`
turns per-seed results into differences against a baseline (e.g. ``floor`` − ``rceil``),
whose intervals are much tighter than those of the absolute values because every seed
compares the same data.

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
from .._format import ElementFormat, MXFormat, mx_format, resolve_format
from .._options import ElementCast
from .._scale_rules import DEFAULT_SCALE_RULE, check_scale_rule
from ._common import as_f32
from ._metrics import _stats
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
)
_KEYS = ("input", "format", "scale_rule", "block_size")
_RATES = ("clip_rate", "underflow_rate", "overflow_rate", "nan_rate")
_DEFAULT_SEEDS = 10
_T_RE = re.compile(r"student-t\(\s*([0-9]*\.?[0-9]+)\s*\)$")


# ------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------
def sample(distribution: str, shape: Sequence[int] = (128, 1024), *, seed: int = 0) -> np.ndarray:
    """Draws a float32 array from a named distribution (NumPy's PCG64 generator, seeded).

    Names: ``"gaussian"`` (standard normal), ``"laplace"`` (scale 1), ``"uniform"`` on
    [−1, 1), ``"student-t(ν)"`` for any ν > 0 (heavy tails: finite variance needs ν > 2),
    ``"lognormal"`` (exp of a standard normal, random sign) and ``"gauss+outliers"``
    (standard normal with 0.1 % of the entries multiplied by 100).

    Example:
        >>> x = sample("student-t(3)", (4, 32), seed=1)
        >>> x.shape, x.dtype.name
        ((4, 32), 'float32')
        >>> bool((sample("gaussian", (8,), seed=3) == sample("gaussian", (8,), seed=3)).all())
        True
    """
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
    return x.astype(np.float32)


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


def confidence_interval(values, level: float = 0.95) -> tuple[float, float, float]:
    """``(mean, low, high)``: Student-t confidence interval for the mean of ``values``.

    The half width is t·s/√n with s the sample standard deviation (ddof = 1) and t the
    two-sided ``level`` quantile of Student's t with n − 1 degrees of freedom. One value
    gives NaN bounds; a non-finite value gives a non-finite mean and NaN bounds.

    Example:
        >>> m, lo, hi = confidence_interval([1.0, 2.0, 3.0])   # s = 1, t(0.975, 2) = 4.303
        >>> m, round(hi - m, 3)
        (2.0, 2.484)
    """
    v = np.asarray(values, np.float64).ravel()
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if v.size == 0:
        raise ValueError("confidence_interval needs at least one value")
    mean = float(np.mean(v))
    if v.size == 1 or not np.all(np.isfinite(v)):
        return mean, math.nan, math.nan
    half = _t_quantile(float(level), v.size - 1) * float(np.std(v, ddof=1)) / math.sqrt(v.size)
    return mean, mean - half, mean + half


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


def _evaluate(x, fmt, scale_rule, axis, rounding, overflow, key):
    # Built from lowprec's own jitted kernels (one compile per format and rule) and two small
    # jitted tails shared by all configurations of a shape, rather than one big jit per
    # configuration: compilation, not arithmetic, dominates a comparison on CPU.
    if isinstance(fmt, MXFormat):
        q, s = roundtrip(x, fmt, axis, scale_rule, rounding, key)
        elem = fmt.element
    else:
        q = quantize(x, fmt, rounding=rounding, overflow=overflow, key=key, dtype=jnp.float32)
        elem, s = fmt, None
    stats = dict(_stats(x, q))
    ulps, stats["clip_rate"] = _ulps_and_clip(x, q, s, elem)
    # ULP quantiles are taken on the host: NumPy's partition-based quantile is O(n), XLA's
    # CPU sort is not (it dominated the whole evaluation).
    return stats, ulps


def _metrics_row(stats, ulps) -> dict:
    ulps = np.asarray(ulps, np.float64)
    ulps = ulps[np.isfinite(ulps)]
    if ulps.size:
        p50, p99 = np.quantile(ulps, [0.5, 0.99])
        top = ulps.max()
    else:
        p50 = p99 = top = math.nan
    row = {m: float(stats[m]) for m in METRICS if m in stats}
    row.update(ulp_p50=float(p50), ulp_p99=float(p99), ulp_max=float(top))
    return {m: row[m] for m in METRICS}


def _pandas():
    try:
        import pandas
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "lowprec.analysis.compare returns a pandas DataFrame: pip install 'lowprec[analysis]'"
        ) from e
    return pandas


def _frame(records):
    """DataFrame whose ``scale_rule``/``block_size`` keep None (not NaN) for element formats."""
    pd = _pandas()
    frame = pd.DataFrame.from_records(records)
    for col in ("scale_rule", "block_size"):
        if col in frame:
            frame[col] = pd.Series([r[col] for r in records], index=frame.index, dtype=object)
    return frame


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
            # NVFP4 has its own scale recipe: one row, no rule (None), never a made-up one.
            rules = [None] if mfmt.tensor_scale else scale_rules
            for rule in rules:
                out.append((mfmt, rule, mfmt.block_size, mfmt.bits_per_element))
    if not out:
        raise ValueError("no configuration to compare: give at least one format")
    return out


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
):
    """Compares formats on an input: one pandas row per format × scale rule × block size.

    Columns: ``input``, ``format``, ``scale_rule`` and ``block_size`` (None for element
    formats; ``scale_rule`` is None for NVFP4 too, whose block scales follow its own recipe),
    ``bits_per_element`` (block scale included, NVFP4's one tensor scale not), ``n_seeds``,
    then the metrics —
    ``sqnr_db``, ``max_abs_error``, ``mean_abs_error``, ``max_rel_error``,
    ``mean_rel_error`` (over the elements whose quantized value is finite), ``ulp_p50``,
    ``ulp_p99``, ``ulp_max`` (ULP error quantiles on the format's grid — for MX the element
    grid scaled by each block's exponent), ``clip_rate`` (|x| beyond the largest value of its
    grid), ``underflow_rate`` (nonzero → 0), ``overflow_rate`` (finite → inf or NaN, e.g. E4M3
    |x| > 464 under the default ``overflow="ieee"``) and ``nan_rate`` (→ NaN). With several
    seeds each metric is the mean over seeds, with ``<metric>_lo`` / ``<metric>_hi`` columns
    bounding a ``level`` confidence interval (Student t; rates clipped to [0, 1]).

    Args:
      x: the input: an array (evaluated once), a distribution name (see :func:`sample`;
        drawn with ``shape`` for each seed), a function ``seed -> array``, or a mapping
        label → any of these to compare several inputs (the ``input`` column).
      formats: format names or objects, element and MX mixed.
      scale_rules: the MX scale rules to try (not applied to element formats, nor to NVFP4,
        which gets one row with ``scale_rule`` None).
      block_sizes: block sizes to try for every block format (powers of two 2..1024,
        ``lowprec.BLOCK_SIZES``; FP6 needs at least 4); None (default): each format's own
        (32 for OCP MX, 16 for NVFP4). A size given this way appears in the format's name
        (``"mxfp4_b16"``) as well as in ``block_size``.
      seeds: an int n (``range(n)``) or the seeds themselves. Default: 10 seeds for a
        distribution name or a function, one evaluation for an array (then seeds are only
        allowed with ``rounding="stochastic"``, where they seed the rounding).
      shape: the shape drawn for a distribution name.
      axis: the MX block axis.
      rounding, overflow: element rounding mode and overflow policy (MX elements always
        saturate). ``rounding="stochastic"`` uses ``jax.random.key(seed)``.
      level: confidence level of the intervals.
      per_seed: return one row per seed (a ``seed`` column, no intervals) instead; feed it
        to :func:`summarize` or :func:`paired_delta`.

    Returns:
      A pandas DataFrame.

    Example:
        >>> import numpy as np
        >>> df = compare("gaussian", ["e4m3", "mxfp4"], scale_rules=["floor", "rceil"],
        ...              seeds=3, shape=(8, 256))
        >>> df[["format", "scale_rule", "bits_per_element", "n_seeds"]].values.tolist()
        [['e4m3', None, 8.0, 3], ['mxfp4', 'floor', 4.25, 3], ['mxfp4', 'rceil', 4.25, 3]]
        >>> bool((df["sqnr_db_lo"] < df["sqnr_db"]).all())
        True
        >>> sweep = compare("gaussian", ["mxint8", "nvfp4"], scale_rules="rceil",
        ...                 block_sizes=[16, 64], seeds=2, shape=(4, 256))
        >>> sweep[["format", "scale_rule", "block_size"]].values.tolist()
        [['mxint8_b16', 'rceil', 16], ['mxint8_b64', 'rceil', 64], ['nvfp4', None, 16], ['nvfp4_b64', None, 64]]
        >>> big = compare(np.array([1.0, 500.0, 2.0, 3.0], np.float32), "e4m3")
        >>> big[["overflow_rate", "nan_rate"]].values.tolist()   # 500 -> NaN, counted
        [[0.25, 0.25]]
    """
    inputs = _inputs(x)
    configs = _configs(formats, scale_rules, block_sizes)
    for fmt, *_ in configs:   # validate the options once, before any work
        ElementCast(fmt.element if isinstance(fmt, MXFormat) else fmt, rounding, overflow)
    rows = []
    for label, source in inputs.items():
        is_array = not isinstance(source, str) and not callable(source)
        if seeds is None:
            seed_list = [None] if is_array else list(range(_DEFAULT_SEEDS))
        else:
            seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
            if not seed_list:
                raise ValueError("seeds is empty; give at least one seed")
            if is_array and rounding != "stochastic":
                raise ValueError(
                    f"seeds only vary a generated input (a distribution name or a function of "
                    f"a seed) or stochastic rounding; input {label!r} is a fixed array. Drop "
                    "seeds, or pass row_subsets(x, n) with seeds=range(n) for an interval over "
                    "parts of it"
                )
        for seed in seed_list:
            if isinstance(source, str):
                data = sample(source, shape, seed=seed)
            elif callable(source):
                data = source(seed)
            else:
                data = source
            data = as_f32(data)
            if data.ndim == 0:
                raise ValueError(f"input {label!r} is a scalar; compare needs an array")
            key = jax.random.key(0 if seed is None else seed) if rounding == "stochastic" else None
            ax = axis % data.ndim
            for fmt, rule, bs, bits in configs:
                stats, ulps = jax.device_get(_evaluate(data, fmt, rule, ax, rounding, overflow, key))
                rows.append({"input": label, "format": fmt.name, "scale_rule": rule,
                             "block_size": bs, "bits_per_element": float(bits), "seed": seed,
                             **_metrics_row(stats, ulps)})
    frame = _frame(rows)
    frame.attrs["level"] = level
    if per_seed:
        return frame
    return summarize(frame, level=level)


def summarize(per_seed_frame, *, level: float = 0.95):
    """Aggregates :func:`compare`'s ``per_seed=True`` output: mean and interval per configuration.

    Example:
        >>> runs = compare("laplace", "mxfp8_e4m3", scale_rules="rceil", seeds=4,
        ...                shape=(4, 128), per_seed=True)
        >>> len(runs), len(summarize(runs))
        (4, 1)
    """
    frame = per_seed_frame
    out = []
    for keys, group in frame.groupby(list(_KEYS), dropna=False, sort=False):
        row = dict(zip(_KEYS, keys))
        row = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        if row["block_size"] is not None:
            row["block_size"] = int(row["block_size"])
        row["bits_per_element"] = float(group["bits_per_element"].iloc[0])
        row["n_seeds"] = int(len(group))
        for m in METRICS:
            mean, lo, hi = confidence_interval(group[m].to_numpy(), level)
            row[m] = mean
            if len(group) > 1:
                if m in _RATES:
                    lo, hi = max(lo, 0.0), min(hi, 1.0)
                row[m + "_lo"], row[m + "_hi"] = lo, hi
        out.append(row)
    result = _frame(out)
    result.attrs["level"] = level
    return result


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
    by seed with the row whose ``within`` equals ``baseline``. Pairing removes the spread of
    the data itself, so a small but systematic difference gets a tight interval.

    Returns:
      A DataFrame with the key columns, ``n_seeds``, ``delta`` (mean difference),
      ``delta_lo`` and ``delta_hi``; groups without a baseline row are left out.

    Example:
        >>> runs = compare("gaussian", "mxfp8_e4m3", scale_rules=["floor", "rceil"],
        ...                seeds=5, shape=(16, 256), per_seed=True)
        >>> d = paired_delta(runs, metric="sqnr_db", within="scale_rule", baseline="rceil")
        >>> d["scale_rule"].tolist(), bool(d["delta_hi"].iloc[0] < 0)   # floor loses to rceil
        (['floor'], True)
    """
    pd = _pandas()
    if within not in _KEYS:
        raise ValueError(f"within must be one of {_KEYS}, got {within!r}")
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; valid: {METRICS}")
    others = [k for k in _KEYS if k != within]
    frame = per_seed_frame.copy()
    others_keys = others
    frame["_seed"] = frame["seed"].fillna(-1) if "seed" in frame else -1
    out = []
    for keys, group in frame.groupby(others_keys, dropna=False, sort=False):
        base = group[group[within] == baseline].set_index("_seed")[metric]
        if base.empty:
            continue
        for value, sub in group[group[within] != baseline].groupby(within, dropna=False, sort=False):
            s = sub.set_index("_seed")[metric]
            common = s.index.intersection(base.index)
            if len(common) == 0:
                continue
            d = s.loc[common].to_numpy() - base.loc[common].to_numpy()
            mean, lo, hi = confidence_interval(d, level)
            row = dict(zip(others_keys, keys if isinstance(keys, tuple) else (keys,)))
            row[within] = value
            row.update({"baseline": baseline, "n_seeds": int(len(d)), "delta": mean,
                        "delta_lo": lo, "delta_hi": hi})
            out.append(row)
    return pd.DataFrame.from_records(out)
