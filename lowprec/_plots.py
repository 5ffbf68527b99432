"""Matplotlib helpers for the error studies (matplotlib is imported inside each helper).

Every helper draws on ``ax`` when given one and otherwise on a new ``pyplot`` figure,
and returns the axes. ``import lowprec`` and ``import lowprec.analysis`` never import
matplotlib; install it with ``pip install 'lowprec[notebooks]'``.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ._analysis import representable_values, value_spacing
from ._format import ELEMENT_FORMAT_NAMES, ElementFormat, element_format

FormatLike = Union[str, ElementFormat]

# One colour per element format, the same in every plot.
_FORMAT_COLORS = {name: f"C{i}" for i, name in enumerate(ELEMENT_FORMAT_NAMES)}

__all__ = [
    "plot_curves",
    "plot_grouped_bars",
    "plot_histograms",
    "plot_spacing",
    "plot_value_grid",
]


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


def plot_spacing(
    fmts: Iterable[FormatLike], *, relative: bool = False, ax=None, title: Optional[str] = None
):
    """Gap to the next value vs value, on log-log axes, for each format.

    ``relative=True`` plots gap/value: the sawtooth between 2^-mantissa_bits and
    2^-(mantissa_bits+1) in the normal range, rising in the subnormal range. Runs of
    equal gaps are reduced to their end points, which is exact on log-log axes, so even
    TF32's 2^18 values draw quickly.

    Example:
        >>> from matplotlib.figure import Figure
        >>> ax = plot_spacing(["e4m3", "bf16"], relative=True, ax=Figure().subplots())
        >>> [line.get_label() for line in ax.get_lines()]
        ['e4m3', 'bf16']
    """
    ax = _axes(ax, (8, 4.5))
    for fmt in fmts:
        fmt = element_format(fmt)
        values, gaps = _runs(*value_spacing(fmt))
        ax.plot(values, gaps / values if relative else gaps, label=fmt.name, linewidth=1.2,
                color=_FORMAT_COLORS.get(fmt.name))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    _label_axes(ax, "value", "gap / value" if relative else "gap to next value", title)
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    return ax


def plot_histograms(
    samples: Mapping[str, np.ndarray],
    *,
    bins: Union[int, Sequence[float]] = 100,
    ax=None,
    xlabel: Optional[str] = None,
    title: Optional[str] = None,
    logy: bool = False,
    density: bool = True,
):
    """Overlaid step histograms of several samples (e.g. relative errors per rounding mode).

    Example:
        >>> from matplotlib.figure import Figure
        >>> ax = plot_histograms({"a": np.zeros(3), "b": np.ones(3)}, bins=4,
        ...                      ax=Figure().subplots())
        >>> ax.get_legend_handles_labels()[1]
        ['a', 'b']
    """
    ax = _axes(ax, (7, 4))
    for label, values in samples.items():
        ax.hist(np.asarray(values).ravel(), bins=bins, histtype="step", density=density,
                label=label, linewidth=1.2)
    if logy:
        ax.set_yscale("log")
    _label_axes(ax, xlabel, "density" if density else "count", title)
    ax.legend(fontsize=8)
    return ax


def plot_curves(
    x,
    curves: Mapping[str, np.ndarray],
    *,
    bounds: Optional[Mapping[str, np.ndarray]] = None,
    bands: Optional[Mapping[str, Tuple[np.ndarray, np.ndarray]]] = None,
    ax=None,
    logx: bool = False,
    logy: bool = False,
    xlabel: Optional[str] = None,
    ylabel: Optional[str] = None,
    title: Optional[str] = None,
    marker: Optional[str] = "o",
    bound_suffix: str = " bound",
    legend_bounds: bool = True,
):
    """Line plot of several curves over a shared ``x``, with optional bounds and bands.

    Args:
      x: shared abscissa.
      curves: label → y values (solid lines with markers).
      bounds: label → y values drawn dashed in the colour of the curve with the same
        label (labels not in ``curves`` get their own colour), labelled
        ``label + bound_suffix``.
      bands: label → (low, high), shaded in the colour of the curve with that label.
      legend_bounds: list the dashed lines in the legend too (off: say what they are in
        the title instead, which keeps crowded legends readable).

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
    colors = {}
    for i, (label, y) in enumerate(curves.items()):
        (line,) = ax.plot(x, np.asarray(y), marker=marker, markersize=3, label=label,
                          color=f"C{i % 10}")
        colors[label] = line.get_color()
    extra = len(colors)
    for label, y in (bounds or {}).items():
        color = colors.get(label)
        if color is None:
            color, extra = f"C{extra % 10}", extra + 1
        ax.plot(x, np.asarray(y), linestyle="--", color=color, label=f"{label}{bound_suffix}")
    for label, (lo, hi) in (bands or {}).items():
        ax.fill_between(x, np.asarray(lo), np.asarray(hi), color=colors.get(label), alpha=0.2,
                        linewidth=0)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    _label_axes(ax, xlabel, ylabel, title)
    handles = [line for line in ax.get_lines()
               if legend_bounds or line.get_linestyle() != "--"]
    ax.legend(handles=handles, fontsize=8)
    ax.grid(True, alpha=0.3)
    return ax


def plot_grouped_bars(
    table: Mapping[str, Mapping[str, float]],
    *,
    ax=None,
    ylabel: Optional[str] = None,
    title: Optional[str] = None,
    annotate: bool = True,
    fmt: str = "{:.1f}",
):
    """Grouped bar chart: ``table[group][series] = value`` (groups along x).

    Example:
        >>> from matplotlib.figure import Figure
        >>> t = {"gauss": {"floor": 31.0, "rceil": 30.5}, "laplace": {"floor": 29.0, "rceil": 28.7}}
        >>> ax = plot_grouped_bars(t, ax=Figure().subplots())
        >>> [t.get_text() for t in ax.get_xticklabels()]
        ['gauss', 'laplace']
    """
    ax = _axes(ax, (8, 4))
    groups = list(table)
    series = []
    for g in groups:
        series += [s for s in table[g] if s not in series]
    width = 0.8 / max(len(series), 1)
    pos = np.arange(len(groups))
    for i, s in enumerate(series):
        vals = np.array([table[g].get(s, np.nan) for g in groups], dtype=float)
        bars = ax.bar(pos + (i - (len(series) - 1) / 2) * width, vals, width, label=s)
        if annotate:
            ax.bar_label(bars, labels=[fmt.format(v) for v in vals], fontsize=7, padding=1)
    ax.set_xticks(pos, groups)
    _label_axes(ax, None, ylabel, title)
    ax.legend(fontsize=8)
    return ax
