"""Per-block view of an MX quantization: where in a tensor the error sits.

A tensor-level SQNR pools every block; :func:`block_stats` gives one row per block (its
maximum, its scale factor, its own SQNR, clip and underflow rates), so the distribution over
blocks — e.g. the quantiles of the per-block SQNR — can be read off with pandas. Needs pandas
(``pip install 'lowprec[analysis]'``).
"""

from __future__ import annotations

import numpy as np

from .._bits import E8M0_BIAS
from .._options import check_block_input
from .._format import MXFormatLike, mx_format
from .._scale_rules import DEFAULT_SCALE_RULE
from ._common import as_f32, require_pandas
from ._mx_stats import roundtrip


def _blocks(a, axis: int, padded: int, block: int, mode: str = "constant") -> np.ndarray:
    """``a`` with ``axis`` moved last, padded to ``padded`` and split into rows of ``block``."""
    a = np.moveaxis(np.asarray(a), axis, -1)
    extra = padded - a.shape[-1]
    if extra:
        a = np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)], mode=mode)
    return a.reshape(-1, block)


def block_stats(x, fmt: MXFormatLike, *, axis: int = -1, scale_rule=None,
                rounding: str = "nearest_even", pad: bool = False, key=None):
    """One row per block of ``x`` quantized to ``fmt``: the per-block view of the error.

    Blocks are numbered in C order of ``x`` with ``axis`` moved last. Columns: ``block``,
    ``n`` (elements of ``x`` in the block; less than the block size only in a block padded
    with ``pad=True``), ``amax`` (max |x|), ``scale`` (the factor each element is divided by:
    2^e for E8M0 scales, tensor scale × block scale for NVFP4; NaN for a NaN/inf block),
    ``sqnr_db`` (the block's own SQNR over its finite pairs: +inf for a block reproduced
    exactly, NaN for a block with no finite nonzero signal), ``clip_rate`` (|x| above
    max_elem · scale) and ``underflow_rate`` (nonzero → 0).

    Args:
      x: a floating-point array with at least one axis.
      fmt: an MX format (name or object).
      axis: the block axis; out of range raises.
      scale_rule: the E8M0 scale rule (default: lowprec's default rule); must be None for
        NVFP4, which has its own recipe.
      rounding, key: the element rounding (``key`` for ``"stochastic"``).
      pad: zero-pad a partial last block instead of raising, as :func:`lowprec.quantize_mx`.

    Returns:
      A pandas DataFrame.

    Example:
        >>> import numpy as np
        >>> x = np.concatenate([np.full(32, 1.0), np.linspace(0.01, 1.0, 32)]).astype(np.float32)
        >>> b = block_stats(x, "mxfp4", scale_rule="floor")
        >>> b[["block", "n", "amax", "scale"]].values.tolist()
        [[0.0, 32.0, 1.0, 0.25], [1.0, 32.0, 1.0, 0.25]]
        >>> float(b["sqnr_db"].iloc[0]), bool(10 < b["sqnr_db"].iloc[1] < 30)
        (inf, True)
    """
    pd = require_pandas("block_stats")
    fmt = mx_format(fmt)
    x = as_f32(x)
    ax, n, padded = check_block_input(x.shape, np.float32, fmt, axis, pad, "block_stats")
    if not fmt.scheme.takes_scale_rule:
        if scale_rule is not None:
            raise ValueError(
                f"{fmt.name} has its own scale recipe; drop scale_rule (got {scale_rule!r})"
            )
        rule = None
    else:
        rule = DEFAULT_SCALE_RULE if scale_rule is None else scale_rule
    q, s = roundtrip(x, fmt, ax, rule, rounding, key)
    block = fmt.block_size
    xb = _blocks(np.asarray(x, np.float64), ax, padded, block)
    qb = _blocks(np.asarray(q, np.float64), ax, padded, block)
    real = _blocks(np.ones(x.shape, bool), ax, padded, block)
    s = np.asarray(s)
    if not fmt.scheme.exponent_scales:  # the scheme's float32 factors
        factor = np.asarray(s, np.float64)
    else:
        e = s.astype(np.int64)
        factor = np.where(e > E8M0_BIAS, np.nan, np.ldexp(1.0, np.minimum(e, E8M0_BIAS)))
    factor = _blocks(factor, ax, padded, block, mode="edge")[:, 0]
    finite = np.isfinite(xb) & np.isfinite(qb)
    xf, qf = np.where(finite, xb, 0.0), np.where(finite, qb, 0.0)
    signal = np.sum(xf * xf, axis=1)
    noise = np.sum(np.square(qf - xf), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        sqnr = np.where(signal > 0, 10 * np.log10(signal / noise), np.nan)
    count = real.sum(axis=1)
    limit = float(fmt.element.max_finite) * factor
    clipped = (np.isfinite(xb) & (np.abs(xb) > limit[:, None]) & real).sum(axis=1)
    under = ((xb != 0) & (qb == 0) & real).sum(axis=1)
    with np.errstate(invalid="ignore"):
        amax = np.max(np.where(real, np.abs(xb), 0.0), axis=1)
    return pd.DataFrame({
        "block": np.arange(xb.shape[0], dtype=np.int64),
        "n": count.astype(np.int64),
        "amax": amax,
        "scale": factor,
        "sqnr_db": sqnr,
        "clip_rate": clipped / np.maximum(count, 1),
        "underflow_rate": under / np.maximum(count, 1),
    })

