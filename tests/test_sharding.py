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

CASES = pathlib.Path(__file__).with_name("sharded_cases.py")

# The quick tier's share of the cases (one subprocess, ~10 s of CPU): quantize_mx sharded
# every way, deterministic and stochastic, and the split-block error. The others (the block
# functions and matmuls; the recipes; training against one device: MLPs and experts; a
# transformer block in linen and nnx) run as four slow shares, each its own subprocess, so
# that pytest-xdist can run them side by side; `pytest` runs all five.
QUICK = ("test_quantize_mx_bits_same_sharded or test_stochastic_quantize_mx_same_sharded"
         " or test_split_block_is_a_clear_error_eager")
TRAINING = "recipe or training"
SHARES = {
    "quick": QUICK,
    "blocks_and_matmuls": f"not ({QUICK}) and not ({TRAINING})",
    "recipes": f"not ({QUICK}) and recipe and not training",
    "training": f"not ({QUICK}) and training and not transformer",
    "transformer": f"not ({QUICK}) and transformer",
}


@pytest.mark.parametrize("share", [
    "quick",
    pytest.param("blocks_and_matmuls", marks=pytest.mark.slow),
    pytest.param("recipes", marks=pytest.mark.slow),
    pytest.param("training", marks=pytest.mark.slow),
    pytest.param("transformer", marks=pytest.mark.slow),
])
def test_sharded_cases_on_four_cpu_devices(share):
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=4".strip()
    env["JAX_PLATFORMS"] = "cpu"
    select = SHARES[share]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider", "-rfEs",
         "-n", "0", "-k", select],
        capture_output=True, text=True, env=env, cwd=CASES.parent.parent, timeout=600,
    )
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"sharded cases failed:\n{report}"
    # Guard against a vacuous pass (e.g. everything skipped for lack of devices).
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, report

