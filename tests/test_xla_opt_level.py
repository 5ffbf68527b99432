"""The suite compiles at XLA:CPU's optimization level 0 with the classic emitters
(tests/helpers/xla_opt.py): the bits the library's programs produce must be those of XLA's
default flags, which users run."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from helpers import xla_opt

TESTS = pathlib.Path(__file__).parent


def test_the_run_compiles_at_level_0_with_classic_emitters_unless_told_otherwise():
    yes, no = (lambda flag: True), (lambda flag: False)
    emitters = xla_opt.EMITTERS + "=false"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    xla_opt.apply(env, gpu=False, known=yes)
    assert env["XLA_FLAGS"] == (
        "--xla_force_host_platform_device_count=4 " + xla_opt.FLAG + "=0 " + emitters)
    # A jaxlib that does not know the emitter flag would abort on it: left out.
    unknown = {}
    xla_opt.apply(unknown, gpu=False, known=no)
    assert unknown["XLA_FLAGS"] == xla_opt.FLAG + "=0"
    kept = {"XLA_FLAGS": xla_opt.FLAG + "=2 " + xla_opt.EMITTERS + "=true", xla_opt.ENV: "0"}
    xla_opt.apply(kept, gpu=False, known=yes)
    assert kept["XLA_FLAGS"] == xla_opt.FLAG + "=2 " + xla_opt.EMITTERS + "=true"
    default = {xla_opt.ENV: "default"}
    xla_opt.apply(default, gpu=False, known=yes)
    assert "XLA_FLAGS" not in default
    # A GPU plugin: the PTX checks need LLVM's optimized code, unless the level is asked for.
    gpu = {}
    xla_opt.apply(gpu, gpu=True, known=yes)
    assert "XLA_FLAGS" not in gpu
    asked = {xla_opt.ENV: "1"}
    xla_opt.apply(asked, gpu=True, known=yes)
    assert asked["XLA_FLAGS"] == xla_opt.FLAG + "=1 " + emitters
    with pytest.raises(ValueError, match="LOWPREC_TEST_XLA_OPT='fast'"):
        xla_opt.apply({xla_opt.ENV: "fast"})
    assert xla_opt.without_flag(env["XLA_FLAGS"]) == "--xla_force_host_platform_device_count=4"


def test_this_jaxlib_is_probed_for_the_emitter_flag():
    assert xla_opt.flag_known("--xla_backend_optimization_level=0")
    assert not xla_opt.flag_known("--xla_lowprec_no_such_flag=1")


@pytest.mark.slow
def test_bits_do_not_depend_on_the_optimization_level():
    """The same digest of quantizer, dequantizer and matmul outputs compiled at this run's
    flags (level 0 and the classic emitters unless LOWPREC_TEST_XLA_OPT or a GPU plugin says
    otherwise) and, in a subprocess, with XLA's default flags."""
    here = xla_opt.digest()
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{xla_opt.ENV: "default"})
    env["XLA_FLAGS"] = xla_opt.without_flag(env.get("XLA_FLAGS", ""))
    proc = subprocess.run(
        [sys.executable, "-c", "from helpers import xla_opt; print(xla_opt.digest())"],
        capture_output=True, text=True, env=env, cwd=TESTS, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == here
