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

Every sample also counts the process's minor page faults per call (``getrusage``). With
glibc's malloc, XLA's output buffers of more than a few MiB come from fresh ``mmap`` pages on
every call (4 KiB pages: 4096 faults per 16 MiB), which caps a memory-bound kernel near the
page-fault rate and made earlier tables swing several-fold between runs. ``run_all.py``
therefore runs the benchmarks with jemalloc preloaded when it is installed (buffers are
reused: ~0 faults per call); the tables state the allocator and the fault counts, so a row
taken with fresh pages is visible as such.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import statistics
import time
from typing import Any, Callable, Dict, List, Union

import jax


@dataclasses.dataclass
class Timing:
    """Per-call wall times (seconds) of one case."""

    samples: List[float]  # one per round, each the mean over `number` back-to-back calls
    number: int  # calls per sample
    faults: List[float] = dataclasses.field(default_factory=list)  # minor faults per call, per round

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

    @property
    def faults_per_call(self) -> float:
        """Median minor page faults per call."""
        return statistics.median(self.faults) if self.faults else float("nan")

    def as_dict(self) -> dict:
        return {
            "median_s": self.median,
            "min_s": self.min,
            "spread": self.spread,
            "number": self.number,
            "samples_s": self.samples,
            "minor_faults_per_call": self.faults,
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
            f0 = minor_faults()
            t0 = time.perf_counter()
            for _ in range(n):
                _call(fn)
            results[name].samples.append((time.perf_counter() - t0) / n)
            results[name].faults.append((minor_faults() - f0) / n)
    return results


def minor_faults() -> int:
    """Minor page faults of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def allocator() -> str:
    """The malloc in use: a preloaded jemalloc/tcmalloc (from /proc/self/maps), else glibc."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown"
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if f"lib{name}" in maps:
            return name
    return "glibc malloc"


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
    import platform

    import ml_dtypes
    import numpy as np

    import lowprec

    dev = jax.devices()[0]
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "allocator": allocator(),
        "load_average": os.getloadavg(),
        "cpu_model": cpu,
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


def fmt_faults(t: Result) -> str:
    """Minor faults per call as a table cell (``-`` for a case that did not run)."""
    if not isinstance(t, Timing) or not t.faults:
        return "-"
    v = t.faults_per_call
    return f"{v:,.0f}" if v >= 1 else "0"


def header_line(env: dict) -> str:
    """One line naming the conditions of a run: machine, allocator, load, versions."""
    load = ", ".join(f"{v:.1f}" for v in env.get("load_average", ()))
    return (f"{env.get('cpu_model', '?')}, {env.get('cpu_count', '?')} CPUs, {env['platform']}; "
            f"allocator: {env.get('allocator', '?')}; load average at start: {load}; "
            f"jax {env['jax']}, ml_dtypes {env['ml_dtypes']}, lowprec {env['lowprec']}; "
            f"{env['date']}")


def stream_case(nbytes: int):
    """A zero-argument jitted streaming kernel over ``nbytes`` of uint32 (read once, write
    once): the memory-bandwidth peer behind the roofline columns. Returns (callable,
    bytes moved per call)."""
    import jax.numpy as jnp

    x = jnp.arange(max(1, nbytes // 4), dtype=jnp.uint32)
    f = jax.jit(lambda v: v ^ jnp.uint32(0x5A5A5A5A))
    return (lambda: f(x)), 2 * 4 * x.size


def write_atomic(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file in the same folder and a rename,
    so a reader never sees a half-written file."""
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
