"""Sharded arrays on 4 CPU devices: same bits as one device, and blocks never split.

The cases live in ``tests/sharded_cases.py``; they run in a subprocess because
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` only takes effect before JAX
initializes, and this process has initialized it with one device (the rest of the suite
must keep seeing one). The subprocess is an ordinary pytest run, so its report names each
failing case.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # ~20-30 s of XLA compiles; `pytest -m "not slow"` skips it

CASES = pathlib.Path(__file__).with_name("sharded_cases.py")


def test_sharded_cases_on_four_cpu_devices():
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider", "-rfEs",
         "-n", "0"],
        capture_output=True, text=True, env=env, cwd=CASES.parent.parent, timeout=600,
    )
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"sharded cases failed:\n{report}"
    # Guard against a vacuous pass (e.g. everything skipped for lack of devices).
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, report

