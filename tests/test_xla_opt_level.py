"""The suite compiles at XLA:CPU's optimization level 0 with its classic emitters
(tests/helpers/xla_opt.py): the bits the library's programs produce must be those of XLA's
defaults, which users run."""

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
    xla_opt.apply(env, gpu=False, emitters_flag=False)
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4 " + xla_opt.FLAG + "=0"
    kept = {"XLA_FLAGS": xla_opt.FLAG + "=2", xla_opt.ENV: "0"}
    xla_opt.apply(kept, gpu=False, emitters_flag=False)
    assert kept["XLA_FLAGS"] == xla_opt.FLAG + "=2"
    default = {xla_opt.ENV: "default"}
    xla_opt.apply(default, gpu=False, emitters_flag=True)
    assert "XLA_FLAGS" not in default
    # A GPU plugin: the PTX checks need LLVM's optimized code, unless the level is asked for.
    gpu = {}
    xla_opt.apply(gpu, gpu=True, emitters_flag=False)
    assert "XLA_FLAGS" not in gpu
    asked = {xla_opt.ENV: "1"}
    xla_opt.apply(asked, gpu=True, emitters_flag=False)
    assert asked["XLA_FLAGS"] == xla_opt.FLAG + "=1"
    with pytest.raises(ValueError, match="LOWPREC_TEST_XLA_OPT='fast'"):
        xla_opt.apply({xla_opt.ENV: "fast"})
    assert xla_opt.without_flag(env["XLA_FLAGS"]) == "--xla_force_host_platform_device_count=4"


def test_the_classic_emitters_where_jaxlib_knows_the_flag():
    # Where jaxlib accepts the flag it is added; an XLA flag a jaxlib does not know aborts the
    # process, so then it is not. Beside a GPU plugin neither flag is: the plugin parses
    # XLA_FLAGS with its own XLA (every worker died at start on an H200, jax 0.11.2).
    on = {}
    xla_opt.apply(on, gpu=False, emitters_flag=True)
    assert on["XLA_FLAGS"].split() == [xla_opt.FLAG + "=0", xla_opt.EMITTERS + "=false"]
    gpu = {}
    xla_opt.apply(gpu, gpu=True, emitters_flag=True)
    assert "XLA_FLAGS" not in gpu
    unknown = {}
    xla_opt.apply(unknown, gpu=False, emitters_flag=False)
    assert xla_opt.EMITTERS not in unknown["XLA_FLAGS"]
    chosen = {"XLA_FLAGS": xla_opt.EMITTERS + "=true"}
    xla_opt.apply(chosen, gpu=False, emitters_flag=True)
    assert chosen["XLA_FLAGS"].split() == [xla_opt.EMITTERS + "=true", xla_opt.FLAG + "=0"]
    assert xla_opt.without_flag(on["XLA_FLAGS"]) == ""
    # Probed once per run: the answer travels to workers and subprocesses in the environment.
    told = {xla_opt.EMITTERS_KNOWN: "0"}
    xla_opt.apply(told, gpu=False)
    assert xla_opt.EMITTERS not in told["XLA_FLAGS"]


@pytest.mark.slow  # three Python processes that start JAX
def test_the_flag_lookup_starts_jax_with_the_flag():
    # A flag every XLA defines is found, a made-up one is not.
    assert xla_opt.knows_flag("--xla_cpu_enable_fast_math")
    assert not xla_opt.knows_flag("--xla_cpu_no_such_flag_lowprec")
    # The probe behind it starts JAX with the flags: a flag XLA does not know aborts that
    # process, which is the failure the probe exists to see.
    assert xla_opt.accepts(xla_opt.FLAG + "=0")
    assert not xla_opt.accepts("--xla_cpu_no_such_flag_lowprec=false")


@pytest.mark.slow
def test_bits_do_not_depend_on_the_optimization_level():
    """The same digest of quantizer, dequantizer and matmul outputs compiled with this run's
    flags (level 0 and the classic emitters unless LOWPREC_TEST_XLA_OPT or a GPU plugin says
    otherwise) and, in a subprocess, with XLA's defaults."""
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
