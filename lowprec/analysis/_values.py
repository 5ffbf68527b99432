"""Value tables: every finite value of a format, the gaps between them, a format's range and
precision at a glance, and a Markdown renderer for tables of results."""

from __future__ import annotations

import functools
import math
from typing import Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from .._codec import decode
from .._finfo import finfo
from .._format import ELEMENT_FORMAT_NAMES, MXFormat, element_format
from .._format import ElementFormatLike as FormatLike


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


def _element(fmt, fn: str):
    if isinstance(fmt, MXFormat):
        raise ValueError(
            f"{fn} takes an element format; {fmt!r} is a block (MX) format: pass its element "
            f"format {fmt.element.name!r}"
        )
    return element_format(fmt)


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
    values = _all_finite_values(_element(fmt, "representable_values").name)
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

    A flat, table-friendly view of :func:`lowprec.finfo` (use that for the ml_dtypes-style
    object), with the quantities error studies quote. Keys: ``name``, ``bits``, ``exponent_bits``, ``mantissa_bits``, ``max_finite``,
    ``min_normal``, ``min_subnormal`` (smallest positive value), ``eps`` (gap above 1),
    ``unit_roundoff`` (eps/2: max relative error of round-to-nearest in the normal range),
    ``decimal_digits`` (log10 2^p, p the significant bits of the top binade:
    mantissa_bits + 1, or mantissa_bits for a format without normal numbers such as the MX
    INT8 element, whose ``min_normal`` is None), ``dynamic_range_binades``
    (log2 max_finite/min_subnormal), ``normal_binades`` (emax − emin + 1),
    ``finite_values`` (distinct finite values, ±0 counted once), ``inf``, ``nan``.

    Example:
        >>> info = format_info("e4m3")
        >>> info["max_finite"], info["min_subnormal"], info["finite_values"]
        (448.0, 0.001953125, 253)
        >>> round(info["dynamic_range_binades"], 2)
        17.81
        >>> i8 = format_info("ocp_int8")   # MXINT8's element: k/64 for k in [-128, 127]
        >>> i8["max_finite"], i8["min_subnormal"], i8["min_normal"], i8["finite_values"]
        (1.984375, 0.015625, None, 256)
    """
    fmt = _element(fmt, "format_info")
    fi = finfo(fmt)
    has_normals = fmt.emax >= fmt.emin
    # Significant bits of the top binade: M + 1 with an implicit bit; M where every value
    # is "subnormal" (MX INT8 k/64: 7 bits for 127).
    top_bits = fmt.emax - fmt.top_quantum_exponent + 1
    return {
        "name": fi.name,
        "bits": fi.bits,
        "exponent_bits": fi.nexp,
        "mantissa_bits": fi.nmant,
        "max_finite": fi.max,
        "min_normal": fi.smallest_normal if has_normals else None,
        "min_subnormal": fi.smallest_subnormal,
        "eps": fi.eps,
        "unit_roundoff": fi.eps / 2,
        "decimal_digits": top_bits * math.log10(2),
        "dynamic_range_binades": math.log2(fi.max) - math.log2(fi.smallest_subnormal),
        "normal_binades": fi.maxexp - fi.minexp,   # emax - emin + 1
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
    if v is None:
        return "—"
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if getattr(v, "shape", None) == ():  # 0-d NumPy/JAX arrays
        v = v.item()
    if isinstance(v, (float, np.floating)):
        return format(float(v), floatfmt)
    return str(v)


def markdown_table(
    rows,
    columns: Optional[Sequence[str]] = None,
    *,
    floatfmt: Union[str, Mapping[str, str]] = ".4g",
) -> str:
    """Renders rows as a Markdown table (for ``IPython.display.Markdown``).

    Args:
      rows: a list of dicts, or a pandas DataFrame.
      columns: the columns to show, in order (default: all, in the order of the first row).
      floatfmt: format spec for floats (including NumPy and 0-d JAX scalars), or a mapping
        column → spec (columns not in it get ``".4g"``).

    Example:
        >>> print(markdown_table([{"name": "e2m1", "max": 6.0}, {"name": "e4m3", "max": 448.0}]))
        | name | max |
        |---|---|
        | e2m1 | 6 |
        | e4m3 | 448 |
    """
    if hasattr(rows, "to_dict") and hasattr(rows, "columns"):  # a pandas DataFrame
        rows = rows.to_dict("records")
    rows = list(rows)
    if columns is None:
        columns = list(rows[0]) if rows else []
    specs = floatfmt if isinstance(floatfmt, Mapping) else {}
    default = ".4g" if isinstance(floatfmt, Mapping) else floatfmt
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = (_fmt_cell(row[c], specs.get(c, default)) for c in columns)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
