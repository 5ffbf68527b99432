"""The suite's three tiers: which cases of a parametrized test each keeps.

* ``pytest -m "not slow"``, the quick tier (about 3 minutes on 2 cores): below;
* ``pytest``, the default run (the README's command, at most 10 minutes on 2 idle cores):
  every test function, and of a test parametrized over three or more parameters a
  pairwise-covering subset of its cases (``covering_cases`` below: each value of every
  parameter meets each value of every other);
* ``LOWPREC_FULL_SUITE=1 pytest``, the extended sweep: every case of every cross product,
  and the cases marked ``extended`` (below).

``pytest -m "not slow"`` leaves out the cases marked ``slow``:
whole tests marked ``@pytest.mark.slow`` (exhaustive sweeps, notebooks, examples, subprocess
runs, training loops), and the cases a ``quick_cases`` marker leaves out of a big
parametrization::

    @pytest.mark.quick_cases(fmt=QUICK_MX, axis=(1,))
    @pytest.mark.parametrize("fmt", MX)
    @pytest.mark.parametrize("axis", [0, 1])
    def test_something(fmt, axis): ...

keeps, in the quick tier, the cases whose ``fmt`` is in ``QUICK_MX`` and whose ``axis`` is 1;
every case still runs in the extended sweep. ``@pytest.mark.quick_first(n)`` keeps the first
``n`` cases of a parametrized test (in collection order) where any representative case
exercises the same code. ``element_cases`` tests are thinned by their own rule
(``helpers.codecs.in_quick_tier``), which keeps every format and rounding mode.

What is left out of the quick tier was chosen from ``pytest -m "not slow" --durations=0``: tests
taking seconds whose code paths other quick tests also run (one recipe or format of several,
one case of a sweep), so the tier still imports and runs every module.
"""

from __future__ import annotations

import itertools
import os

import pytest

#: One element format per code path of the encoders: 16-bit, 19-bit (TF32), 8-bit without
#: and with infinities, fnuz (no negative zero), 6-bit, 4-bit, unsigned E8M0, integer.
QUICK_ELEMENTS = ("bf16", "tf32", "e4m3", "e5m2", "e4m3fnuz", "e2m3", "e2m1", "e8m0", "ocp_int8")

#: One block format per element width and scale kind: MXFP8, MXFP4, the two-level NVFP4.
QUICK_MX = ("mxfp8_e4m3", "mxfp4", "nvfp4")

MARKER = (
    "quick_cases(**values): in the quick tier (-m 'not slow') keep only the cases whose "
    "parameters take these values; the others are marked slow (see tests/helpers/tiers.py)"
)


QUICK_FIRST_MARKER = (
    "quick_first(n): in the quick tier (-m 'not slow') keep only the first n cases of this "
    "parametrized test (see tests/helpers/tiers.py)"
)


EXTENDED_MARKER = (
    "extended: a case of a hand-picked list that only the extended sweep (LOWPREC_FULL_SUITE=1) "
    "runs: other cases of the default run cover each of its parameter values "
    "(see tests/helpers/tiers.py)"
)


def mark_slow_outside_quick_cases(items) -> None:
    """Marks ``slow`` the cases that a ``quick_cases`` or ``quick_first`` marker leaves out
    of the quick tier."""
    seen: dict = {}
    for item in items:
        marker = item.get_closest_marker("quick_cases")
        if marker is not None and not _in_quick_cases(item, marker):
            item.add_marker(pytest.mark.slow)
            continue
        first = item.get_closest_marker("quick_first")
        if first is None or item.get_closest_marker("slow") is not None:
            continue
        # Counted among the cases still in the quick tier, in collection order.
        key = (item.path, getattr(item, "originalname", item.name))
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > first.args[0]:
            item.add_marker(pytest.mark.slow)


def _in_quick_cases(item, marker) -> bool:
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    for name, values in marker.kwargs.items():
        if name not in params:
            raise pytest.UsageError(
                f"{item.nodeid}: quick_cases names {name!r}, which is not one of its "
                f"parameters {sorted(params)}"
            )
        if params[name] not in tuple(values):
            return False
    return True


