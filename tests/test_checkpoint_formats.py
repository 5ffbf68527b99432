"""Checkpoint storage of the block formats beyond MXFP4/MXFP8 (MXFP6, MXINT8, NVFP4, other
block sizes) and of the FNUZ FP8 casts: bytes and values against reference/ and the library's
in-memory API, streaming pieces against the whole tensor, and the errors for formats a
safetensors file cannot hold."""

from __future__ import annotations

import json

import jax.numpy as jnp
import lowprec_reference as ref
import ml_dtypes
import numpy as np
import pytest

import lowprec
import lowprec.checkpoint._convert as convert_mod
from lowprec.checkpoint import (
    CheckpointError,
    SafetensorsReader,
    canonical_format,
    dequantize_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    quantize_checkpoint,
)

from helpers.asserts import assert_bits_equal, bit_pattern
from helpers.checkpoints import raw_tensors, save

try:
    from safetensors import safe_open
except ImportError:  # the independent implementation is optional
    safe_open = None


def weights(rng, shape, dtype=np.float32):
    """Magnitudes varying by row, an all-zero block, float32 subnormals and a -0.0."""
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 3, size=shape[:-1] + (1,)))
    x = x.astype(np.float32)
    flat = x.reshape(-1, 32)
    flat[1] = 0.0
    flat[2] *= np.float32(2.0**-120)
    flat[3, 5] = -0.0
    return x.astype(dtype)


CODE_BITS = {"mxfp6_e2m3": 6, "mxfp6_e3m2": 6, "mxint8": 8, "nvfp4": 4, "mxfp4": 4}

# Every new block format, each MX scale rule at least once, a block size other than the
# format's own (by name and by argument), bf16 and f16 inputs.
ROUND_TRIPS = [
    ("mxfp6_e2m3", "floor", None, np.float32),
    ("mxfp6_e3m2", "rceil", None, ml_dtypes.bfloat16),
    ("mxint8", "even", None, np.float16),
    ("mxint8", "ceil", 16, np.float32),
    ("nvfp4", None, None, ml_dtypes.bfloat16),
    ("mxfp6_e3m2_b8", "floor", None, np.float32),
]


@pytest.mark.quick_cases(fmt=["mxfp6_e3m2", "nvfp4"])
@pytest.mark.parametrize("fmt,rule,block_size,dtype", ROUND_TRIPS,
                         ids=[f"{f}-{r}-{b}-{np.dtype(d).name}" for f, r, b, d in ROUND_TRIPS])
@pytest.mark.quick_first(1)
def test_block_format_round_trip_matches_reference_and_library(tmp_path, fmt, rule, block_size,
                                                                dtype):
    """quantize -> file -> dequantize: stored bytes are reference/'s packed codes (FP6: four
    codes per three bytes, little-endian) and scales, and decoded values are
    lowprec.dequantize(lowprec.quantize_mx(...)) bit for bit, in float32 and the original dtype."""
    rng = np.random.default_rng(11)
    x = weights(rng, (4, 64), dtype)
    path, out, back = tmp_path / "m.safetensors", tmp_path / "q.safetensors", tmp_path / "d.st"
    save(path, {"w": x})
    rep = quantize_checkpoint(path, out, fmt, scale_rule=rule, block_size=block_size,
                              include="w")
    name = canonical_format(fmt, block_size)
    fmt_obj = lowprec.mx_format(name)
    (t,) = rep.tensors
    assert t.format == name and t.scale_rule == rule
    stored = raw_tensors(out)
    base = fmt_obj.base_name
    # reference/: unpacked codes, scale codes (and the NVFP4 tensor scale)
    got_ref = ref.quantize_mx(np.asarray(x, np.float32), base, scale_rule=rule or "floor",
                              block_size=fmt_obj.block_size)
    codes, scales = got_ref[0], got_ref[1]
    packed = ref.pack_codes(codes, CODE_BITS[base])
    np.testing.assert_array_equal(stored["w_elements"], packed)
    np.testing.assert_array_equal(stored["w_scales"], scales)
    want_parts = {"w_elements", "w_scales"} | ({"w_scale"} if fmt_obj.tensor_scale else set())
    assert set(stored) == want_parts
    if fmt_obj.tensor_scale:
        assert stored["w_scale"].dtype == np.float32 and stored["w_scale"].shape == ()
        assert_bits_equal(stored["w_scale"], got_ref[2])
    ref_values = ref.dequantize_mx(codes, scales, base, block_size=fmt_obj.block_size,
                                   tensor_scale=got_ref[2] if len(got_ref) == 3 else None)
    # the library's in-memory round trip, bit for bit
    mx = lowprec.quantize_mx(jnp.asarray(x), name, scale_rule=rule)
    want32 = np.asarray(lowprec.dequantize(mx))
    got32 = load_checkpoint(out, dtype="float32")["w"]
    assert_bits_equal(got32, want32)
    np.testing.assert_array_equal(got32.astype(np.float64), ref_values)
    dequantize_checkpoint(out, back)
    got = raw_tensors(back)["w"]
    assert got.dtype == np.dtype(dtype)
    assert_bits_equal(got, lowprec.dequantize(mx, dtype))
    # the metadata names the format with its block size; inspect shows it
    with SafetensorsReader(out) as r:
        entry = json.loads(r.metadata["lowprec.tensors"])["w"]
    assert entry["format"] == name and entry["scale_rule"] == rule
    (shown,) = inspect_checkpoint(out).tensors
    assert shown.format == name and shown.bytes_after == sum(v.nbytes for v in stored.values())


