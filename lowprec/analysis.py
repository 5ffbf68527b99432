"""Error analysis of low-precision formats: metrics, value tables, bounds and plot helpers.

``import lowprec.analysis`` does not import matplotlib; the ``plot_*`` helpers import it
when called (``pip install 'lowprec[notebooks]'``).

Metrics take ``(reference, approx)`` and are jittable:
:func:`sqnr_db`, :func:`max_abs_error`, :func:`mean_abs_error`, :func:`rms_error`,
:func:`mean_error` (bias), :func:`relative_error`, :func:`max_rel_error`,
:func:`mean_rel_error`, :func:`underflow_rate`, :func:`clipping_rate`,
:func:`error_stats` (all at once); per format: :func:`ulp`, :func:`ulp_error`,
:func:`quantization_error_bound`; MX: :func:`mx_scale_exponents`,
:func:`mx_clipping_rate`, :func:`mx_error_bound`; matmul: :func:`dot_error_bound`;
stochastic rounding: :func:`rounding_neighbors`, :func:`stochastic_rounding_stats`,
:func:`quantized_cumsum`; value tables: :func:`representable_values`,
:func:`value_spacing`, :func:`format_info`, :func:`format_table`, :func:`markdown_table`.

Example:
    >>> import jax.numpy as jnp
    >>> import lowprec
    >>> from lowprec import analysis
    >>> x = jnp.linspace(-1.0, 1.0, 64)
    >>> round(float(analysis.sqnr_db(x, lowprec.fake_quantize_mx(x, "mxfp8_e4m3"))), 1)
    32.0
"""

from ._analysis import (
    clipping_rate,
    dot_error_bound,
    error_stats,
    format_info,
    format_table,
    markdown_table,
    max_abs_error,
    max_rel_error,
    mean_abs_error,
    mean_error,
    mean_rel_error,
    mx_clipping_rate,
    mx_error_bound,
    mx_scale_exponents,
    quantization_error_bound,
    quantized_cumsum,
    relative_error,
    representable_values,
    rms_error,
    rounding_neighbors,
    sqnr_db,
    stochastic_rounding_stats,
    ulp,
    ulp_error,
    underflow_rate,
    value_spacing,
)
from ._plots import (
    plot_curves,
    plot_grouped_bars,
    plot_histograms,
    plot_spacing,
    plot_value_grid,
)

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
    "plot_curves",
    "plot_grouped_bars",
    "plot_histograms",
    "plot_spacing",
    "plot_value_grid",
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