# --------------------------------------------------------------------------------------------
# The default run and the extended sweep.
#
# ``pytest`` (the README's command) runs every test function but, of a test parametrized over
# three or more parameters, only a covering subset of its cases: every pair of values of any
# two of its parameters (every (format, rounding), (format, implementation), (rounding,
# overflow), ...) appears in at least one case kept, as JAX's own suite keeps a sample of its
# cross products (JAX_NUM_GENERATED_CASES). The quick tier's cases are always among those kept
# (``pytest -m "not slow"`` stays a subset of ``pytest``), and the others are added greedily,
# each time the case meeting the most pairs still missing (first in collection order on a
# tie), so the subset is the same on every xdist worker. A test of one parameter keeps every
# case, and so does one of two parameters with cases in the quick tier (its pairs are its
# cases); a two-parameter sweep its author marked slow as a whole (its code paths run in quick
# tests) keeps every value of each parameter at least once. ``LOWPREC_FULL_SUITE=1 pytest``
# runs the full cross products: the extended sweep.
#
# A hand-picked list of cases (not a cross product: ``parametrize("kind,layout,recipe",
# [...])``, each case chosen for what it checks) is thinned by hand instead: a case marked
# ``pytest.param(..., marks=pytest.mark.extended)`` runs only in the extended sweep, and its
# author keeps each of its parameter values in some case of the default run (the sharded
# batch checks this of its own cases: tests/test_sharding.py).

FULL_SUITE_ENV = "LOWPREC_FULL_SUITE"


def full_suite() -> bool:
    """Whether this run is the extended sweep (``LOWPREC_FULL_SUITE=1``)."""
    return os.environ.get(FULL_SUITE_ENV, "0").strip() not in ("", "0")


def _value_key(value):
    # Equal parameter values must give equal keys within one collection; objects without
    # value equality (codecs, arrays) are the same object in every case that uses them.
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return ("value", type(value).__name__, repr(value))


def _combinations(item, strength: int) -> frozenset:
    """The (parameter, value) combinations of ``strength`` parameters that ``item`` covers."""
    params = item.callspec.params
    keys = [(n, _value_key(params[n])) for n in sorted(params)]
    return frozenset(itertools.combinations(keys, strength))


def covering_cases(items) -> list:
    """The items of the default run: per test function, a covering subset of its parametrized
    cases that includes its quick-tier cases (see above)."""
    groups: dict = {}
    dropped = {i for i, item in enumerate(items) if item.get_closest_marker("extended") is not None}
    for index, item in enumerate(items):
        if index in dropped:
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is None or len(callspec.params) < 2:
            continue
        key = (item.path, getattr(item, "originalname", item.name), tuple(sorted(callspec.params)))
        groups.setdefault(key, []).append(index)
    for indices in groups.values():
        kept = [i for i in indices if items[i].get_closest_marker("slow") is None]
        n_params = len(items[indices[0]].callspec.params)
        if n_params == 2 and kept:
            continue  # a grid with quick cases: every pair is a case, all kept
        # Pairs of values; a two-parameter sweep with no case in the quick tier (a test its
        # author marked slow as a whole: its code paths run in quick tests) keeps each value.
        strength = 2 if n_params >= 3 else 1
        combos = {i: _combinations(items[i], strength) for i in indices}
        needed = set().union(*combos.values())
        for i in kept:
            needed -= combos[i]
        quick = set(kept)
        candidates = [i for i in indices if i not in quick]
        while needed:
            best = max(candidates, key=lambda i: (len(combos[i] & needed), -i))
            needed -= combos[best]
            kept.append(best)
            candidates.remove(best)
        dropped.update(candidates)
    return [item for i, item in enumerate(items) if i not in dropped]


def deselect_outside_default_run(config, items) -> None:
    """Leaves the extended sweep's extra cases out of the run unless ``LOWPREC_FULL_SUITE=1``."""
    if full_suite():
        return
    kept = covering_cases(items)
    if len(kept) == len(items):
        return
    kept_ids = {id(item) for item in kept}
    # A case named on the command line (tests/test_x.py::test_y[e4m3-up]) runs as asked.
    named = ["::" + arg.split("::", 1)[1] for arg in config.args if "::" in arg and "[" in arg]
    kept_ids |= {id(item) for item in items if any(item.nodeid.endswith(n) for n in named)}
    kept = [item for item in items if id(item) in kept_ids]
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept_ids])
    config._lowprec_extended = len(items) - len(kept)
    items[:] = kept
