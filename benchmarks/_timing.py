"""Shared timing helper for the lowprec benchmarks.

The machines these run on are shared and noisy (a 2-core CPU box where other test suites
run at the same time), so every peer of a comparison is timed in the same process, in
interleaved rounds (the order rotates every round), and the *median* of the rounds is
reported: background load then hits every method alike and ratios stay fair.

Usage::

    from _timing import time_interleaved

    timings = time_interleaved({"lowprec": lambda: f(x), "numpy": lambda: g(x_np)}, reps=7)
    timings["lowprec"].median  # seconds per call

A case is a zero-argument callable. Its first call (compilation, allocation, caches) is a
warm-up and is never timed; every timed call ends with ``jax.block_until_ready`` on the
result, so JAX's asynchronous dispatch is included and nothing is left running. Cases
faster than ``min_sample_s`` are called several times per sample (the count is calibrated
from the warm-up) so that timer and dispatch jitter stay small.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Union

import jax


@dataclasses.dataclass
class Timing:
    """Per-call wall times (seconds) of one case."""

    samples: List[float]  # one per round, each the mean over `number` back-to-back calls
    number: int  # calls per sample

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def spread(self) -> float:
        """(max − min) / median over the rounds: a rough noise indicator."""
        return (max(self.samples) - min(self.samples)) / self.median

    def as_dict(self) -> dict:
        return {
            "median_s": self.median,
            "min_s": self.min,
            "spread": self.spread,
            "number": self.number,
            "samples_s": self.samples,
        }


Result = Union[Timing, str]  # a string "n/a: why" for a case that could not run


def _call(fn: Callable[[], Any]) -> None:
    jax.block_until_ready(fn())


def time_interleaved(
    cases: Dict[str, Callable[[], Any]],
    *,
    reps: int = 7,
    min_sample_s: float = 0.02,
    max_number: int = 1000,
) -> Dict[str, Result]:
    """Times each zero-argument callable in ``cases`` over ``reps`` interleaved rounds.

    Returns, per case, a :class:`Timing` (seconds per call) or a ``"n/a: ..."`` string if
    its warm-up call raised (e.g. a conversion with no lowering on this backend).
    """
    results: Dict[str, Result] = {}
    number: Dict[str, int] = {}
    for name, fn in cases.items():
        try:
            _call(fn)  # compile + warm up, never timed
            t0 = time.perf_counter()
            _call(fn)  # second call: a steady-state estimate for calibration
            once = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - a peer that cannot run is a table entry
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            results[name] = f"n/a: {type(e).__name__}: {first[:80]}"
            continue
        number[name] = max(1, min(max_number, math.ceil(min_sample_s / max(once, 1e-9))))
        results[name] = Timing([], number[name])
    names = list(number)
    for r in range(reps):
        k = r % len(names) if names else 0
        for name in names[k:] + names[:k]:  # rotate so no case always follows the same one
            fn, n = cases[name], number[name]
            t0 = time.perf_counter()
            for _ in range(n):
                _call(fn)
            results[name].samples.append((time.perf_counter() - t0) / n)
    return results


def speed_ratio(a: Result, b: Result) -> float:
    """How many times faster ``a`` is than ``b``: median over rounds of ``t_b / t_a``.

    Both were timed in the same rounds, so each round's ratio compares them under the same
    background load; its median is steadier than a ratio of two medians. NaN if either
    case did not run.
    """
    if not (isinstance(a, Timing) and isinstance(b, Timing)):
        return float("nan")
    return statistics.median(tb / ta for ta, tb in zip(a.samples, b.samples))


def rate(n: float, t: Result) -> float:
    """``n / seconds`` for a Timing (median), NaN for a case that did not run."""
    return n / t.median if isinstance(t, Timing) else float("nan")


def fmt_num(v: float, digits: int = 1) -> str:
    """A table cell: ``n/a`` for NaN, otherwise fixed-point with thousands separators."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:,.{digits}f}"


def fmt_ratio(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.2f}x"


def render_table(headers: List[str], rows: List[List[str]], right: tuple = ()) -> str:
    """Plain-text (and Markdown-compatible) table; columns in ``right`` are right-aligned."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]

    def line(cells):
        out = []
        for i, c in enumerate(cells):
            c = str(c)
            out.append(c.rjust(widths[i]) if i in right else c.ljust(widths[i]))
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(
        ("-" * (w + 1) + ":") if i in right else ("-" * (w + 2)) for i, w in enumerate(widths)
    ) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def json_safe(obj):
    """``obj`` with NaN/inf floats replaced by None, so the dump is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def environment() -> dict:
    """Versions and device, for the JSON dumps."""
    import os
    import platform

    import ml_dtypes
    import numpy as np

    import lowprec

    dev = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "ml_dtypes": ml_dtypes.__version__,
        "numpy": np.__version__,
        "lowprec": lowprec.__version__,
        "platform": dev.platform,
        "device": getattr(dev, "device_kind", str(dev)),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
