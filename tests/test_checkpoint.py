"""Checkpoint quantization (lowprec.checkpoint) on small synthetic safetensors files."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowprec
import lowprec.checkpoint._convert as convert_mod
from lowprec.checkpoint import (
    CheckpointError,
    SafetensorsReader,
    SafetensorsWriter,
    dequantize_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    quantize_checkpoint,
)

try:
    import safetensors.numpy as st_numpy
    from safetensors import safe_open
except ImportError:  # the independent implementation is optional
    st_numpy = None

from helpers.asserts import assert_bits_equal  # noqa: E402
from helpers.checkpoints import raw_tensors, save  # noqa: E402

needs_safetensors = pytest.mark.skipif(st_numpy is None, reason="safetensors not installed")

# The published gpt-oss / Hugging Face MXFP4 decoder's table (gpt_oss/torch/weights.py,
# transformers integrations/mxfp4.py): nibble → value, scale byte → 2^(byte − 127).
FP4_VALUES = [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def decode_gpt_oss_by_hand(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The published decoder, transcribed to NumPy (float32 instead of bf16, no chunks)."""
    assert blocks.shape[:-1] == scales.shape
    lut = np.array(FP4_VALUES, np.float32)
    *prefix, G, B = blocks.shape
    blocks = blocks.reshape(-1, B)
    exp = scales.reshape(-1, 1).astype(np.int32) - 127
    out = np.empty((blocks.shape[0], B * 2), np.float32)
    out[:, 0::2] = lut[blocks & 0x0F]  # low nibble first
    out[:, 1::2] = lut[blocks >> 4]
    out = np.ldexp(out, exp)
    return out.reshape(*prefix, G * B * 2)


def weights(rng, shape, dtype=np.float32):
    """Weights with magnitudes varying by block and row, some zero blocks, tiny values."""
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-8, 3, size=shape[:-1] + (1,)))
    x = x.astype(np.float32)
    flat = x.reshape(-1, 32) if x.size % 32 == 0 else None
    if flat is not None and flat.shape[0] > 3:
        flat[1] = 0.0  # an all-zero block
        flat[2] *= np.float32(2.0**-120)  # float32 subnormals
    return x.astype(dtype)


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def model(tmp_path):
    """A small transformer-like checkpoint with the usual tensor kinds."""
    rng = np.random.default_rng(1)
    t = {
        "embed_tokens.weight": weights(rng, (50, 64)),
        "layers.0.attn.q_proj.weight": weights(rng, (64, 64)),
        "layers.0.attn.q_proj.bias": weights(rng, (64,)),
        "layers.0.input_layernorm.weight": np.ones(64, np.float32),
        "layers.0.mlp.up.weight": weights(rng, (96, 64), ml_dtypes.bfloat16),
        "layers.0.mlp.down.weight": weights(rng, (64, 96), np.float16),
        "layers.0.odd.weight": weights(rng, (8, 40)),  # 40 is not a multiple of 32
        "experts.w": weights(rng, (2, 16, 64)),
        "position_ids": np.arange(16, dtype=np.int64).reshape(1, 16),
        "lm_head.weight": weights(rng, (50, 64)),
    }
    path = tmp_path / "model.safetensors"
    save(path, t, metadata={"format": "pt"})
    return path, t


# -- reading and writing the container ------------------------------------------------
@needs_safetensors
def test_reader_reads_files_written_by_safetensors(tmp_path):
    t = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "bf16": np.array([1.5, -2.0, 3e38], ml_dtypes.bfloat16),
        "f16": np.array([[65504.0]], np.float16),
        "i64": np.array([-1, 2**40], np.int64),
        "u8": np.arange(5, dtype=np.uint8),
        "e4m3": np.array([448, -0.001953125], ml_dtypes.float8_e4m3fn),
        "scalar": np.array(7.0, np.float64),
        "empty": np.zeros((0, 4), np.float32),
    }
    path = tmp_path / "x.safetensors"
    st_numpy.save_file(t, str(path), metadata={"a": "b"})
    with SafetensorsReader(path) as r:
        assert r.metadata == {"a": "b"}
        assert set(r.tensors) == set(t)
        for k, v in t.items():
            got = r.read(k)
            assert got.dtype == v.dtype and got.shape == v.shape, k
            assert_bits_equal(got, v, k)
        np.testing.assert_array_equal(r.read_rows("f32", 1, 2), t["f32"][1:2])


@needs_safetensors
def test_writer_output_is_read_by_safetensors(tmp_path):
    path = tmp_path / "w.safetensors"
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    u = np.arange(7, dtype=np.uint8)
    with SafetensorsWriter(path, [("a", "F32", a.shape), ("u", "U8", u.shape)], {"k": "v"}) as w:
        w.write("a", a[:1])  # pieces in C order
        w.write("a", a[1:])
        w.write("u", u.tobytes())
    (n,) = struct.unpack("<Q", open(path, "rb").read(8))
    assert n % 8 == 0
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"k": "v"}
        np.testing.assert_array_equal(f.get_tensor("a"), a)
        np.testing.assert_array_equal(f.get_tensor("u"), u)


