"""Error analysis of low-precision formats: metrics, ULPs, bounds, MX block statistics,
stochastic rounding, value tables, one-call comparisons with confidence intervals, and plots.

One argument order throughout: the array first, the format second (``ulp(x, "e4m3")``,
``quantization_error_bound(x, "mxfp4")``), as :func:`lowprec.quantize_mx`; metrics take
``(reference, approx)``. Scalar metrics return Python floats (0-d arrays while traced, so
they still work under ``jit``/``vmap``). Element and MX formats are accepted alike wherever
it makes sense (ULPs, bounds, :func:`compare`).

* Metrics (``_metrics``): :func:`sqnr_db`, :func:`max_abs_error`, :func:`mean_abs_error`,
  :func:`rms_error`, :func:`mean_error`, :func:`relative_error`, :func:`max_rel_error`,
  :func:`mean_rel_error`, :func:`underflow_rate`, :func:`overflow_rate`, :func:`nan_rate`,
  :func:`clipping_rate`, :func:`error_stats`.
* ULPs (``_ulp``): :func:`ulp`, :func:`ulp_error`.
* Bounds (``_bounds``): :func:`quantization_error_bound`, :func:`dot_error_bound`.
* MX blocks (``_mx_stats``): :func:`mx_scale_exponents`, :func:`mx_clipping_rate`.
* Stochastic rounding (``_stochastic``): :func:`rounding_neighbors`,
  :func:`stochastic_rounding_stats`, :func:`quantized_cumsum`.
* Value tables (``_values``): :func:`representable_values`, :func:`value_spacing`,
  :func:`format_info`, :func:`format_table`, :func:`markdown_table`.
* Comparison (``_compare``, needs pandas: ``pip install 'lowprec[analysis]'``):
  :func:`compare`, :func:`summarize`, :func:`paired_delta`, :func:`confidence_interval`,
  :func:`sample`, :data:`DISTRIBUTIONS`, :func:`row_subsets`; the scale phase
  (:func:`phase_of`, :func:`stratified_phases`, :func:`phase_sweep`) and the tidy export
  :func:`long_format`.
* Per-block view (``_views``, needs pandas): :func:`block_stats`.
* Rotations (``_rotation``): :func:`random_hadamard` (NVFP4's random Hadamard transform, in
  blocks of 16, 32 or any power of two, along any axis).
* Plots (``_plots``, need matplotlib: ``pip install 'lowprec[notebooks]'``, imported only
  when a plot is drawn): :func:`plot_value_grid`, :func:`plot_spacing`,
  :func:`plot_histograms`, :func:`plot_error_vs_magnitude`, :func:`plot_curves`,
  :func:`plot_grouped_bars`, :func:`plot_delta_bars`, :func:`plot_estimates`.

Example:
    >>> import jax.numpy as jnp
    >>> import lowprec
    >>> from lowprec import analysis
    >>> x = jnp.linspace(-1.0, 1.0, 64)
    >>> round(analysis.sqnr_db(x, lowprec.fake_quantize_mx(x, "mxfp8_e4m3")), 1)
    32.0
"""

from ._mx_stats import mx_clipping_rate, mx_scale_exponents
from ._bounds import dot_error_bound, quantization_error_bound
from ._compare import (
    DISTRIBUTIONS,
    compare,
    confidence_interval,
    long_format,
    paired_delta,
    phase_of,
    phase_sweep,
    row_subsets,
    sample,
    stratified_phases,
    summarize,
)
from ._metrics import (
    clipping_rate,
    error_stats,
    max_abs_error,
    max_rel_error,
    mean_abs_error,
    mean_error,
    mean_rel_error,
    nan_rate,
    overflow_rate,
    relative_error,
    rms_error,
    sqnr_db,
    underflow_rate,
)
from ._plots import (
    plot_curves,
    plot_delta_bars,
    plot_error_vs_magnitude,
    plot_estimates,
    plot_grouped_bars,
    plot_histograms,
    plot_spacing,
    plot_value_grid,
)
from ._rotation import random_hadamard
from ._views import block_stats
from ._stochastic import quantized_cumsum, rounding_neighbors, stochastic_rounding_stats
from ._ulp import ulp, ulp_error
from ._values import format_info, format_table, markdown_table, representable_values, value_spacing

__all__ = [
    "DISTRIBUTIONS",
    "block_stats",
    "clipping_rate",
    "compare",
    "confidence_interval",
    "dot_error_bound",
    "error_stats",
    "format_info",
    "format_table",
    "long_format",
    "markdown_table",
    "max_abs_error",
    "max_rel_error",
    "mean_abs_error",
    "mean_error",
    "mean_rel_error",
    "mx_clipping_rate",
    "mx_scale_exponents",
    "nan_rate",
    "overflow_rate",
    "paired_delta",
    "phase_of",
    "phase_sweep",
    "plot_curves",
    "plot_delta_bars",
    "plot_error_vs_magnitude",
    "plot_estimates",
    "plot_grouped_bars",
    "plot_histograms",
    "plot_spacing",
    "plot_value_grid",
    "quantization_error_bound",
    "quantized_cumsum",
    "random_hadamard",
    "relative_error",
    "representable_values",
    "rms_error",
    "rounding_neighbors",
    "row_subsets",
    "sample",
    "sqnr_db",
    "stochastic_rounding_stats",
    "stratified_phases",
    "summarize",
    "ulp",
    "ulp_error",
    "underflow_rate",
    "value_spacing",
]