@pytest.mark.slow  # tests/test_checkpoint.py has the quick case
@pytest.mark.parametrize("fmt", ["mxfp6_e3m2", "mxint8", "nvfp4"])
def test_pieces_equal_whole_tensor_for_every_axis(tmp_path, monkeypatch, fmt):
    """With pieces of 64 elements (column slabs one block high, block ranges, rows), every
    axis gives the whole-tensor bytes; NVFP4's tensor scale is the whole tensor's."""
    rng = np.random.default_rng(12)
    x = weights(rng, (32, 3, 64))
    x[-1, -1, -1] = 1e4  # the amax sits in the last piece
    path = tmp_path / "m.safetensors"
    save(path, {"w": x})
    monkeypatch.setattr(convert_mod, "CHUNK_ELEMENTS", 64)
    for axis in (-1, 0):
        out = tmp_path / f"q{axis}.safetensors"
        quantize_checkpoint(path, out, fmt, axis=axis, include="w")
        stored = raw_tensors(out)
        mx = lowprec.quantize_mx(jnp.asarray(x), fmt, axis=axis)
        np.testing.assert_array_equal(stored["w_elements"], np.asarray(mx.elements))
        np.testing.assert_array_equal(stored["w_scales"], np.asarray(mx.scales))
        if mx.tensor_scale is not None:
            assert_bits_equal(stored["w_scale"], mx.tensor_scale)
            first = lowprec.quantize_mx(jnp.asarray(x[:16]), fmt, axis=axis)
            assert bit_pattern(first.tensor_scale) != bit_pattern(mx.tensor_scale)  # a first pass was needed
        got = load_checkpoint(out)["w"]
        assert_bits_equal(got, lowprec.dequantize(mx))


def test_nvfp4_report_counts_clipped_and_nan_blocks(tmp_path):
    """Tensor amax 2688 gives tensor scale 1. Block scales are E4M3 of block_amax / 6, which
    in [8, 16) has steps of 1 (3 mantissa bits): 55.2 / 6 = 9.2 rounds down to 9 (max
    representable 6 * 9 = 54 < 55.2: clipped), 57.6 / 6 = 9.6 rounds up to 10 (60 > 57.6: not
    clipped);
    2688 / 6 = 448 exactly; an all-zero block is not clipped; a block with a NaN is a NaN
    block (E4M3 scale 0x7F), not counted as clipped."""
    x = np.zeros((1, 80), np.float32)
    x[0, 0], x[0, 16], x[0, 32], x[0, 64] = 2688.0, 55.2, 57.6, np.nan
    path, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    save(path, {"w": x})
    (t,) = quantize_checkpoint(path, out, "nvfp4", include="w").tensors
    assert t.clipped_fraction == pytest.approx(1 / 5)
    assert t.nan_blocks == 1 and raw_tensors(out)["w_scales"][0, 4] == 0x7F
    assert float(raw_tensors(out)["w_scale"]) == 1.0