def test_writer_any_order_but_refuses_incomplete_and_overflow(tmp_path):
    path = tmp_path / "w.safetensors"
    with SafetensorsWriter(path, [("a", "U8", (2,)), ("b", "U8", (2,))]) as w:
        w.write("b", b"yy")  # tensors may be written in any order (each has its place)
        w.write("a", b"x")
        w.write("a", b"x")
    assert {k: v.tobytes() for k, v in raw_tensors(path).items()} == {"a": b"xx", "b": b"yy"}
    path.unlink()
    with pytest.raises(CheckpointError, match="'b' was not"):
        with SafetensorsWriter(path, [("a", "U8", (2,)), ("b", "U8", (2,))]) as w:
            w.write("a", b"xx")
    with pytest.raises(CheckpointError, match="past its 2 bytes"):
        with SafetensorsWriter(path, [("a", "U8", (2,))]) as w:
            w.write("a", b"xxx")
    assert not path.exists()
    assert os.listdir(tmp_path) == []  # no temp files left behind


# -- round trips: bit-exact with the in-memory API -------------------------------------
@pytest.mark.quick_cases(fmt=["mxfp4", "mxfp8_e4m3"], rule=["rceil"])
@pytest.mark.parametrize(
    "fmt,rule",
    [("mxfp4", "floor"), ("mxfp4", "rceil"), ("mxfp4", "even"), ("mxfp4", "ceil"),
     ("mxfp8_e4m3", "floor"), ("mxfp8_e4m3", "rceil"), ("mxfp8_e5m2", "floor")],
)
@pytest.mark.quick_first(1)
def test_mx_round_trip_is_bit_exact(tmp_path, model, fmt, rule):
    path, t = model
    out, back = tmp_path / "q.safetensors", tmp_path / "d.safetensors"
    report = quantize_checkpoint(path, out, fmt, scale_rule=rule)
    stored = raw_tensors(out)
    decoded_f32 = load_checkpoint(out, dtype="float32")
    dequantize_checkpoint(out, back)
    decoded = raw_tensors(back)
    quantized = {r.name for r in report.tensors if r.quantized}
    assert quantized == {"layers.0.attn.q_proj.weight", "layers.0.mlp.up.weight",
                         "layers.0.mlp.down.weight", "experts.w"}
    for name in quantized:
        x = t[name]
        mx = lowprec.quantize_mx(jnp.asarray(x), fmt, scale_rule=rule)
        np.testing.assert_array_equal(stored[f"{name}_elements"], np.asarray(mx.elements))
        np.testing.assert_array_equal(stored[f"{name}_scales"], np.asarray(mx.scales))
        want32 = np.asarray(lowprec.dequantize(mx))
        assert_bits_equal(decoded_f32[name], want32, name)
        # dequantize's default dtype: the original one (bf16 / f16 / f32)
        want = np.asarray(lowprec.dequantize(mx, x.dtype))
        assert decoded[name].dtype == x.dtype
        assert_bits_equal(decoded[name], want, name)
    for name in set(t) - quantized:  # kept tensors are byte-identical
        assert_bits_equal(decoded[name], t[name])
        assert_bits_equal(stored[name], t[name])
    assert set(decoded) == set(t)
    if st_numpy is not None:  # the output is a valid safetensors file for the reference reader
        with safe_open(str(out), framework="numpy") as f:
            assert set(f.keys()) == set(stored)
            assert json.loads(f.metadata()["lowprec.tensors"])["experts.w"]["scale_rule"] == rule
            np.testing.assert_array_equal(f.get_tensor("experts.w_scales"),
                                          stored["experts.w_scales"])


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8_e4m3", "e4m3", "bf16"])
@pytest.mark.parametrize("budget", [64, 200, 1 << 20])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_pieces_equal_whole_tensor_for_every_axis(tmp_path, monkeypatch, fmt, budget):
    """Quantizing piece by piece (rows, block ranges of the axis, or column slabs one
    block high, depending on the budget) gives the bytes of the whole-tensor API."""
    rng = np.random.default_rng(2)
    t = {"a.weight": weights(rng, (37, 3, 64)), "b.weight": weights(rng, (64, 5, 32)),
         "c.weight": weights(rng, (96, 40)), "d.weight": weights(rng, (3, 64, 5)),
         "v.weight": weights(rng, (160,))}
    path = tmp_path / "m.safetensors"
    save(path, t)
    monkeypatch.setattr(convert_mod, "CHUNK_ELEMENTS", budget)
    axes = (-1, 0, 1) if fmt.startswith("mx") else (None,)
    for axis in axes:
        out = tmp_path / f"q{axis}.safetensors"
        rep = quantize_checkpoint(path, out, fmt, axis=axis, include="weight")
        got = load_checkpoint(out)
        stored = raw_tensors(out)
        done = {r.name for r in rep.tensors if r.quantized}
        for name, x in t.items():
            if axis is not None and not (-x.ndim <= axis < x.ndim and x.shape[axis] % 32 == 0):
                assert name not in done
                continue
            assert name in done
            if axis is None:
                continue  # casts: checked against ml_dtypes in their own tests
            mx = lowprec.quantize_mx(jnp.asarray(x), fmt, axis=axis)
            np.testing.assert_array_equal(stored[f"{name}_elements"], np.asarray(mx.elements))
            np.testing.assert_array_equal(stored[f"{name}_scales"], np.asarray(mx.scales))
            assert_bits_equal(got[name], lowprec.dequantize(mx))
        back = tmp_path / f"d{axis}.safetensors"
        dequantize_checkpoint(out, back)
        for name, v in raw_tensors(back).items():
            assert_bits_equal(v, got[name])
    if not fmt.startswith("mx"):
        whole = raw_tensors(tmp_path / "qNone.safetensors")
        monkeypatch.setattr(convert_mod, "CHUNK_ELEMENTS", 1 << 30)
        quantize_checkpoint(path, tmp_path / "whole.safetensors", fmt, include="weight")
        for name, v in raw_tensors(tmp_path / "whole.safetensors").items():
            assert_bits_equal(v, whole[name], name)


