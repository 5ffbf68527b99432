"""The examples run as documented (slow lane: ``pytest -m "not slow"`` skips them)."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import warnings

import jax
import pytest

pytestmark = pytest.mark.slow

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_runs_without_warnings():
    proc = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", str(EXAMPLES / "quickstart.py")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "e4m3" in proc.stdout and "mxfp4" in proc.stdout


def test_train_mlp_example_tracks_fp32():
    example = _load("train_mlp")
    teacher = example.make_teacher(jax.random.key(42))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        fp32, _ = example.train(example.CONFIGS["fp32"], 40, teacher)
        mxfp8, _ = example.train(example.CONFIGS["mxfp8"], 40, teacher)
    assert fp32[-10:].mean() < 0.8 * fp32[:10].mean()  # it learns
    assert abs(mxfp8[-10:].mean() - fp32[-10:].mean()) < 0.05 * fp32[-10:].mean()
