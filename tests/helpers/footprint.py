"""Where the suite's time and memory go: CPU seconds and peak RSS per test.

A pytest plugin, on only with ``--footprint-log=DIR`` (``scripts/suite_footprint.py --profile``
passes it). Wall time on a shared machine measures the other users as much as the suite, so each
test's cost is recorded as what does not depend on load:

* ``cpu``: CPU seconds of the pytest process (every thread: XLA compiles and runs on several)
  over the test's setup, call and teardown (``time.process_time``);
* ``child_cpu``: CPU seconds of the subprocesses the test started (CLI runs, sharding checks:
  ``getrusage(RUSAGE_CHILDREN)`` for those waited for; notebook kernels, which are killed
  instead, as last sampled);
* ``rss``: the process's resident memory after the test, ``peak``: its highest during the test,
  ``child_peak``: the highest summed RSS of its live subprocesses during the test (sampled
  every 0.1 s by a thread);
* ``wall``: seconds on the clock (compared with ``cpu`` it shows sleeping or waiting tests);
* ``compiles``: XLA compilations in the pytest process (JAX's backend-compile events), and
  ``compile_s`` their seconds with tracing and lowering: the count does not depend on load,
  so it shows what sharing compiled programs saves where CPU seconds are noisy;
  ``cache_hits``: how many of them were read from the persistent compilation cache.

Each process (xdist worker or plain pytest) appends one JSON object per test to
``DIR/<worker>.jsonl``, then a ``session`` record with its total CPU seconds and start-up
(import and collection) cost. ``scripts/suite_footprint.py --report DIR`` sums them.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from pathlib import Path

import pytest

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    """Resident bytes of this process (``/proc/self/statm``; cheap enough for every sample)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _children_usage(pid: int) -> tuple:
    """(summed RSS, {pid: CPU seconds}) of the live descendants of ``pid`` (psutil: ships
    with ipykernel)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover
        return 0, {}
    total, cpu = 0, {}
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return 0, {}
    for child in children:
        try:
            with child.oneshot():
                total += child.memory_info().rss
                times = child.cpu_times()
                cpu[child.pid] = times.user + times.system
        except psutil.Error:
            pass
    return total, cpu


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class _Sampler(threading.Thread):
    """Keeps the highest own and summed-children RSS since the last ``take()``, and the last
    CPU seconds seen of each descendant: a notebook's kernel is killed, not waited for, so
    ``RUSAGE_CHILDREN`` never counts it."""

    def __init__(self, period: float = 0.1):
        super().__init__(daemon=True, name="footprint-sampler")
        self.period = period
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.peak = self.child_peak = 0
        self.child_cpu: dict = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.period):
            own, (kids, cpu) = _rss(), _children_usage(self.pid)
            with self.lock:
                self.peak = max(self.peak, own)
                self.child_peak = max(self.child_peak, kids)
                self.child_cpu.update(cpu)

    def take(self) -> tuple:
        with self.lock:
            out = (self.peak, self.child_peak, sum(self.child_cpu.values()))
            self.peak = self.child_peak = 0
            self.child_cpu = {}
        return out


class FootprintPlugin:
    def __init__(self, directory: Path, worker: str):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{worker}.jsonl"
        self.worker = worker
        self.out = open(self.path, "a", buffering=1)
        self.sampler = _Sampler()
        self.sampler.start()
        self.first_test_cpu = None
        self.compiles, self.compile_s = 0, 0.0
        from jax import monitoring

        self.cache_hits = 0
        monitoring.register_event_duration_secs_listener(self._on_event)
        monitoring.register_event_listener(self._on_count)

    def _on_count(self, event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event.startswith("/jax/core/compile/"):
            self.compile_s += duration
            if event.endswith("backend_compile_duration"):
                self.compiles += 1

    def _write(self, record: dict) -> None:
        self.out.write(json.dumps(record) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if self.first_test_cpu is None:
            self.first_test_cpu = time.process_time()
        self.sampler.take()
        cpu0, kids0, wall0 = time.process_time(), _children_cpu(), time.perf_counter()
        compiles0, compile_s0, hits0 = self.compiles, self.compile_s, self.cache_hits
        yield
        cpu, kids, wall = time.process_time(), _children_cpu(), time.perf_counter()
        peak, child_peak, sampled_kids = self.sampler.take()
        rss = _rss()
        self._write({
            "test": item.nodeid,
            "cpu": round(cpu - cpu0, 4),
            # Waited-for subprocesses exactly, or what the sampler saw of those never waited
            # for (to within its last 0.1 s), whichever is more.
            "child_cpu": round(max(kids - kids0, sampled_kids), 4),
            "wall": round(wall - wall0, 4),
            "compiles": self.compiles - compiles0,
            "compile_s": round(self.compile_s - compile_s0, 4),
            "cache_hits": self.cache_hits - hits0,
            "rss": rss,
            "peak": max(peak, rss),
            "child_peak": child_peak,
            "slow": item.get_closest_marker("slow") is not None,
        })

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session):
        self.sampler.stop.set()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self._write({
            "session": self.worker,
            "cpu": round(time.process_time(), 3),
            "startup_cpu": round(self.first_test_cpu or time.process_time(), 3),
            "child_cpu": round(_children_cpu(), 3),
            "maxrss": usage.ru_maxrss * 1024,
        })
        self.out.close()


def pytest_addoption(parser):
    parser.addoption(
        "--footprint-log", metavar="DIR", default=None,
        help="record CPU seconds and peak RSS per test into DIR/<worker>.jsonl "
        "(tests/helpers/footprint.py; summed by scripts/suite_footprint.py --report DIR)",
    )


def pytest_configure(config):
    directory = config.getoption("footprint_log", None)
    if not directory:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None and getattr(config.option, "numprocesses", None) not in (None, 0):
        return  # the xdist controller runs no tests; its workers record
    config.pluginmanager.register(
        FootprintPlugin(Path(directory), worker or "main"), "lowprec-footprint"
    )
