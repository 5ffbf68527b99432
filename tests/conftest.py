"""What every test file needs: the Hypothesis profiles, the ``element_cases`` marker and the
quick tier's ``quick_cases`` marker.

Helpers live in importable modules under tests/helpers/ (assertions, oracles, input
generators, the {reference, eager, jit} codec harness); test files import what they use.
"""

from __future__ import annotations

import os

# Before NumPy loads OpenBLAS (nothing imports NumPy before this file): one BLAS thread. The
# suite's products are small, and OpenBLAS's idle workers spin after each one, burning CPU
# seconds for nothing (analysis.compare's matmul_rel_error: 9-21 ms of CPU per call on 2
# threads, 0.6 ms on one). Inherited by every subprocess (CLI runs, notebook kernels).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest
from hypothesis import HealthCheck, settings

from helpers import jax_memory, sharded, tiers, xla_opt

# Before any test starts JAX's backend: compile at XLA:CPU's level 0 (tests/helpers/xla_opt.py).
xla_opt.apply()

# --footprint-log=DIR: CPU seconds and peak RSS per test (scripts/suite_footprint.py --profile).
pytest_plugins = ["helpers.footprint"]

# --------------------------------------------------------------------------------------------
# Hypothesis profiles.
#
# "ci" (the default) is deterministic: derandomize=True seeds every test's example generation
# from a hash of the test itself, and database=None stops examples saved by earlier runs from
# changing what is run. A CI failure therefore reproduces on any machine with the same
# Hypothesis version, and a green run stays green. The price is that CI never explores new
# examples; run `pytest --hypothesis-profile=explore` (random seeds, 20x the examples, saves
# failures to the local database) to search for new counterexamples, and pin any you find with
# @example. deadline=None: the first example of a test pays for JAX tracing and XLA
# compilation (0.1-0.3 s), which would otherwise trip Hypothesis' 200 ms deadline.
# max_examples is kept low because the element tests are parametrized over ~90 (format,
# rounding, overflow) combinations times two implementations; the breadth comes from the
# parametrization and from format-aware input strategies, not from many examples per case.
_COMMON = dict(
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", derandomize=True, database=None, max_examples=10, **_COMMON)
settings.register_profile("explore", derandomize=False, max_examples=200, **_COMMON)
settings.load_profile("ci")  # `--hypothesis-profile=NAME` (the Hypothesis plugin) overrides it



def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "element_cases(formats='all_elements', roundings='all', overflows=None, impls='all'): "
        "parametrize fmt / rounding / overflow / codec (see tests/helpers/codecs.py)",
    )
    config.addinivalue_line("markers", tiers.MARKER)
    config.addinivalue_line("markers", tiers.QUICK_FIRST_MARKER)
    config.addinivalue_line("markers", tiers.EXTENDED_MARKER)


def pytest_generate_tests(metafunc):
    # Imported here, not above: helpers.codecs imports JAX and lowprec, which the xdist
    # controller (it collects nothing) would otherwise hold in memory for the whole run.
    from helpers.codecs import parametrize_element_cases

    parametrize_element_cases(metafunc)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    tiers.mark_slow_outside_quick_cases(items)
    tiers.deselect_outside_default_run(config, items)
    sharded.deselect_other_shares(config, items)  # tests/test_sharding.py's subprocess
    sharded.run_first(items)


def pytest_report_header(config):
    if tiers.full_suite():
        return "lowprec: the extended sweep (LOWPREC_FULL_SUITE=1): every parametrized case"
    return ("lowprec: pairwise-covering cases of tests with 3+ parameters "
            "(LOWPREC_FULL_SUITE=1 runs them all; tests/helpers/tiers.py)")


_RSS_LIMIT = jax_memory.limit_bytes()


@pytest.hookimpl(trylast=True)  # after the test's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    # A worker keeps every program it compiled: past the limit, JAX's caches are emptied
    # (tests/helpers/jax_memory.py), so that two workers fit a laptop beside their subprocesses.
    jax_memory.release(_RSS_LIMIT)
