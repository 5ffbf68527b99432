"""Matplotlib helpers for the error studies (matplotlib is imported inside each helper).

Every helper draws on ``ax`` when given one and otherwise on a new ``pyplot`` figure, and
returns the axes. Conventions, so that each figure reads at a glance:

* Non-finite values (NaN, ±inf) — and zeros on a log axis — are never silently dropped:
  they are counted and the count is written into the legend ("3 NaN not shown").
* Every curve has its own marker (hollow, so curves that coincide stay visible) and lines
  that coincide are drawn in decreasing widths; legends sit outside the data, on the right.
* Differences are drawn as differences (:func:`plot_delta_bars`), not as tall bars from 0
  whose tops differ by a hair; absolute values with intervals as points
  (:func:`plot_estimates`), on an axis fitted to the data.

``import lowprec`` and ``import lowprec.analysis`` never import matplotlib; install it with
``pip install 'lowprec[notebooks]'``.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .._format import ELEMENT_FORMAT_NAMES, element_format
from .._format import ElementFormatLike as FormatLike
from ._values import representable_values, value_spacing

# One colour per element format, the same in every plot.
_FORMAT_COLORS = {name: f"C{i}" for i, name in enumerate(ELEMENT_FORMAT_NAMES)}
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*", "p")
_DASHES = ("-", "--", "-.", ":")



def _axes(ax, figsize: Tuple[float, float]):
    if ax is not None:
        return ax
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "lowprec's plot helpers need matplotlib: pip install 'lowprec[notebooks]'"
        ) from e
    _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def _label_axes(ax, xlabel, ylabel, title):
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title)


def _legend_outside(ax, handles=None, labels=None, title=None):
    """Legend to the right of the axes (never over the data)."""
    kw = dict(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8,
              frameon=False, title=title, title_fontsize=8)
    if handles is not None:
        kw["handles"] = handles
    if labels is not None:
        kw["labels"] = labels
    return ax.legend(**kw)


def _count_note(n_nan: int, n_posinf: int, n_neginf: int, n_zero: int = 0, total: int = 0) -> str:
    """'12 NaN, 3 +inf not shown' (empty when nothing was left out)."""
    parts = []
    if n_zero:
        share = f" ({100 * n_zero / total:.1f}%)" if total else ""
        parts.append(f"{n_zero} zero{share}")
    for n, what in ((n_nan, "NaN"), (n_posinf, "+inf"), (n_neginf, "−inf")):
        if n:
            parts.append(f"{n} {what}")
    return (", ".join(parts) + " not shown") if parts else ""


def _with_note(label: str, note: str) -> str:
    return f"{label}\n  ({note})" if note else label


# ------------------------------------------------------------------------------------------
# value grids and spacing
# ------------------------------------------------------------------------------------------
def plot_value_grid(fmts: Iterable[FormatLike], *, ax=None, max_values: int = 4096):
    """One row per format with a tick at every positive finite value (log2 axis).

    Formats with more than ``max_values`` positive values (FP16, BF16, TF32) are drawn as
    a band over their range, annotated with the number of values per binade.

    Example:
        >>> from matplotlib.figure import Figure
        >>> ax = plot_value_grid(["e4m3", "e2m1"], ax=Figure().subplots())
        >>> [t.get_text() for t in ax.get_yticklabels()]
        ['e4m3', 'e2m1']
    """
    fmts = [element_format(f) for f in fmts]
    ax = _axes(ax, (9, 0.6 + 0.55 * len(fmts)))
    colors = [_FORMAT_COLORS.get(f.name, f"C{i % 10}") for i, f in enumerate(fmts)]
    for row, (fmt, color) in enumerate(zip(fmts, colors)):
        y = len(fmts) - 1 - row
        values = representable_values(fmt)
        values = values[values > 0]
        if len(values) > max_values:
            lo, hi = np.log2(values[0]), np.log2(values[-1])
            ax.barh(y, hi - lo, left=lo, height=0.5, color=color, alpha=0.35)
            ax.text(
                (lo + hi) / 2, y, f"{len(values)} values, {2 ** fmt.mantissa_bits} per binade",
                ha="center", va="center", fontsize=8,
            )
        else:
            ax.vlines(np.log2(values), y - 0.3, y + 0.3, color=color, linewidth=0.8)
    ax.set_yticks(range(len(fmts))[::-1], [f.name for f in fmts])
    ax.set_xlabel("log2(value)")
    ax.set_ylim(-0.6, len(fmts) - 0.4)
    return ax


def _runs(values: np.ndarray, gaps: np.ndarray):
    """Keeps the first and last point of each run of equal gaps (lossless on log-log)."""
    change = np.flatnonzero(np.diff(gaps) != 0)
    keep = np.unique(np.concatenate([[0], change, change + 1, [len(gaps) - 1]]))
    return values[keep], gaps[keep]


def _binade_envelope(values: np.ndarray, y: np.ndarray):
    """Per binade [2^e, 2^(e+1)): its left edge and the largest y in it (step-plot ready)."""
    e = np.floor(np.log2(values)).astype(np.int64)
    edges, start = np.unique(e, return_index=True)
    peak = np.maximum.reduceat(y, start)
    x = np.exp2(np.append(edges, edges[-1] + 1).astype(np.float64))
    return x, np.append(peak, peak[-1])


def plot_spacing(
    fmts: Iterable[FormatLike],
    *,
    relative: bool = False,
    envelope: bool = False,
    ax=None,
    title: Optional[str] = None,
):
    """Gap to the next value vs value, on log-log axes, for each format.

    ``relative=True`` plots gap/value: the sawtooth between 2^-mantissa_bits and
    2^-(mantissa_bits+1) in the normal range, rising in the subnormal range. Runs of equal
    gaps are reduced to their end points, which is exact on log-log axes. Over hundreds of
    binades the sawtooth fills the plot; ``envelope=True`` draws instead the largest value
    per binade as a staircase, in decreasing line widths and different dash patterns, so a
    format whose staircase coincides with another's (FP16 and TF32 share their 10-bit
    spacing) stays visible: list the format with the wider range first.

    Example:
        >>> from matplotlib.figure import Figure
        >>> ax = plot_spacing(["e4m3", "bf16"], relative=True, ax=Figure().subplots())
        >>> [line.get_label() for line in ax.get_lines()]
        ['e4m3', 'bf16']
    """
    ax = _axes(ax, (8, 4.5))
    fmts = [element_format(f) for f in fmts]
    for i, fmt in enumerate(fmts):
        values, gaps = value_spacing(fmt)
        y = gaps / values if relative else gaps
        style = dict(label=fmt.name, color=_FORMAT_COLORS.get(fmt.name, f"C{i % 10}"), zorder=2 + i)
        if envelope:  # staircases coincide over long stretches: widths and dashes tell them apart
            style.update(linewidth=max(3.6 - 0.8 * i, 1.2), linestyle=_DASHES[i % len(_DASHES)])
        else:
            style.update(linewidth=1.3)
        if envelope:
            ex, ey = _binade_envelope(values, y)
            ax.step(ex, ey, where="post", **style)
        else:
            rv, ry = _runs(values, y)
            ax.plot(rv, ry, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ylabel = "gap / value" if relative else "gap to next value"
    if envelope:
        ylabel = f"largest {ylabel} per binade"
    _label_axes(ax, "value", ylabel, title)
    _legend_outside(ax)
    ax.grid(True, which="major", alpha=0.3)
    return ax


# ------------------------------------------------------------------------------------------
# distributions of errors
# ------------------------------------------------------------------------------------------
def plot_histograms(
    samples: Mapping[str, np.ndarray],
    *,
    bins: Union[int, Sequence[float]] = 100,
    log_x: bool = False,
    ax=None,
    xlabel: Optional[str] = None,
    title: Optional[str] = None,
    logy: bool = False,
    density: bool = True,
):
    """Overlaid step histograms of several samples (e.g. errors per format or mode).

    NaN and ±inf values are left out and counted in the legend. With ``log_x=True`` the
    magnitudes |v| are binned on log-spaced bins (``bins`` an int: spanning the positive
    finite values of all samples), and zeros — which have no place on a log axis — are
    counted in the legend too, with their share (e.g. MXFP4's underflows).

    Example:
        >>> from matplotlib.figure import Figure
        >>> ax = plot_histograms({"a": np.array([0.0, 1e-3, 0.1, np.inf]), "b": np.ones(3)},
        ...                      bins=4, log_x=True, ax=Figure().subplots())
        >>> ax.get_legend_handles_labels()[1]
        ['a\\n  (1 zero (25.0%), 1 +inf not shown)', 'b']
    """
    ax = _axes(ax, (7, 4))
    cleaned, notes = {}, {}
    for label, values in samples.items():
        v = np.asarray(values, np.float64).ravel()
        n_nan, n_pinf, n_ninf = int(np.isnan(v).sum()), int(np.isposinf(v).sum()), int(np.isneginf(v).sum())
        v = v[np.isfinite(v)]
        n_zero = 0
        if log_x:
            v = np.abs(v)
            n_zero = int((v == 0).sum())
            v = v[v > 0]
        cleaned[label] = v
        notes[label] = _count_note(n_nan, n_pinf, n_ninf, n_zero, int(np.asarray(values).size))
    if isinstance(bins, (int, np.integer)):
        pooled = np.concatenate([v for v in cleaned.values()]) if cleaned else np.array([])
        if pooled.size == 0:
            pooled = np.array([1.0, 2.0]) if log_x else np.array([0.0, 1.0])
        lo, hi = pooled.min(), pooled.max()
        if hi <= lo:
            hi = lo * 2 if log_x else lo + 1
        bins = np.geomspace(lo, hi, int(bins) + 1) if log_x else np.linspace(lo, hi, int(bins) + 1)
    for i, (label, v) in enumerate(cleaned.items()):
        ax.hist(v, bins=bins, histtype="step", density=density, linewidth=max(2.4 - 0.4 * i, 1.0),
                linestyle=_DASHES[i % len(_DASHES)], label=_with_note(label, notes[label]))
    if log_x:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    _label_axes(ax, xlabel, "density" if density else "count", title)
    _legend_outside(ax)
    return ax


def plot_error_vs_magnitude(
    x,
    approximations: Mapping[str, np.ndarray],
    *,
    error: str = "relative",
    bins: int = 30,
    stat: str = "mean",
    band: bool = True,
    ax=None,
    title: Optional[str] = None,
):
    """Error against the magnitude of the exact value, in log-spaced bins of |x|.

    For each approximation: the ``stat`` (``"mean"``, ``"median"`` or ``"max"``) of the
    ``error`` (``"relative"``: |q − x|/|x|; ``"absolute"``: |q − x|) per bin of |x|, with
    markers, and (``band=True``) the 10–90 % range of the bin shaded. Underflows (x ≠ 0,
    q = 0) stay in (relative error 1) and their share is noted in the legend; elements with
    non-finite q, and zeros of x, are left out and counted there.

    Example:
        >>> from matplotlib.figure import Figure
        >>> import lowprec
        >>> x = np.geomspace(1e-3, 10, 200).astype(np.float32)
        >>> q = np.asarray(lowprec.quantize(x, "e2m1"))
        >>> ax = plot_error_vs_magnitude(x, {"e2m1": q}, bins=8, ax=Figure().subplots())
        >>> ax.get_legend_handles_labels()[1][0].startswith("e2m1")
        True
    """
    if error not in ("relative", "absolute"):
        raise ValueError(f"error must be 'relative' or 'absolute', got {error!r}")
    reducers = {"mean": np.mean, "median": np.median, "max": np.max}
    if stat not in reducers:
        raise ValueError(f"stat must be one of {tuple(reducers)}, got {stat!r}")
    ax = _axes(ax, (7, 4.2))
    x = np.asarray(x, np.float64).ravel()
    mag = np.abs(x)
    series = {}
    for label, q in approximations.items():
        q = np.asarray(q, np.float64).ravel()
        if q.shape != x.shape:
            raise ValueError(f"approximation {label!r} has {q.size} elements, x has {x.size}")
        ok = np.isfinite(x) & np.isfinite(q) & (x != 0)
        err = np.abs(q - x)
        if error == "relative":
            err = err / np.where(x != 0, mag, 1.0)
        under = int(np.sum((x != 0) & (q == 0) & np.isfinite(x)))
        note = _count_note(int(np.isnan(q).sum()), int(np.isposinf(q).sum()),
                           int(np.isneginf(q).sum()))
        if under:
            share = 100 * under / x.size
            share = f"{share:.1f}%" if share >= 0.1 else "<0.1%"
            note = f"{share} → 0" + (f"; {note}" if note else "")
        series[label] = (ok, err, note)
    zeros = int(np.sum(x == 0))
    valid = np.isfinite(mag) & (mag > 0)
    if not valid.any():
        raise ValueError("x has no finite nonzero values to bin")
    edges = np.geomspace(mag[valid].min(), mag[valid].max() * (1 + 1e-12), bins + 1)
    centers = np.sqrt(edges[:-1] * edges[1:])
    for i, (label, (ok, err, note)) in enumerate(series.items()):
        idx = np.digitize(mag[ok], edges) - 1
        e = err[ok]
        ys, lo, hi, xs = [], [], [], []
        for b in range(bins):
            sel = e[idx == b]
            if sel.size:
                xs.append(centers[b])
                ys.append(reducers[stat](sel))
                lo.append(np.percentile(sel, 10))
                hi.append(np.percentile(sel, 90))
        (line,) = ax.plot(xs, ys, marker=_MARKERS[i % len(_MARKERS)], markersize=4,
                          markerfacecolor="none", linewidth=1.2, label=_with_note(label, note))
        if band:
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.12, linewidth=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ylabel = f"{stat} {'|q − x| / |x|' if error == 'relative' else '|q − x|'}"
    xlabel = "|x|" + (f"  ({zeros} zeros of x not shown)" if zeros else "")
    _label_axes(ax, xlabel, ylabel + (" (band: 10–90 %)" if band else ""), title)
    ax.grid(True, which="major", alpha=0.3)
    _legend_outside(ax)
    return ax


# ------------------------------------------------------------------------------------------
# curves
# ------------------------------------------------------------------------------------------
def plot_curves(
    x,
    curves: Mapping[str, np.ndarray],
    *,
    bounds: Optional[Mapping[str, np.ndarray]] = None,
    bands: Optional[Mapping[str, Tuple[np.ndarray, np.ndarray]]] = None,
    errors: Optional[Mapping[str, Tuple[np.ndarray, np.ndarray]]] = None,
    ax=None,
    logx: bool = False,
    logy: bool = False,
    xlabel: Optional[str] = None,
    ylabel: Optional[str] = None,
    title: Optional[str] = None,
    marker: Optional[str] = "auto",
    markevery=None,
    styles: Optional[Mapping[str, Mapping]] = None,
    bound_suffix: str = " bound",
    legend_bounds: bool = True,
):
    """Line plot of several curves over a shared ``x``, with optional bounds, bands, error bars.

    Args:
      x: shared abscissa.
      curves: label → y values. Each curve gets its own hollow marker (``marker="auto"``;
        a marker string for all, or None for plain lines), so coinciding curves stay visible;
        ``markevery`` thins the markers of long curves (as matplotlib's).
      styles: label → matplotlib line properties overriding the defaults for that curve
        (e.g. ``{"color": "C0", "linestyle": "--"}`` to group curves by colour); its error
        bars, band and bound follow its colour.
      bounds: label → y values drawn dashed, on top of the curves, in the colour of the curve
        with the same label (labels not in ``curves`` get their own colour), labelled
        ``label + bound_suffix``.
      bands: label → (low, high), shaded in the colour of the curve with that label.
      errors: label → (low, high) drawn as error bars (e.g. confidence intervals).
      legend_bounds: list the dashed lines in the legend too (off: say what they are in
        the title instead, which keeps crowded legends readable).

    Non-finite points are left out by matplotlib; they are counted in the legend.

    Example:
        >>> from matplotlib.figure import Figure
        >>> k = np.array([32, 64, 128])
        >>> ax = plot_curves(k, {"e4m3": k ** 0.5}, bounds={"e4m3": k * 1.0}, logx=True,
        ...                  ax=Figure().subplots())
        >>> [line.get_label() for line in ax.get_lines()]
        ['e4m3', 'e4m3 bound']
    """
    ax = _axes(ax, (7, 4.5))
    x = np.asarray(x)
    colors, handles = {}, []
    for i, (label, y) in enumerate(curves.items()):
        y = np.asarray(y, np.float64)
        note = _count_note(int(np.isnan(y).sum()), int(np.isposinf(y).sum()), int(np.isneginf(y).sum()))
        m = _MARKERS[i % len(_MARKERS)] if marker == "auto" else marker
        kw = dict(marker=m, markersize=5, markerfacecolor="none", markeredgewidth=1.2,
                  linewidth=max(2.2 - 0.15 * i, 1.0), markevery=markevery, color=f"C{i % 10}",
                  zorder=3 + i)
        kw.update((styles or {}).get(label, {}))
        (line,) = ax.plot(x, y, label=_with_note(label, note), **kw)
        colors[label] = line.get_color()
        handles.append(line)
        if errors and label in errors:
            lo, hi = (np.asarray(v, np.float64) for v in errors[label])
            ax.errorbar(x, y, yerr=[y - lo, hi - y], fmt="none", ecolor=line.get_color(),
                        elinewidth=1, capsize=2, zorder=2 + i)
    extra = len(colors)
    for label, y in (bounds or {}).items():
        color = colors.get(label)
        if color is None:
            color, extra = f"C{extra % 10}", extra + 1
        (line,) = ax.plot(x, np.asarray(y), linestyle="--", color=color, linewidth=1.3,
                          label=f"{label}{bound_suffix}", zorder=50 + extra)
        if legend_bounds:
            handles.append(line)
    for label, (lo, hi) in (bands or {}).items():
        ax.fill_between(x, np.asarray(lo), np.asarray(hi), color=colors.get(label), alpha=0.18,
                        linewidth=0)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    _label_axes(ax, xlabel, ylabel, title)
    _legend_outside(ax, handles=handles)
    ax.grid(True, alpha=0.3)
    return ax


# ------------------------------------------------------------------------------------------
# grouped values: bars, differences, estimates with intervals
# ------------------------------------------------------------------------------------------
def _split(v):
    """(value, low, high) from a float or a (value, low, high) triple."""
    if isinstance(v, (tuple, list, np.ndarray)) and len(v) == 3:
        return float(v[0]), float(v[1]), float(v[2])
    return float(v), np.nan, np.nan


def _series_of(table: Mapping[str, Mapping[str, object]]) -> list:
    series = []
    for g in table:
        series += [s for s in table[g] if s not in series]
    return series


def _from_frame(table, group: str, series: str, value: str, lo: str, hi: str):
    """{group: {series: (value, lo, hi)}} from a DataFrame (e.g. paired_delta's)."""
    out: dict = {}
    for row in table.to_dict("records"):
        g, s = str(row[group]), str(row[series])
        out.setdefault(g, {})[s] = (row[value], row.get(lo, np.nan), row.get(hi, np.nan))
    return out


def plot_grouped_bars(
    table: Mapping[str, Mapping[str, float]],
    *,
    ax=None,
    ylabel: Optional[str] = None,
    title: Optional[str] = None,
    annotate: bool = True,
    fmt: str = "{:.1f}",
):
    """Grouped bar chart from 0: ``table[group][series] = value`` or ``(value, low, high)``.

    For quantities whose size matters from zero (rates, counts). To show small differences
    between large values use :func:`plot_delta_bars`; for values with intervals on a fitted
    axis, :func:`plot_estimates`. Intervals, when given, are drawn as error bars.

    Example:
        >>> from matplotlib.figure import Figure
        >>> t = {"gauss": {"floor": 0.8, "rceil": 0.0}, "laplace": {"floor": (0.7, 0.6, 0.8)}}
        >>> ax = plot_grouped_bars(t, ax=Figure().subplots())
        >>> [t.get_text() for t in ax.get_xticklabels()]
        ['gauss', 'laplace']
    """
    ax = _axes(ax, (8, 4))
    groups = list(table)
    series = _series_of(table)
    width = 0.8 / max(len(series), 1)
    pos = np.arange(len(groups))
    for i, s in enumerate(series):
        trip = np.array([_split(table[g].get(s, np.nan)) for g in groups], dtype=float)
        vals, lo, hi = trip[:, 0], trip[:, 1], trip[:, 2]
        has_err = np.isfinite(lo) & np.isfinite(hi)
        yerr = np.where(has_err, [vals - lo, hi - vals], 0.0) if has_err.any() else None
        bars = ax.bar(pos + (i - (len(series) - 1) / 2) * width, vals, width, label=s,
                      yerr=yerr, capsize=2, error_kw={"elinewidth": 1})
        if annotate:
            ax.bar_label(bars, labels=["" if np.isnan(v) else fmt.format(v) for v in vals],
                         fontsize=7, padding=2)
    ax.set_xticks(pos, groups)
    _label_axes(ax, None, ylabel, title)
    _legend_outside(ax)
    return ax


def plot_delta_bars(
    deltas,
    *,
    baseline: Optional[str] = None,
    group: str = "input",
    series: str = "scale_rule",
    ax=None,
    xlabel: Optional[str] = None,
    title: Optional[str] = None,
    fmt: str = "{:+.2f}",
):
    """Differences from a baseline as horizontal bars around 0, with their intervals.

    Args:
      deltas: ``{group: {series: Δ or (Δ, low, high)}}``, or a DataFrame such as
        :func:`paired_delta` returns (columns ``group``, ``series``, ``delta``,
        ``delta_lo``, ``delta_hi``).
      baseline: what Δ is measured against, for the axis label (read from the frame's
        ``baseline`` column when not given).
      group, series: the frame's columns for the groups (rows of bars) and the series
        (one bar per series in each group).

    The axis spans the differences (always including 0, drawn as a line), so a 0.3 dB
    effect is as visible as its interval allows; each bar is labelled with its value.

    Example:
        >>> from matplotlib.figure import Figure
        >>> d = {"gaussian": {"floor": (-0.9, -1.0, -0.8)}, "laplace": {"floor": -1.4}}
        >>> ax = plot_delta_bars(d, baseline="rceil", ax=Figure().subplots())
        >>> [t.get_text() for t in ax.get_yticklabels()]
        ['gaussian', 'laplace']
    """
    if hasattr(deltas, "to_dict") and hasattr(deltas, "columns"):
        if baseline is None and "baseline" in deltas.columns and len(deltas):
            baseline = str(deltas["baseline"].iloc[0])
        deltas = _from_frame(deltas, group, series, "delta", "delta_lo", "delta_hi")
    groups = list(deltas)
    names = _series_of(deltas)
    ax = _axes(ax, (8, 0.8 + 0.45 * len(groups) * max(len(names), 1)))
    height = 0.8 / max(len(names), 1)
    pos = np.arange(len(groups))[::-1].astype(float)
    lows, highs = [0.0], [0.0]
    for i, s in enumerate(names):
        trip = np.array([_split(deltas[g].get(s, np.nan)) for g in groups], dtype=float)
        vals, lo, hi = trip[:, 0], trip[:, 1], trip[:, 2]
        has_err = np.isfinite(lo) & np.isfinite(hi)
        xerr = np.where(has_err, [vals - lo, hi - vals], 0.0) if has_err.any() else None
        y = pos + ((len(names) - 1) / 2 - i) * height
        bars = ax.barh(y, vals, height * 0.9, label=s, xerr=xerr, capsize=2,
                       error_kw={"elinewidth": 1}, color=f"C{i % 10}")
        ax.bar_label(bars, labels=["" if np.isnan(v) else fmt.format(v) for v in vals],
                     fontsize=7, padding=3)
        lows += list(np.where(has_err, lo, vals)[np.isfinite(vals)])
        highs += list(np.where(has_err, hi, vals)[np.isfinite(vals)])
    span = max(max(highs) - min(lows), 1e-12)
    ax.set_xlim(min(lows) - 0.18 * span, max(highs) + 0.18 * span)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(pos, groups)
    label = xlabel or ("Δ" + (f" vs {baseline}" if baseline else ""))
    _label_axes(ax, label, None, title)
    ax.grid(True, axis="x", alpha=0.3)
    _legend_outside(ax)
    return ax


def plot_estimates(
    table,
    *,
    ax=None,
    ylabel: Optional[str] = None,
    title: Optional[str] = None,
    group: str = "input",
    series: str = "format",
    value: str = "sqnr_db",
):
    """Point estimates with interval whiskers: ``table[group][series] = v or (v, low, high)``.

    Groups along x, one marker shape per series (dodged sideways so they never overlap);
    the y axis is fitted to the data — points, unlike bars, need no zero. Also takes a
    DataFrame from :func:`compare` (``group``, ``series`` and ``value`` columns, intervals
    from ``<value>_lo`` / ``<value>_hi``).

    Example:
        >>> from matplotlib.figure import Figure
        >>> t = {"gaussian": {"mxfp4": (18.8, 18.7, 18.9), "mxfp8_e4m3": 31.5}}
        >>> ax = plot_estimates(t, ylabel="SQNR (dB)", ax=Figure().subplots())
        >>> ax.get_legend_handles_labels()[1]
        ['mxfp4', 'mxfp8_e4m3']
    """
    if hasattr(table, "to_dict") and hasattr(table, "columns"):
        table = _from_frame(table, group, series, value, value + "_lo", value + "_hi")
    groups = list(table)
    names = _series_of(table)
    ax = _axes(ax, (7, 4))
    width = 0.7 / max(len(names), 1)
    pos = np.arange(len(groups), dtype=float)
    for i, s in enumerate(names):
        trip = np.array([_split(table[g].get(s, np.nan)) for g in groups], dtype=float)
        vals, lo, hi = trip[:, 0], trip[:, 1], trip[:, 2]
        has_err = np.isfinite(lo) & np.isfinite(hi)
        yerr = np.where(has_err, [vals - lo, hi - vals], 0.0) if has_err.any() else None
        ax.errorbar(pos + (i - (len(names) - 1) / 2) * width, vals, yerr=yerr, fmt=_MARKERS[i % len(_MARKERS)],
                    markersize=6, markerfacecolor="none", markeredgewidth=1.4, capsize=3,
                    color=f"C{i % 10}", label=s, linestyle="none")
    ax.set_xticks(pos, groups)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    _label_axes(ax, None, ylabel, title)
    ax.grid(True, axis="y", alpha=0.3)
    _legend_outside(ax)
    return ax
