"""The suite compiles at XLA:CPU's optimization level 0 (tests/helpers/xla_opt.py): the bits
the library's programs produce must be those of XLA's default level, which users run."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from helpers import xla_opt

TESTS = pathlib.Path(__file__).parent


def test_the_run_compiles_at_level_0_unless_told_otherwise():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    xla_opt.apply(env, gpu=False)
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4 " + xla_opt.FLAG + "=0"
    kept = {"XLA_FLAGS": xla_opt.FLAG + "=2", xla_opt.ENV: "0"}
    xla_opt.apply(kept, gpu=False)
    assert kept["XLA_FLAGS"] == xla_opt.FLAG + "=2"
    default = {xla_opt.ENV: "default"}
    xla_opt.apply(default, gpu=False)
    assert "XLA_FLAGS" not in default
    # A GPU plugin: the PTX checks need LLVM's optimized code, unless the level is asked for.
    gpu = {}
    xla_opt.apply(gpu, gpu=True)
    assert "XLA_FLAGS" not in gpu
    asked = {xla_opt.ENV: "1"}
    xla_opt.apply(asked, gpu=True)
    assert asked["XLA_FLAGS"] == xla_opt.FLAG + "=1"
    with pytest.raises(ValueError, match="LOWPREC_TEST_XLA_OPT='fast'"):
        xla_opt.apply({xla_opt.ENV: "fast"})
    assert xla_opt.without_flag(env["XLA_FLAGS"]) == "--xla_force_host_platform_device_count=4"


@pytest.mark.slow
def test_bits_do_not_depend_on_the_optimization_level():
    """The same digest of quantizer, dequantizer and matmul outputs compiled at this run's
    level (0 unless LOWPREC_TEST_XLA_OPT or a GPU plugin says otherwise) and, in a
    subprocess, at XLA's default level."""
    here = xla_opt.digest()
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{xla_opt.ENV: "default"})
    env["XLA_FLAGS"] = xla_opt.without_flag(env.get("XLA_FLAGS", ""))
    # tests/ on the path by name: under PYTHONSAFEPATH (CI's plain pytest, suite_footprint.py)
    # the working directory is not, and "from helpers import ..." failed there.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", "from helpers import xla_opt; print(xla_opt.digest())"],
        capture_output=True, text=True, env=env, cwd=TESTS, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == here