@pytest.mark.parametrize("fmt,dtype,st_dtype", [
    ("e4m3fnuz", ml_dtypes.float8_e4m3fnuz, "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", ml_dtypes.float8_e5m2fnuz, "F8_E5M2FNUZ"),
])
def test_fnuz_casts_match_ml_dtypes(tmp_path, fmt, dtype, st_dtype):
    """FP8 FNUZ casts with a per-tensor scale: codes are ml_dtypes' cast of x / s after
    saturation, s = amax / max (ml_dtypes' finfo), stored under safetensors' FNUZ dtype."""
    rng = np.random.default_rng(13)
    x = weights(rng, (4, 64))
    path, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    save(path, {"w": x})
    (t,) = quantize_checkpoint(path, out, fmt, include="w").tensors
    stored = raw_tensors(out)
    fmax = np.float32(ml_dtypes.finfo(dtype).max)
    s = np.float32(np.abs(x).max()) / fmax
    assert_bits_equal(stored["w_scale"], s)
    want = np.clip(x / s, -fmax, fmax).astype(dtype)
    assert stored["w"].dtype == np.dtype(dtype)
    assert_bits_equal(stored["w"], want)
    np.testing.assert_array_equal(load_checkpoint(out)["w"], want.astype(np.float32) * s)
    with SafetensorsReader(out) as r:
        assert r.tensors["w"].dtype == st_dtype
    if safe_open is not None:  # the safetensors package parses the dtype
        with safe_open(str(out), framework="numpy") as f:
            assert f.get_slice("w").get_dtype() == st_dtype


@pytest.mark.parametrize("name,shown", [("e3m4", "e3m4"), ("float8_e4m3", "e4m3ieee"),
                                        ("e4m3b11fnuz", "e4m3b11fnuz"), ("e2m1", "e2m1")])
def test_formats_safetensors_cannot_store_are_refused_with_the_choices(name, shown):
    with pytest.raises(CheckpointError) as e:
        canonical_format(name)
    msg = str(e.value)
    assert repr(name) in msg and shown in msg and "safetensors" in msg
    for ok in ("mxfp6_e2m3", "mxint8", "nvfp4", "e4m3fnuz", "bf16", "mxfp4_b16"):
        assert ok in msg


def test_block_options_are_checked(tmp_path):
    x = weights(np.random.default_rng(14), (4, 64))
    path = tmp_path / "m.safetensors"
    save(path, {"w": x})
    out = tmp_path / "q.safetensors"
    cases = [
        (dict(format="nvfp4", scale_rule="floor"), "takes no scale rule"),
        (dict(format="e4m3", block_size=16), "block formats only"),
        (dict(format="mxint8", block_size=24), "block size 24"),
        (dict(format="mxfp6_e2m3", block_size=2), "whole number of bytes"),
        (dict(format="mxfp4_b16", layout="gpt-oss"), "holds MXFP4 only"),
    ]
    for kwargs, words in cases:
        with pytest.raises(CheckpointError, match=words):
            quantize_checkpoint(path, out, **kwargs)
    assert not out.exists()
    # a block size the axis does not divide: that tensor is kept, and said why
    with pytest.raises(CheckpointError, match="axis len 64 % 128"):
        quantize_checkpoint(path, out, "mxfp8", block_size=128, include="w")


@pytest.mark.parametrize("name,suggestion", [
    ("mxpf4", "'mxfp4'"), ("nvfp5", "'nvfp4'"), ("mxfp8_e4m2", "'mxfp8_e5m2'"),
    ("bfloat15", "'bfloat16'"), ("e4m3fnz", "'e4m3fnuz'"),
])
def test_near_miss_checkpoint_format_names_suggest_the_right_one(name, suggestion, capsys):
    from lowprec.cli import main

    with pytest.raises(CheckpointError, match=rf"unknown checkpoint format '{name}'; did you "
                                              rf"mean .*{suggestion}"):
        canonical_format(name)
    with pytest.raises(SystemExit):
        main(["quantize", "a", "b", "-f", name])
    err = capsys.readouterr().err
    assert "did you mean" in err and suggestion in err