def test_gpt_oss_layout_decodes_with_the_published_decoder(tmp_path, model):
    path, t = model
    out = tmp_path / "g.safetensors"
    report = quantize_checkpoint(path, out, "mxfp4", layout="gpt-oss")
    stored = raw_tensors(out)
    for r in report.tensors:
        if not r.quantized:
            continue
        blocks, scales = stored[f"{r.name}_blocks"], stored[f"{r.name}_scales"]
        k = r.shape[-1]
        assert blocks.dtype == np.uint8 and blocks.shape == r.shape[:-1] + (k // 32, 16)
        assert scales.dtype == np.uint8 and scales.shape == r.shape[:-1] + (k // 32,)
        mx = lowprec.quantize_mx(jnp.asarray(t[r.name]), "mxfp4")
        want = np.asarray(lowprec.dequantize(mx))
        assert_bits_equal(decode_gpt_oss_by_hand(blocks, scales), want)
        wb, ws = lowprec.to_gpt_oss(mx)
        np.testing.assert_array_equal(blocks, np.asarray(wb))
        np.testing.assert_array_equal(scales, np.asarray(ws))


def _reference_decoder():
    import lowprec_reference

    fn = getattr(lowprec_reference, "decode_gpt_oss", None)
    if fn is None:
        try:
            from lowprec_reference.mx import decode_gpt_oss as fn
        except ImportError:
            fn = None
    if fn is None:
        pytest.skip("lowprec_reference.decode_gpt_oss is not available (yet)")
    return fn


def test_gpt_oss_layout_matches_reference_decoder(tmp_path, model):
    decode_gpt_oss = _reference_decoder()
    path, t = model
    out = tmp_path / "g.safetensors"
    report = quantize_checkpoint(path, out, "mxfp4", layout="gpt-oss", scale_rule="rceil")
    stored = raw_tensors(out)
    for r in report.tensors:
        if r.quantized:
            ref = np.asarray(decode_gpt_oss(stored[f"{r.name}_blocks"], stored[f"{r.name}_scales"]))
            mx = lowprec.quantize_mx(jnp.asarray(t[r.name]), "mxfp4", scale_rule="rceil")
            want = np.asarray(lowprec.dequantize(mx), np.float64)
            np.testing.assert_array_equal(ref.astype(np.float64).reshape(want.shape), want)


def test_float64_tensors(tmp_path):
    x = weights(np.random.default_rng(5), (4, 64), np.float64)
    path = tmp_path / "m.safetensors"
    save(path, {"w": x})
    out, back = tmp_path / "q.safetensors", tmp_path / "d.safetensors"
    rep = quantize_checkpoint(path, out, "mxfp8_e5m2")
    assert rep.tensors[0].bytes_before == x.size * 8
    dequantize_checkpoint(out, back)
    got = raw_tensors(back)["w"]
    mx = lowprec.quantize_mx(jnp.asarray(x.astype(np.float32)), "mxfp8_e5m2")
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, np.asarray(lowprec.dequantize(mx)).astype(np.float64))


def test_hand_decoder_on_known_bytes():
    # byte 0x72: low nibble 2 (+1.0) first, high nibble 7 (+6.0); 0x9F: -6.0, then -0.5
    blocks = np.zeros((1, 16), np.uint8)
    blocks[0, 0], blocks[0, 1] = 0x72, 0x9F
    got = decode_gpt_oss_by_hand(blocks, np.array([128], np.uint8))
    assert got[:4].tolist() == [2.0, 12.0, -12.0, -1.0]


@needs_safetensors
def test_dequantize_reads_plain_gpt_oss_pairs(tmp_path):
    """A file with only <name>_blocks/<name>_scales (as published gpt-oss checkpoints)."""
    rng = np.random.default_rng(3)
    x = weights(rng, (2, 3, 64))
    mx = lowprec.quantize_mx(jnp.asarray(x), "mxfp4")
    blocks, scales = (np.asarray(a) for a in lowprec.to_gpt_oss(mx))
    path = tmp_path / "oss.safetensors"
    st_numpy.save_file({"mlp1_weight_blocks": blocks, "mlp1_weight_scales": scales,
                        "norm.scale": np.ones(4, np.float32)}, str(path))
    formats = {r.name: r.format for r in inspect_checkpoint(path).tensors}
    assert formats == {"mlp1_weight": "mxfp4 (gpt-oss)", "norm.scale": "kept"}
    out = tmp_path / "plain.safetensors"
    dequantize_checkpoint(path, out)
    got = raw_tensors(out)
    assert got["mlp1_weight"].dtype == ml_dtypes.bfloat16  # gpt-oss/HF decode to bf16
    want = np.asarray(lowprec.dequantize(mx, jnp.bfloat16))
    assert_bits_equal(got["mlp1_weight"], want)
    np.testing.assert_array_equal(got["norm.scale"], np.ones(4, np.float32))


def test_fp8_per_tensor_scale_matches_ml_dtypes(tmp_path, model):
    path, t = model
    out = tmp_path / "f.safetensors"
    report = quantize_checkpoint(path, out, "e4m3")
    stored = raw_tensors(out)
    got = load_checkpoint(out, dtype="float32")
    for r in report.tensors:
        if not r.quantized:
            continue
        x = t[r.name].astype(np.float32)
        scale = np.float32(np.abs(x).max()) / np.float32(448)
        q = np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        assert stored[r.name].dtype == ml_dtypes.float8_e4m3fn
        assert_bits_equal(stored[r.name], q, r.name)
        assert stored[f"{r.name}_scale"].shape == () and stored[f"{r.name}_scale"] == scale
        np.testing.assert_array_equal(got[r.name], q.astype(np.float32) * scale)
        assert r.bytes_after == x.size + 4


def test_fp8_without_scale_saturates(tmp_path):
    x = np.array([[1.0, 500.0, -1e6, 0.3] * 8] * 2, np.float32)
    path = tmp_path / "m.safetensors"
    save(path, {"w": x})
    out = tmp_path / "f.safetensors"
    report = quantize_checkpoint(path, out, "e4m3", fp8_scale="none")
    want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert_bits_equal(raw_tensors(out)["w"], want)
    assert report.tensors[0].clipped_fraction == pytest.approx(0.5)


def test_bf16_matches_ml_dtypes(tmp_path, model):
    path, t = model
    out = tmp_path / "b.safetensors"
    report = quantize_checkpoint(path, out, "bf16")
    stored = raw_tensors(out)
    formats = {r.name: (r.format, r.reason) for r in report.tensors}
    assert formats["layers.0.mlp.up.weight"] == ("kept", "already BF16")
    assert formats["layers.0.odd.weight"][0] == "bf16"  # no block constraint for casts
    for name in ("layers.0.attn.q_proj.weight", "layers.0.mlp.down.weight", "experts.w"):
        want = t[name].astype(np.float32).astype(ml_dtypes.bfloat16)
        assert_bits_equal(stored[name], want)
    back = tmp_path / "d.safetensors"
    dequantize_checkpoint(out, back)
    assert raw_tensors(back)["layers.0.attn.q_proj.weight"].dtype == np.float32


# -- selection -------------------------------------------------------------------------
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_default_selection_and_reasons(tmp_path, model):
    path, _ = model
    rep = quantize_checkpoint(path, tmp_path / "q.safetensors", "mxfp8")
    got = {r.name: (r.format, r.reason) for r in rep.tensors}
    assert got == {
        "embed_tokens.weight": ("kept", "embedding/norm/bias/head"),
        "layers.0.attn.q_proj.weight": ("mxfp8_e4m3", "default"),
        "layers.0.attn.q_proj.bias": ("kept", "1-D"),
        "layers.0.input_layernorm.weight": ("kept", "1-D"),
        "layers.0.mlp.up.weight": ("mxfp8_e4m3", "default"),
        "layers.0.mlp.down.weight": ("mxfp8_e4m3", "default"),
        "layers.0.odd.weight": ("kept", "axis len 40 % 32 != 0"),
        "experts.w": ("mxfp8_e4m3", "default"),
        "position_ids": ("kept", "I64, not float"),
        "lm_head.weight": ("kept", "embedding/norm/bias/head"),
    }


def test_include_and_exclude(tmp_path, model):
    path, _ = model
    rep = quantize_checkpoint(path, tmp_path / "q.safetensors", "mxfp4",
                              include=r"embed|q_proj|norm|position", exclude=r"bias")
    got = {r.name: r.format for r in rep.tensors if r.quantized}
    # include overrides the default keep rule and allows 1-D tensors; ints never quantize
    assert got == {"embed_tokens.weight": "mxfp4", "layers.0.attn.q_proj.weight": "mxfp4",
                   "layers.0.input_layernorm.weight": "mxfp4"}
    reasons = {r.name: r.reason for r in rep.tensors}
    assert reasons["layers.0.attn.q_proj.bias"] == "--exclude"
    assert reasons["position_ids"] == "I64, not float"
    assert reasons["layers.0.mlp.up.weight"] == "not in --include"


# -- report ----------------------------------------------------------------------------
def test_report_numbers(tmp_path, model):
    path, t = model
    out = tmp_path / "q.safetensors"
    rep = quantize_checkpoint(path, out, "mxfp4")
    r = next(r for r in rep.tensors if r.name == "experts.w")
    x = t["experts.w"].astype(np.float64)
    mx = lowprec.quantize_mx(jnp.asarray(t["experts.w"]), "mxfp4")
    q = np.asarray(lowprec.dequantize(mx), np.float64)
    e = np.abs(x - q)
    assert r.sqnr_db == pytest.approx(10 * math.log10((x**2).sum() / (e**2).sum()), rel=1e-9)
    assert r.max_abs_err == e.max()
    nz = x != 0
    assert r.max_rel_err == pytest.approx((e[nz] / np.abs(x[nz])).max(), rel=1e-12)
    assert (r.bytes_before, r.bytes_after) == (x.size * 4, x.size // 2 + x.size // 32)
    assert r.bits_per_param == 4.25
    up = next(r for r in rep.tensors if r.name == "layers.0.mlp.up.weight")
    assert up.bytes_before == 96 * 64 * 2  # bf16 input
    tot = rep.totals()
    assert tot["bits_per_param_quantized"] == 4.25
    assert tot["bytes_before"] == os.path.getsize(path) - 8 - struct.unpack(
        "<Q", open(path, "rb").read(8))[0]
    d = json.loads(rep.to_json())  # strict JSON (no NaN/Infinity)
    assert {e["name"] for e in d["tensors"]} == set(t)
    assert d["options"]["scale_rule"] == "floor"
    table = rep.table()
    assert "experts.w" in table and "4.25" in table and "kept: 1-D" in table


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_clipped_block_maxima_floor_vs_rceil(tmp_path):
    # Block 0's max is 7.5 = 1.875 * 4: FLOOR gives scale 2^0, max elem 6 → clipped.
    # Block 1's max is 5.0: not clipped. An exactly representable tensor has SQNR inf.
    x = np.zeros((2, 64), np.float32)
    x[:, 0], x[:, 1] = 7.5, 1.0
    x[:, 32], x[:, 33] = 5.0, 0.5
    path = tmp_path / "m.safetensors"
    save(path, {"w": x, "exact": np.full((2, 32), 1.5, np.float32)})
    rep = quantize_checkpoint(path, tmp_path / "f.safetensors", "mxfp4", include=".")
    by = {r.name: r for r in rep.tensors}
    w, exact = by["w"], by["exact"]
    assert w.clipped_fraction == 0.5 and w.max_abs_err == 1.5
    assert exact.sqnr_db == math.inf and exact.max_abs_err == 0 and exact.clipped_fraction == 0
    js = {e["name"]: e for e in json.loads(rep.to_json())["tensors"]}
    assert js["exact"]["sqnr_db"] is None and js["exact"]["exact"] is True
    rep = quantize_checkpoint(path, tmp_path / "r.safetensors", "mxfp4", include=".",
                              scale_rule="rceil")
    assert {r.name: r.clipped_fraction for r in rep.tensors}["w"] == 0.0


def test_nonfinite_inputs_are_counted_not_averaged(tmp_path):
    x = np.ones((2, 64), np.float32)
    x[0, 3] = np.nan
    path = tmp_path / "m.safetensors"
    save(path, {"w": x})
    rep = quantize_checkpoint(path, tmp_path / "q.safetensors", "mxfp8", include="w")
    r = rep.tensors[0]
    assert r.nonfinite == 32  # the NaN's whole block decodes to NaN
    assert r.sqnr_db == math.inf  # the other elements are exact
    got = load_checkpoint(tmp_path / "q.safetensors")["w"]
    assert np.isnan(got[0, :32]).all() and (got[0, 32:] == 1).all()


# -- inspect ---------------------------------------------------------------------------
def test_inspect(tmp_path, model):
    path, t = model
    plain = inspect_checkpoint(path)
    assert [r.name for r in plain.tensors] == list(raw_tensors(path))
    assert plain.options["metadata"] == {"format": "pt"}
    out = tmp_path / "q.safetensors"
    quantize_checkpoint(path, out, "mxfp4", scale_rule="rceil")
    rep = inspect_checkpoint(out)
    by = {r.name: r for r in rep.tensors}
    assert set(by) == set(t)  # parts grouped under the original names
    e = by["experts.w"]
    assert (e.format, e.scale_rule, e.dtype, e.shape) == ("mxfp4", "rceil", "F32", (2, 16, 64))
    assert e.bits_per_param == 4.25 and e.stored_as == ("experts.w_elements", "experts.w_scales")
    assert by["position_ids"].bits_per_param == 64
    table = rep.table()
    assert "mxfp4 rceil" in table and "bits/param" in table


# -- safety ----------------------------------------------------------------------------
def test_input_untouched_overwrite_refused_and_force(tmp_path, model):
    path, _ = model
    before = sha(path)
    out = tmp_path / "q.safetensors"
    quantize_checkpoint(path, out, "mxfp4")
    assert sha(path) == before
    first = sha(out)
    with pytest.raises(CheckpointError, match="already exists.*--force"):
        quantize_checkpoint(path, out, "mxfp8")
    assert sha(out) == first
    quantize_checkpoint(path, out, "mxfp8", force=True)
    assert sha(out) != first
    with pytest.raises(CheckpointError, match="is the input file"):
        quantize_checkpoint(path, path, "mxfp4", force=True)
    os.link(path, tmp_path / "hardlink.safetensors")
    with pytest.raises(CheckpointError, match="is a link to the input file"):
        quantize_checkpoint(path, tmp_path / "hardlink.safetensors", "mxfp4", force=True)
    assert sha(path) == before
    assert sorted(os.listdir(tmp_path)) == ["hardlink.safetensors", "model.safetensors",
                                            "q.safetensors"]
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(out, tmp_path / "qq.safetensors", "mxfp4")


def test_failure_midway_leaves_no_output(tmp_path, model, monkeypatch):
    path, _ = model
    calls = []

    def boom(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated failure")
        return real(*args, **kwargs)

    real = convert_mod.quantize_chunk
    monkeypatch.setattr(convert_mod, "quantize_chunk", boom)
    out = tmp_path / "q.safetensors"
    with pytest.raises(RuntimeError, match="simulated"):
        quantize_checkpoint(path, out, "mxfp4")
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


def test_piece_runner_leaves_a_tensors_last_pieces_in_flight():
    """``run(..., drain=False)`` returns with its pieces still running (the next tensor's
    pieces keep the workers busy meanwhile); what is consumed later still comes in the
    items' order, with the calls queued by ``after`` between them; a failure among pieces
    left in flight surfaces at the next call and nothing runs after it."""
    import threading

    from lowprec.checkpoint._pipeline import PieceRunner

    release, got = threading.Event(), []

    def slow(i):
        assert release.wait(10)
        return i

    with PieceRunner(2) as runner:
        runner.run(slow, [0, 1], lambda i, r: got.append(r), drain=False)
        assert got == []  # returned before either piece finished
        runner.after(lambda: got.append("first done"))
        release.set()
        runner.run(lambda i: -i, [2, 3, 4], lambda i, r: got.append(r))
        assert got == [0, 1, "first done", -2, -3, -4]

        def fail(i):
            raise RuntimeError(f"piece {i}")

        runner.run(fail, [5], lambda i, r: got.append(r), drain=False)
        runner.after(lambda: got.append("never"))
        with pytest.raises(RuntimeError, match="piece 5"):
            runner.run(lambda i: i, [6], lambda i, r: got.append(r))
        runner.drain()
    assert got[6:] == []


def test_an_earlier_tensors_failure_is_the_error_raised(tmp_path, model, monkeypatch):
    """With a tensor's last pieces still in flight when the next tensor starts, an error of
    those pieces is still the one raised, not one the next tensor's planning raises
    meanwhile (as converting one tensor after the other would), and no output is left."""
    import time

    import lowprec.checkpoint._pipeline as pipeline_mod

    path, _ = model
    monkeypatch.setattr(pipeline_mod, "WORKERS", 2)
    real_chunk, real_pieces = convert_mod.quantize_chunk, convert_mod.pieces
    tensors = []

    def slow_fail(*args, **kwargs):
        time.sleep(0.2)  # the main thread is on to the next tensor by then
        raise RuntimeError("a piece of the first tensor failed")

    def pieces(*args, **kwargs):
        tensors.append(1)
        if len(tensors) == 2:
            raise CheckpointError("the second tensor's planning failed")
        return real_pieces(*args, **kwargs)

    monkeypatch.setattr(convert_mod, "quantize_chunk", slow_fail)
    monkeypatch.setattr(convert_mod, "pieces", pieces)
    with pytest.raises(RuntimeError, match="first tensor failed"):
        quantize_checkpoint(path, tmp_path / "q.safetensors", "mxfp4")
    assert len(tensors) == 2  # the second tensor had started
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    monkeypatch.setattr(convert_mod, "quantize_chunk", real_chunk)
    tensors.clear()
    with pytest.raises(CheckpointError, match="second tensor's planning"):
        quantize_checkpoint(path, tmp_path / "q.safetensors", "mxfp4")


def test_streaming_peak_memory_does_not_grow_with_checkpoint(tmp_path, monkeypatch):
    """Peak (NumPy) memory stays near one piece, not the checkpoint: 2 vs 12 tensors."""
    import gc
    import tracemalloc

    import lowprec.checkpoint._pipeline as pipeline_mod

    monkeypatch.setattr(convert_mod, "CHUNK_ELEMENTS", 1 << 14)
    # One piece worker: with N, up to 2N pieces are in flight, and how many are at once
    # depends on thread timing, so the two runs' peaks would not compare like with like.
    monkeypatch.setattr(pipeline_mod, "WORKERS", 1)
    rng = np.random.default_rng(4)
    w = rng.standard_normal((256, 256)).astype(np.float32)  # 256 KiB each
    peaks = {}
    for n in (2, 12):
        path = tmp_path / f"m{n}.safetensors"
        entries = [(f"l{i}.weight", "F32", w.shape) for i in range(n)]
        with SafetensorsWriter(path, entries) as f:
            for name, _, _ in entries:
                f.write(name, w)
        quantize_checkpoint(path, tmp_path / "warm.safetensors", "mxfp4", force=True)
        dequantize_checkpoint(tmp_path / "warm.safetensors", tmp_path / "warm_d.safetensors",
                              force=True)
        gc.collect()  # garbage left by earlier tests in this worker is not the pipeline's
        tracemalloc.start()
        quantize_checkpoint(path, tmp_path / f"q{n}.safetensors", "mxfp4")
        dequantize_checkpoint(tmp_path / f"q{n}.safetensors", tmp_path / f"d{n}.safetensors")
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # What a tensor adds is its entries (report, header, metadata: ~4 KB measured alone, up
    # to ~8 KB inside a full suite's worker), not its data: a retained tensor would add its
    # 256 KiB input or at least its 34 KiB of MXFP4 codes and scales, both over the 1/16 of
    # its input (16 KiB) allowed per extra tensor. (A ratio of the two peaks, 1.3x, tripped
    # once a piece took ~110 KB at peak: the entries are then a third of it.)
    assert peaks[12] - peaks[2] < (12 - 2) * w.nbytes / 16
    assert peaks[12] < 12 * w.nbytes / 2


# -- malformed files ---------------------------------------------------------------------
def _file(header: dict, data: bytes = b"", raw_header: bytes | None = None) -> bytes:
    h = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}

MALFORMED = {
    "empty": (b"", "8-byte header length"),
    "short": (b"\x10\x00\x00", "8-byte header length"),
    "header_past_end": (struct.pack("<Q", 1000) + b"{}", "truncated"),
    "huge_header": (struct.pack("<Q", 2**40) + b"{", "header length field"),
    "not_json": (_file({}, raw_header=b"{not json}"), "not valid JSON"),
    "not_object": (_file({}, raw_header=b"[1, 2]   "), "does not start with"),
    "truncated_data": (_file(GOOD, b"\x00" * 5), "truncated"),
    "unknown_dtype": (_file({"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}},
                            b"\x00" * 16), "unknown dtype 'F128'"),
    "size_mismatch": (_file({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
                            b"\x00" * 8), "needs 12 bytes"),
    "negative_shape": (_file({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}},
                             b"\x00" * 8), "shape"),
    "overlap": (_file({**GOOD, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
                      b"\x00" * 8), "overlaps"),
    "gap": (_file({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\x00" * 8),
            "gap"),
    "trailing": (_file(GOOD, b"\x00" * 12), "4 bytes after the last tensor"),
    "duplicate": (_file({}, raw_header=b'{"a": {"dtype": "U8", "shape": [0], "data_offsets": '
                                       b'[0, 0]}, "a": {}}'), "duplicate key 'a'"),
    "bad_metadata": (_file({"__metadata__": {"k": 1}}), "__metadata__"),
    "missing_field": (_file({"a": {"dtype": "F32", "shape": [2]}}), "data_offsets"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_give_clear_errors(tmp_path, case):
    content, phrase = MALFORMED[case]
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        quantize_checkpoint(path, tmp_path / "out.safetensors", "mxfp4")
    assert str(path) in str(info.value) and phrase in str(info.value)
    assert not (tmp_path / "out.safetensors").exists()


def test_truncated_real_file(tmp_path, model):
    path, _ = model
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        inspect_checkpoint(cut)


class _Payload:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):  # unpickling this would create a file
        return (open, (self.target, "w"))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.safetensors"])
def test_pickles_are_refused_never_loaded(tmp_path, name):
    sentinel = tmp_path / "pwned"
    path = tmp_path / name
    path.write_bytes(pickle.dumps({"w": _Payload(str(sentinel))}, protocol=4))
    with pytest.raises(CheckpointError, match="pickle") as info:
        quantize_checkpoint(path, tmp_path / "out.safetensors", "mxfp4")
    assert "safetensors" in str(info.value) and str(path) in str(info.value)
    assert not sentinel.exists()


def test_zip_torch_checkpoint_refused(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 60)
    with pytest.raises(CheckpointError, match="pickle"):
        inspect_checkpoint(path)


def test_header_length_with_pickle_like_first_byte_is_fine(tmp_path):
    """A header of 0x280 bytes starts with bytes 80 02: not a pickle."""
    path = tmp_path / "p.safetensors"
    for pad in range(0x280):
        with SafetensorsWriter(path, [("t", "F32", ())], {"pad": "x" * pad}, force=True) as w:
            w.write("t", np.float32(1))
        if path.read_bytes()[:2] == b"\x80\x02":
            break
    else:
        pytest.fail("no header of length 0x280 produced")
    assert [r.name for r in inspect_checkpoint(path).tensors] == ["t"]


def test_option_errors(tmp_path, model):
    path, _ = model
    out = tmp_path / "o.safetensors"
    with pytest.raises(CheckpointError, match="choose one of: mxfp4"):
        quantize_checkpoint(path, out, "int4")
    with pytest.raises(CheckpointError, match="gpt-oss layout holds MXFP4 only"):
        quantize_checkpoint(path, out, "mxfp8_e4m3", layout="gpt-oss")
    with pytest.raises(CheckpointError, match="last axis"):
        quantize_checkpoint(path, out, "mxfp4", layout="gpt-oss", axis=0)
    with pytest.raises(CheckpointError, match="scale rules apply to MX formats only"):
        quantize_checkpoint(path, out, "bf16", scale_rule="floor")
    with pytest.raises(CheckpointError, match="unknown scale_rule 'round'"):
        quantize_checkpoint(path, out, "mxfp4", scale_rule="round")
    with pytest.raises(CheckpointError, match="not a valid regular expression"):
        quantize_checkpoint(path, out, "mxfp4", include="(")
    with pytest.raises(CheckpointError, match="no such file"):
        quantize_checkpoint(tmp_path / "nope.safetensors", out, "mxfp4")
    assert not out.exists()


def test_name_collision_is_refused(tmp_path):
    x = np.ones((2, 32), np.float32)
    path = tmp_path / "m.safetensors"
    save(path, {"w": x, "w_scales": x})
    with pytest.raises(CheckpointError, match="'w_scales' would be used twice"):
        quantize_checkpoint(path, tmp_path / "o.safetensors", "mxfp4", include="^w$")


def test_tampered_metadata_is_reported(tmp_path, model):
    path, _ = model
    out = tmp_path / "q.safetensors"
    quantize_checkpoint(path, out, "mxfp4")
    tensors = raw_tensors(out)
    with SafetensorsReader(out) as r:
        meta = dict(r.metadata)
    table = json.loads(meta["lowprec.tensors"])
    table["experts.w"]["shape"] = [2, 16, 128]
    meta["lowprec.tensors"] = json.dumps(table)
    bad = tmp_path / "bad.safetensors"
    entries = [(k, lowprec.checkpoint._safetensors.dtype_name(v.dtype), v.shape)
               for k, v in tensors.items()]
    with SafetensorsWriter(bad, entries, meta) as w:
        for k, v in tensors.items():
            w.write(k, v)
    with pytest.raises(CheckpointError, match="experts.w_elements.*needs U8"):
        load_checkpoint(bad)


# -- what the library's own checks mean for files ---------------------------------------
def test_half_precision_nan_blocks_match_the_in_memory_api(tmp_path):
    """BF16/F16 tensors go to quantize_mx in their own dtype (widened with integer bit
    operations there): NaNs of any sign and payload make exactly their block a NaN block,
    and the report counts them; every other byte equals the in-memory API's."""
    rng = np.random.default_rng(7)
    t = {}
    for dt, bits_dt, nans in ((ml_dtypes.bfloat16, np.uint16, [0x7FC0, 0xFFC1, 0x7F81]),
                              (np.float16, np.uint16, [0x7E00, 0xFE01, 0x7C01])):
        x = rng.standard_normal((4, 64)).astype(dt)
        raw = x.view(bits_dt)
        raw[1, 0], raw[1, 5], raw[3, 40] = nans  # blocks (1, 0) and (3, 1)
        t[f"w_{np.dtype(dt).name}"] = x
    path = tmp_path / "m.safetensors"
    save(path, t)
    rep = quantize_checkpoint(path, tmp_path / "q.safetensors", "mxfp8", include="w")
    stored = raw_tensors(tmp_path / "q.safetensors")
    for r in rep.tensors:
        x = t[r.name]
        mx = lowprec.quantize_mx(jnp.asarray(x), "mxfp8")
        np.testing.assert_array_equal(stored[f"{r.name}_elements"], np.asarray(mx.elements))
        np.testing.assert_array_equal(stored[f"{r.name}_scales"], np.asarray(mx.scales))
        scales = stored[f"{r.name}_scales"]
        assert sorted(zip(*np.nonzero(scales == 0xFF))) == [(1, 0), (3, 1)]
        assert (r.nan_blocks, r.nan_in, r.finite_to_nonfinite) == (2, 3, 61)
        assert not r.exact and "2 NaN blocks" in r.nonfinite_text()


def test_f16_nan_and_inf_through_a_cast(tmp_path):
    x = np.array([[1.0, np.nan, -np.inf, 65504.0] * 8], np.float16)
    x.view(np.uint16)[0, 5] = 0xFE01  # a negative NaN with a payload
    path = tmp_path / "m.safetensors"
    save(path, {"w": x})
    rep = quantize_checkpoint(path, tmp_path / "b.safetensors", "bf16", include="w")
    got = raw_tensors(tmp_path / "b.safetensors")["w"].astype(np.float32)
    assert np.isnan(got[0, 1::4]).all()  # NaN stays NaN
    bf16_max = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    assert (got[0, 2::4] == -bf16_max).all()  # -inf saturates (the cast is saturating)
    r = rep.tensors[0]
    assert (r.nan_in, r.inf_in, r.inf_saturated, r.exact) == (8, 8, 8, False)
    assert r.nonfinite_text() == "8 inf->max, 8 NaN in"


def test_decoding_mismatched_parts_is_a_checkpoint_error():
    """Whatever gets past the file checks, MXArray's own validation becomes a clean error."""
    from lowprec.checkpoint import dequantize_chunk, make_spec

    spec = make_spec("mxfp8", (2, 64), "F32")
    parts = {"elements": np.zeros((2, 64), np.uint8), "scales": np.zeros((2, 3), np.uint8)}
    with pytest.raises(CheckpointError, match="cannot decode mxfp8_e4m3"):
        dequantize_chunk(parts, spec, (2, 64, 1), np.float32)


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_nvfp4_clipped_blocks_follow_the_rounded_block_scale():
    # With tensor scale 1 an NVFP4 block's scale is e4m3(clamp(amax / 6, 2^-6, 448)) and its
    # elements saturate at 6 * scale; a block is clipped iff its amax exceeds that. E4M3 has
    # 3 mantissa bits (steps of 32 in [256, 512), 0.25 in [2, 4)):
    #   amax 3000: 500 clamps to 448, limit 2688 < 3000          -> clipped
    #   amax 2000: 333.3 rounds to 320, limit 1920 < 2000        -> clipped (scale rounded down)
    #   amax 1920: 320 exactly, limit 1920                       -> not clipped (equal)
    #   amax 6:    1, limit 6                                     -> not clipped
    #   amax 13:   2.1667 rounds to 2.25, limit 13.5 > 13        -> not clipped
    #   all zero:  scale 2^-6                                     -> not clipped
    from lowprec.checkpoint import ErrorStats, make_spec, quantize_chunk

    maxima = [3000.0, 2000.0, 1920.0, 6.0, 13.0, 0.0]
    x = np.zeros((1, 16 * len(maxima)), np.float32)
    for b, m in enumerate(maxima):
        x[0, 16 * b: 16 * b + 8] = np.linspace(-m, m, 8)  # the block's max |x| is m
    stats = ErrorStats()
    quantize_chunk(x, make_spec("nvfp4", x.shape, "F32"), scale=np.float32(1.0), stats=stats)
    assert (stats.clipped, stats.clip_total) == (2, len(maxima))
