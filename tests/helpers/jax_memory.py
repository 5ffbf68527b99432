"""Keeps a test process's memory bounded: JAX's compiled programs are dropped past a limit.

Every distinct jitted program (or eager primitive) a test compiles stays in JAX's caches for
the life of the process, about 1-10 MB each with its machine code. A pytest-xdist worker
running half of the suite's ~6,000 tests compiles thousands of them: its resident memory grew
to 6.3 GiB, two of them (one per core) to more than a 16 GB laptop has. After each test whose
process holds more than ``limit`` bytes, ``release`` empties JAX's caches
(``jax.clear_caches``), collects garbage and hands the freed pages back to the system
(glibc's ``malloc_trim``: without it the freed heap stays resident). The price is
recompiling, later, programs that more tests would have shared; set the limit with
``LOWPREC_TEST_RSS_LIMIT_MIB`` (0 turns the release off).

What a release costs: after one, tests/test_mx.py run alone recompiled 7 more programs (341
against 334 without releases) and spent ~4 CPU s more (52.5 -> 56.8 s, a noisy figure). A
worker's memory after a release is not back to its start (0.5 GiB early in a run, 1.0-1.1 GiB
late: the tests' own caches of inputs and expected values), so at a 1.5 GiB limit the workers
released every ~0.5 GiB, 33 times per run; at 2 GiB they release about half as often.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys

_PAGE = os.sysconf("SC_PAGE_SIZE")
#: 2 GiB per process: two workers at their limit plus the largest growth of one test (0.42 GiB),
#: pytest (0.15 GiB) and the largest subprocess (the sharding batch, 0.94 GiB) sum to ~5.9 GiB,
#: under 8 GiB with 2 GiB to spare (at 1.5 GiB the run's measured summed peak was 4.54 GiB).
DEFAULT_LIMIT_MIB = 2048


def limit_bytes() -> int:
    """The limit from ``LOWPREC_TEST_RSS_LIMIT_MIB`` (MiB; 0 = never release)."""
    value = os.environ.get("LOWPREC_TEST_RSS_LIMIT_MIB", str(DEFAULT_LIMIT_MIB))
    try:
        mib = int(value)
    except ValueError:
        raise ValueError(
            f"LOWPREC_TEST_RSS_LIMIT_MIB={value!r} is not a whole number of MiB "
            f"(e.g. {DEFAULT_LIMIT_MIB}; 0 turns the release off)"
        ) from None
    return mib * 2**20


def rss() -> int:
    """Resident bytes of this process (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def _malloc_trim() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl): nothing to trim
        pass


def release(limit: int) -> bool:
    """Drops JAX's compiled programs if this process holds more than ``limit`` bytes.

    Returns whether it did. Only JAX's caches are emptied: live arrays and the tests' own
    caches of inputs and expected values are kept.
    """
    if limit <= 0 or rss() <= limit or "jax" not in sys.modules:
        return False
    sys.modules["jax"].clear_caches()
    gc.collect()
    _malloc_trim()
    return True
