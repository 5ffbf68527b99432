"""Sharded arrays on 4 CPU devices: same bits as one device, and blocks never split.

The cases live in ``tests/sharded_cases.py``; they run in a subprocess because
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` only takes effect before JAX
initializes, and this process has initialized it with one device (the rest of the suite
must keep seeing one). The subprocess is an ordinary pytest run, so its report names each
failing case.

One subprocess runs the cases of every share the session selected (one JAX start-up and
collection instead of one per share), once per test run: the first share test to need the
results runs it, under a file lock that the other xdist workers wait on, and leaves the
outcome of every case in a JSON file beside the lock; each share test then passes or fails on
its own cases (tests/helpers/sharded.py sorts them).
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from helpers import sharded, tiers

CASES = pathlib.Path(__file__).with_name("sharded_cases.py")


def _run_batch(shares: list, junit: pathlib.Path) -> dict:
    """Runs the cases of ``shares`` in one subprocess on 4 CPU devices; returns
    {"cases": {name: [outcome, message]}, "returncode", "report"}."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env[sharded.ENV] = ",".join(shares)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider", "-rfEs",
         "-n", "0", f"--junitxml={junit}"],
        capture_output=True, text=True, env=env, cwd=CASES.parent.parent, timeout=1800,
    )
    cases = {}
    if junit.exists():
        for case in ET.parse(junit).iter("testcase"):
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = child.tag
                    message = (child.get("message") or "") + "\n" + (child.text or "")
                    break
            cases[case.get("name")] = [outcome, message[-3000:]]
    return {"cases": cases, "returncode": proc.returncode,
            "report": proc.stdout[-6000:] + proc.stderr[-2000:]}


def _selected_shares(session) -> list:
    return sorted({item.callspec.params["share"] for item in session.items
                   if item.originalname == "test_sharded_cases_on_four_cpu_devices"})


@pytest.fixture(scope="session")
def sharded_results(request, tmp_path_factory):
    """The batch's results: run here, or read from the run another xdist worker made."""
    shares = _selected_shares(request.session)
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return _run_batch(shares, tmp_path_factory.mktemp("sharded") / "junit.xml")
    import fcntl

    # The workers' base temporary directories share this parent, unique to the test run.
    root = tmp_path_factory.getbasetemp().parent
    done = root / "sharded_cases.json"
    with open(root / "sharded_cases.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if done.exists():
            return json.loads(done.read_text())
        results = _run_batch(shares, root / "sharded_cases.xml")
        tmp = done.with_suffix(".tmp")
        tmp.write_text(json.dumps(results))
        tmp.replace(done)
        return results


# The quick share last: the first share test to run pays for the whole batch, and in the
# default run that should be a slow one (whose cases are most of the batch), so that a profile
# of the default run (scripts/suite_footprint.py's "quick s") charges the quick tier with no
# more than its own cases; in the quick tier (-m "not slow") the quick share is the only one.
@pytest.mark.parametrize("share", [
    pytest.param("blocks_and_matmuls", marks=pytest.mark.slow),
    pytest.param("recipes", marks=pytest.mark.slow),
    pytest.param("training", marks=pytest.mark.slow),
    pytest.param("transformer", marks=pytest.mark.slow),
    "quick",
])
def test_sharded_cases_on_four_cpu_devices(share, sharded_results):
    mine = {name: result for name, result in sharded_results["cases"].items()
            if sharded.share_of(name.split("[")[0]) == share}
    report = sharded_results["report"]
    # Guard against a vacuous pass (the subprocess failing before its cases ran).
    assert mine, f"no {share} case ran:\n{report}"
    everything_passed = all(r[0] == "passed" for r in sharded_results["cases"].values())
    assert sharded_results["returncode"] == 0 or not everything_passed, (
        f"the subprocess failed outside its cases:\n{report}")
    bad = {name: result for name, result in mine.items() if result[0] != "passed"}
    assert not bad, f"{len(bad)} of {len(mine)} {share} cases did not pass:\n" + "\n".join(
        f"{name}: {outcome}: {message}" for name, (outcome, message) in bad.items())


# What the default run's sample of the cases (tests/helpers/tiers.py: the cases of
# sharded_cases.py marked ``extended`` run only with LOWPREC_FULL_SUITE=1) must still cover,
# each value in the parameters of some case that ran: every recipe, both kinds of mesh axes,
# every mesh layout (the expert-parallel layout: the ragged test), and the transformer block
# on Explicit axes (both Flax APIs' blocks: the extended sweep).
COVERED = {
    "recipe": {"nvidia_mxfp8", "ocp_mxfp8", "fp8_hybrid", "ste_mxfp8", "nvidia_nvfp4"},
    "mesh axes": {"explicit", "auto"},
    "layout": {"data", "tensor", "data_tensor", "fsdp"},
}


def _functions() -> set:
    tree = ast.parse(CASES.read_text(encoding="utf-8"))
    return {node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


@pytest.mark.slow  # checks the default run's batch: it skips in the quick tier
def test_the_sample_covers_every_function_recipe_layout_and_block(request):
    if set(_selected_shares(request.session)) != set(sharded.SHARES):
        pytest.skip("covers the whole batch: run with every share selected (the default run)")
    sharded_results = request.getfixturevalue("sharded_results")
    ran = sorted(sharded_results["cases"])
    listing = "\n".join(ran)
    # Every test function (each exact-bits check, each error, each training form) ran.
    missing = _functions() - {name.split("[")[0] for name in ran}
    assert not missing, f"functions with no case in this run: {sorted(missing)}\n{listing}"
    values = {v for name in ran if "[" in name for v in name.split("[")[1].rstrip("]").split("-")}
    for what, wanted in COVERED.items():
        assert wanted <= values, f"no case with {what} {sorted(wanted - values)}:\n{listing}"
    blocks = {tuple(name.split("[")[1].split("-")[:2]) for name in ran
              if name.startswith("test_transformer_block_training_matches_one_device[")}
    wanted = {("linen", "explicit"), ("nnx", "explicit")} if tiers.full_suite() else {
        ("linen", "explicit")}
    assert wanted <= blocks, listing
    print(f"{len(ran)} sharded cases ran:\n{listing}")
