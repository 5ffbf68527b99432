"""Decoding is never silently wrong: a finite value beyond the output dtype's range is refused,
or clamped with ``saturate`` and counted; the report counts NaN/inf it writes; invalid tensor
scales and block scales, parts of the wrong dtype or shape, configs that contradict the
tensors, modules lowprec cannot decode (refused, or kept as stored on request), unknown format
versions and missing names are refused — every reader checks every quantized tensor
(lowprec.checkpoint._validate)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from helpers.checkpoints import save
from lowprec.checkpoint import (
    CheckpointError,
    SafetensorsReader,
    convert_checkpoint,
    dequantize_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    quantize_checkpoint,
)
from lowprec.cli import main

NAME = "model.layers.0.mlp.down_proj.weight"
F16_MAX = float.fromhex("0x1.ffcp15")  # 65504 = (2 - 2^-10) * 2^15


def _f16_peaks(tmp_path):
    """A float16 weight whose every 32-block holds 65504 (float16's largest finite value).

    Under the rceil rule, scale = 65504 / 448 = 146.2... rounds up to 2^8, and
    65504 / 2^8 = 255.875 rounds (E4M3 spacing 16 in [128, 256)) to 256: the element decodes
    to 256 * 2^8 = 65536, above float16's range although the input was a float16.
    """
    x = np.tile(np.linspace(-1.0, 1.0, 32, dtype=np.float16), (4, 4))
    x[:, ::32] = np.float16(F16_MAX)
    src, q = tmp_path / "in.safetensors", tmp_path / "q.safetensors"
    save(src, {NAME: x})
    quantize_checkpoint(src, q, "mxfp8_e4m3", scale_rule="rceil", progress=False)
    return x, q


def test_original_float16_overflow_is_refused_not_written_as_inf(tmp_path):
    x, q = _f16_peaks(tmp_path)
    out = tmp_path / "d.safetensors"
    with pytest.raises(CheckpointError, match=rf"{NAME}: 16 finite value\(s\) up to 65536 do not "
                                               r"fit float16.*--saturate"):
        dequantize_checkpoint(q, out, progress=False)
    assert not out.exists()
    with pytest.raises(CheckpointError, match="65536"):
        load_checkpoint(q)
    # float32 holds the decoded value itself.
    assert float(load_checkpoint(q, dtype="float32")[NAME][0, 0]) == 65536.0


def test_saturate_clamps_and_counts(tmp_path, capsys):
    x, q = _f16_peaks(tmp_path)
    out, rep = tmp_path / "d.safetensors", tmp_path / "r.json"
    assert main(["dequantize", str(q), str(out), "--saturate", "--report", str(rep)]) == 0
    assert "16 saturated to ±max" in capsys.readouterr().out
    with SafetensorsReader(out) as r:
        got = r.read(NAME)
    assert got.dtype == np.float16 and np.isfinite(got).all()
    np.testing.assert_array_equal(got[:, ::32], np.float16(F16_MAX))
    row = json.loads(rep.read_text())["tensors"][0]
    assert row["saturated"] == 16 and row["decoded_nonfinite"] == 0
    assert json.loads(rep.read_text())["totals"]["values_saturated"] == 16
    # The same through the API, and the refusal without the flag through the CLI.
    np.testing.assert_array_equal(load_checkpoint(q, saturate=True)[NAME], got)
    assert main(["dequantize", str(q), str(tmp_path / "e.safetensors")]) == 1
    assert "--saturate" in capsys.readouterr().err


@pytest.mark.parametrize("fmt,big,dtype,limit", [
    # E5M2 (spacing 2^14 at 2^16) stores 1e5 as 98304: beyond float16's 65504.
    ("mxfp8_e5m2", 1e5, "float16", F16_MAX),
    # An FP8 cast decodes value x (amax / 448) in float32: float32's largest value comes back
    # within an ulp of itself, beyond bfloat16's (2 - 2^-7) * 2^127. (MX values carry at most
    # 3 significant bits, so no MX value lies between the two maxima.)
    ("e4m3", float.fromhex("0x1.fffffep127"), "bfloat16", float.fromhex("0x1.fep127")),
])
def test_explicit_narrow_dtype(tmp_path, fmt, big, dtype, limit):
    x = np.full((2, 32), 0.5, np.float32)
    x[0, 0] = big
    src, q = tmp_path / "in.safetensors", tmp_path / "q.safetensors"
    save(src, {NAME: x})
    quantize_checkpoint(src, q, fmt, progress=False)
    decoded = float(load_checkpoint(q)[NAME][0, 0])  # float32: the decoded value itself
    assert np.isfinite(decoded) and decoded > limit
    with pytest.raises(CheckpointError, match=f"do not fit {dtype}"):
        load_checkpoint(q, dtype=dtype)
    got = load_checkpoint(q, dtype=dtype, saturate=True)[NAME]
    assert float(got[0, 0]) == limit and np.isfinite(np.asarray(got, np.float32)).all()


def test_report_counts_nan_written(tmp_path):
    x = np.ones((2, 64), np.float32)
    x[1, 40] = np.nan  # one NaN block: its 32 values decode to NaN
    src, q, out = (tmp_path / n for n in ("in.safetensors", "q.safetensors", "d.safetensors"))
    save(src, {NAME: x})
    quantize_checkpoint(src, q, "mxfp4", progress=False)
    rep = dequantize_checkpoint(q, out, progress=False)
    (row,) = rep.quantized
    assert row.decoded_nonfinite == 32 and row.nonfinite == 32
    assert "32 NaN/inf decoded" in rep.table()
    assert rep.totals()["tensors_with_nonfinite"] == 1


def test_load_checkpoint_missing_names_raise(tmp_path):
    src = tmp_path / "in.safetensors"
    save(src, {NAME: np.ones((2, 32), np.float32), "lm_head.weight": np.ones(2, np.float32)})
    with pytest.raises(KeyError, match=r"no tensor named 'model.layers.0.mlp.down_proj.weigth' "
                                       r"\(did you mean 'model.layers.0.mlp.down_proj.weight'\?\)"):
        load_checkpoint(src, names=["lm_head.weight", "model.layers.0.mlp.down_proj.weigth"])
    assert set(load_checkpoint(src, names="lm_head.weight")) == {"lm_head.weight"}


@pytest.mark.parametrize("version,phrase", [("99", "written by a newer lowprec: upgrade"),
                                            ("1.5beta", "reads version 1 only")])
def test_unknown_format_version_is_refused(tmp_path, version, phrase):
    src, q, edited = (tmp_path / n for n in ("in.safetensors", "q.safetensors", "e.safetensors"))
    save(src, {NAME: np.ones((2, 32), np.float32)})
    quantize_checkpoint(src, q, "mxfp4", progress=False)
    with SafetensorsReader(q) as r:
        tensors = {n: r.read(n) for n in r.tensors}
        metadata = dict(r.metadata)
    assert metadata["lowprec.format_version"] == "1"
    save(edited, tensors, {**metadata, "lowprec.format_version": version})
    with pytest.raises(CheckpointError, match=rf"format_version is '{version}'.*{phrase}"):
        load_checkpoint(edited)
    assert main(["inspect", str(edited)]) == 1


# Every stored scale that multiplies decoded values (or, for an activation, the engine's
# input), in every layout lowprec reads: (layout, format, stored scale: a suffix of the
# weight's name, or from "." one of its module's). compressed-tensors' global scale divides
# (e × s / gs), the others multiply; any of them negative, zero, NaN or infinite turns finite
# weights into flipped signs, ±inf, NaN or zeros.
SCALES = [
    ("lowprec", "e4m3", "_scale"),
    ("lowprec", "nvfp4", "_scale"),
    ("compressed-tensors", "NVFP4A16", "_global_scale"),
    ("compressed-tensors", "FP8A16", "_scale"),
    ("compressed-tensors", "FP8A16_CHANNEL", "_scale"),
    ("compressed-tensors", "FP8", ".input_scale"),
    ("compressed-tensors", "NVFP4", ".input_global_scale"),
    ("modelopt", "NVFP4A16", "_scale_2"),
    ("modelopt", "FP8", "_scale"),
    ("modelopt", "FP8_DYNAMIC", "_scale"),
    ("modelopt", "NVFP4", ".input_scale"),
]


@pytest.mark.parametrize("layout,fmt,suffix", SCALES, ids=[f"{a}-{b}-{c}" for a, b, c in SCALES])
@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf")])
@pytest.mark.quick_first(6)
def test_invalid_scales_are_refused_in_every_layout(tmp_path, capsys, layout, fmt, suffix, bad):
    src, q, edited = (tmp_path / n for n in ("in.safetensors", "q.safetensors", "e.safetensors"))
    save(src, {NAME: np.linspace(-2.0, 2.0, 64 * 32, dtype=np.float32).reshape(64, 32)})
    module = NAME[: -len(".weight")]
    static = {"activation_amax": {module: 3.5}} if fmt in ("FP8", "NVFP4") else {}
    quantize_checkpoint(src, q, fmt, layout=layout, progress=False, **static)
    with SafetensorsReader(q) as r:
        tensors = {n: r.read(n) for n in r.tensors}
        metadata = dict(r.metadata)
    stored = (module if suffix.startswith(".") else NAME) + suffix
    scale = tensors[stored]
    assert np.all(scale.astype(np.float32) > 0) and np.isfinite(scale).all()
    tensors[stored] = np.full_like(scale, bad)
    save(edited, tensors, metadata)
    where = rf"{stored} \(the (global |input )?scale of {NAME}\): "
    with pytest.raises(CheckpointError, match=where + ".*not positive and finite"):
        load_checkpoint(edited, dtype="float32")
    out = tmp_path / "d.safetensors"
    assert main(["dequantize", str(edited), str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert "not positive and finite" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    # moving such a tensor to another layout would carry the damage on unnoticed
    target = "lowprec" if layout != "lowprec" else "compressed-tensors"
    with pytest.raises(CheckpointError, match=where + ".*not positive and finite"):
        convert_checkpoint(edited, tmp_path / "c.safetensors", target, progress=False)
    assert not (tmp_path / "c.safetensors").exists()


def test_fp8_with_scales_of_an_unknown_layout_is_refused_not_passed_on(tmp_path, capsys):
    """Block-scaled FP8 (``weight_scale_inv`` per 128 x 128, as DeepSeek-V3 and Qwen3-FP8 store
    it) is no layout lowprec reads: its codes must not be written out as weights (dequantize),
    listed as high precision in an engine config (convert) or kept beside requantized ones."""
    from lowprec.checkpoint import convert_checkpoint, inspect_checkpoint

    rng = np.random.default_rng(3)
    codes = rng.integers(0, 0x7E, (128, 128), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    path = tmp_path / "m.safetensors"
    save(path, {"blk.weight": codes, "blk.weight_scale_inv": np.full((1, 1), 0.01, np.float32),
                "ct.weight": codes[:, :64].copy(), "ct.weight_scale": np.float32([0.01]),
                "norm.weight": np.ones(128, np.float32)})
    rep = inspect_checkpoint(path)  # listed as stored
    assert {t.name: t.format for t in rep.tensors}["blk.weight"] == "kept"
    phrase = (r"module blk \(blk.weight F8_E4M3 \[128, 128\], blk.weight_scale_inv F32 \[1, 1\]\)"
              r"(: quantized in a layout lowprec does not decode|; start from the unquantized)")
    for call in (lambda: load_checkpoint(path),
                 lambda: dequantize_checkpoint(path, tmp_path / "d.safetensors"),
                 lambda: convert_checkpoint(path, tmp_path / "c.safetensors", "compressed-tensors"),
                 lambda: quantize_checkpoint(path, tmp_path / "q.safetensors", "mxfp4",
                                             include="norm"),
                 lambda: quantize_checkpoint(path, tmp_path / "e.safetensors", "NVFP4A16",
                                             layout="compressed-tensors")):
        with pytest.raises(CheckpointError, match=phrase):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    assert main(["dequantize", str(path), str(tmp_path / "d.safetensors")]) == 1
    assert "a layout lowprec does not decode" in capsys.readouterr().err


# -- block scales --------------------------------------------------------------------------
# Where each layout keeps NVFP4's E4M3 block scales, and the tensor-wide scale beside them:
# (layout, block scales, tensor-wide scale, a positive finite value of it that makes the
# factor of the largest block scale overflow float32: lowprec and ModelOpt multiply, ts x s;
# compressed-tensors divides, s / gs).
BLOCK_SCALES = [
    ("lowprec", "_scales", "_scale", 1e38),
    ("compressed-tensors", "_scale", "_global_scale", 1e-38),
    ("modelopt", "_scale", "_scale_2", 1e38),
]


def _stored(path):
    with SafetensorsReader(path) as r:
        return {n: r.read(n) for n in r.tensors}, dict(r.metadata)


@pytest.mark.parametrize("layout,scales,ts,huge", BLOCK_SCALES,
                         ids=[b[0] for b in BLOCK_SCALES])
def test_nvfp4_block_scales_are_checked_in_every_layout(tmp_path, capsys, layout, scales, ts, huge):
    """A negative E4M3 block scale (0xB8 = -1.0) would flip the sign of its block's values,
    exit 0 (issue 37.2); a tensor-wide scale that makes a block's factor inf would decode it
    to inf and NaN. Both are refused by every reader, in every layout, naming the stored
    tensor. The E4M3 NaN 0x7F is the writers' mark of a block that held NaN or inf: it
    decodes to NaN (counted), as the design says (docs/design.md §3b)."""
    x = np.linspace(-2.0, 2.0, 64 * 32, dtype=np.float32).reshape(64, 32)
    x[5, 3] = np.nan  # block 10 (row 5, first 16 elements) held a NaN
    src, q = tmp_path / "in.safetensors", tmp_path / "q.safetensors"
    save(src, {NAME: x})
    quantize_checkpoint(src, q, "nvfp4" if layout == "lowprec" else "NVFP4A16", layout=layout,
                        progress=False)
    tensors, meta = _stored(q)
    codes = tensors[NAME + scales].view(np.uint8)
    assert codes.shape == (64, 2) and (codes < 0x80).all() and codes[5, 0] == 0x7F
    back = load_checkpoint(q, dtype="float32")[NAME]  # accepted: the NaN block is NaN
    assert np.isnan(back[5, :16]).all() and np.isfinite(np.delete(back, 5, 0)).all()

    bad = codes.copy()
    bad[2, 1] = 0xB8  # -1.0: block 5
    edited = tmp_path / "neg.safetensors"
    save(edited, {**tensors, NAME + scales: bad.view(tensors[NAME + scales].dtype)}, meta)
    where = rf"{NAME}{scales} \(the block scales of {NAME}\): "
    with pytest.raises(CheckpointError, match=where + r"1 of 128 block scale\(s\) negative "
                                              r"\(e.g. block 5: code 0xB8 = -1.0\)"):
        load_checkpoint(edited)
    out = tmp_path / "d.safetensors"
    assert main(["dequantize", str(edited), str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert "block scale(s) negative" in err and len(err.strip().splitlines()) == 1
    target = "lowprec" if layout != "lowprec" else "compressed-tensors"
    with pytest.raises(CheckpointError, match=where + "1 of 128 block scale"):
        convert_checkpoint(edited, tmp_path / "c.safetensors", target, progress=False)
    assert not out.exists() and not (tmp_path / "c.safetensors").exists()

    wide = tmp_path / "wide.safetensors"
    scale = np.full_like(tensors[NAME + ts], huge)
    save(wide, {**tensors, NAME + ts: scale}, meta)
    with pytest.raises(CheckpointError, match=where + r"block scale .* gives its block the "
                                              r"factor inf"):
        dequantize_checkpoint(wide, out, progress=False)
    assert not out.exists()


@pytest.mark.parametrize("chunk", [8, 24, 1 << 22], ids=["8", "24", "whole"])
def test_nvfp4_block_scale_checks_do_not_depend_on_the_read_chunk(tmp_path, monkeypatch, chunk):
    """The block scales are checked a chunk at a time, most chunks (all positive, none NaN)
    by their largest code alone: the first negative block is named by its index in the
    tensor, and the largest finite factor is found when it lies in a chunk of its own, away
    from the NaN block and from the negative one."""
    import lowprec.checkpoint._validate as validate  # noqa: PLC0415

    monkeypatch.setattr(validate, "_SCALE_CHUNK", chunk)
    x = np.linspace(-2.0, 2.0, 64 * 32, dtype=np.float32).reshape(64, 32)
    x[5, 3] = np.nan  # block 10 held a NaN: code 0x7F
    src, q = tmp_path / "in.safetensors", tmp_path / "q.safetensors"
    save(src, {NAME: x})
    quantize_checkpoint(src, q, "nvfp4", progress=False)
    tensors, meta = _stored(q)
    codes = tensors[NAME + "_scales"].view(np.uint8).reshape(-1).copy()
    assert codes[10] == 0x7F and load_checkpoint(q)[NAME].shape == (64, 32)

    bad = codes.copy()
    bad[[37, 90]] = [0xB8, 0xC0]  # -1.0 and -2.0: blocks 37 and 90
    save(tmp_path / "neg.safetensors", {**tensors, NAME + "_scales": bad.reshape(64, 2)}, meta)
    with pytest.raises(CheckpointError, match=r"2 of 128 block scale\(s\) negative \(e.g. "
                                              r"block 37: code 0xB8 = -1.0\)"):
        load_checkpoint(tmp_path / "neg.safetensors")

    top = codes.copy()
    top[100] = 0x7E  # 448, the largest E4M3: inf under a tensor scale of 1e36
    ts = np.full_like(tensors[NAME + "_scale"], 1e36)
    save(tmp_path / "top.safetensors", {**tensors, NAME + "_scales": top.reshape(64, 2),
                                        NAME + "_scale": ts}, meta)
    with pytest.raises(CheckpointError, match=r"block scale 448.0 gives its block the factor "
                                              r"inf"):
        load_checkpoint(tmp_path / "top.safetensors")


# -- parts that fit no layout ---------------------------------------------------------------
def _ct_nvfp4(tmp_path, folder: bool):
    """A 128 x 64 weight in compressed-tensors NVFP4 (written by lowprec), as a file or in a
    folder whose config.json says so."""
    x = np.random.default_rng(5).standard_normal((128, 64)).astype(np.float32)
    src = tmp_path / "src"
    src.mkdir()
    save(src / "model.safetensors", {NAME: x})
    if folder:
        (src / "config.json").write_text('{"model_type": "llama"}')
        quantize_checkpoint(src, tmp_path / "q", "NVFP4A16", layout="compressed-tensors",
                            progress=False)
        return tmp_path / "q", tmp_path / "q" / "model.safetensors"
    quantize_checkpoint(src / "model.safetensors", tmp_path / "q.safetensors", "NVFP4A16",
                        layout="compressed-tensors", progress=False)
    return tmp_path / "q.safetensors", tmp_path / "q.safetensors"


# (what is edited, the edit, what the message says about it)
WRONG_PARTS = [
    ("_packed", lambda a: a.view(np.int8), r"weight_packed is I8 \[128, 32\] \(needs U8 \[128, 32\]\)"),
    ("_packed", lambda a: a.reshape(64, 64), r"weight_packed is U8 \[64, 64\] \(needs U8 \[128, 32\]\)"),
    ("_scale", lambda a: a.view(np.uint8),
     r"weight_scale is U8 \[128, 4\] \(needs F8_E4M3 \[128, 4\]\)"),
]


@pytest.mark.parametrize("folder", [False, True], ids=["file", "folder"])
@pytest.mark.parametrize("part,edit,phrase", WRONG_PARTS, ids=["I8", "shape", "U8-scale"])
def test_compressed_tensors_parts_of_the_wrong_dtype_or_shape_are_refused(
        tmp_path, capsys, folder, part, edit, phrase):
    """weight_packed of dtype I8 or shape [64, 64] instead of [128, 32], or weight_scale of
    dtype U8, used to be passed through as "kept: not quantized", exit 0, with no weight in
    the output (issue 37.3). Refused, naming the tensor, its dtype and shape and what NVFP4
    needs; when the folder's config says the module is NVFP4 the file is damaged and even
    keep_undecodable refuses it; a lone file, whose layout only its names tell, can be kept
    as stored on request."""
    given, shard = _ct_nvfp4(tmp_path, folder)
    tensors, meta = _stored(shard)
    tensors[NAME + part] = edit(tensors[NAME + part])
    save(shard, tensors, meta)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=rf"module {NAME[:-7]} .*{phrase}"):
        dequantize_checkpoint(given, out, progress=False)
    assert main(["dequantize", str(given), str(out), "-q"]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1 and not out.exists()
    if folder:
        with pytest.raises(CheckpointError, match=r"gives it group 'group_0' .*is a nvfp4|"
                                                  r"gives it group 'group_0' .*do not fit"):
            load_checkpoint(given, keep_undecodable=True)
    else:
        with pytest.raises(CheckpointError, match="nothing to decode"):  # nothing else there
            dequantize_checkpoint(given, out, keep_undecodable=True, progress=False)
        kept = load_checkpoint(given, keep_undecodable=True)
        assert set(kept) == set(tensors) and all(
            kept[n].tobytes() == tensors[n].tobytes() for n in tensors)


# -- the config against the tensors ---------------------------------------------------------
def _edit_config(folder, edit):
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    edit(config["quantization_config"] if "quantization_config" in config else config)
    path.write_text(json.dumps(config))


def _mxfp4_group(q):
    q["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=32,
                                                    scale_dtype="torch.uint8")
    q["config_groups"]["group_0"]["format"] = q["format"] = "mxfp4-pack-quantized"


CONTRADICTIONS = {  # edit of quantization_config -> what the refusal says
    "says-mxfp4": (_mxfp4_group, r"says group 'group_0' \(targets Linear: weights float 4-bit, "
                                 r"strategy group, group 32.*\) is mxfp4, but "
                                 rf"{NAME} is stored as nvfp4 \(compressed-tensors\)"),
    "group-32": (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=32),
                 r"strategy tensor_group, group 32.* is a scheme lowprec does not decode, but "
                 rf"{NAME} is stored as nvfp4"),
    "ignored": (lambda q: q["ignore"].append(NAME[:-7]),
                rf"lists {NAME[:-7]} as kept in high precision"),
    "modelopt": (lambda q: q.update(quant_method="modelopt", quant_algo="W4A16_NVFP4"),
                 rf"{NAME} is stored as nvfp4 \(compressed-tensors\), but .* says quant_method "
                 "'modelopt'"),
    "gptq": (lambda q: q.update(quant_method="gptq"),
             "quant_method 'gptq', a layout lowprec does not read"),
    "float-target": (lambda q: (q["config_groups"]["group_0"]["targets"].append(
                         "model.layers.0.mlp.up_proj"), q["ignore"].remove(
                         "model.layers.0.mlp.up_proj")),
                     r"targets model.layers.0.mlp.up_proj, but model.layers.0.mlp.up_proj.weight "
                     r"is stored as F32 \[8, 64\], not quantized"),
}


@pytest.mark.parametrize("case", list(CONTRADICTIONS))
def test_a_config_that_contradicts_the_tensors_is_refused(tmp_path, capsys, case):
    """config.json saying MXFP4 over NVFP4 tensors, or groups of 32 over groups of 16, was
    decoded from the tensors without a word (issue 37.5). Every contradiction is refused by
    every reader, naming both sides: the scheme, a module the config ignores or that no group
    targets, a quant_method lowprec does not read, a targeted module stored in high precision."""
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(6)
    save(src / "model.safetensors", {NAME: rng.standard_normal((128, 64)).astype(np.float32),
                                     "model.layers.0.mlp.up_proj.weight":
                                         rng.standard_normal((8, 64)).astype(np.float32)})
    (src / "config.json").write_text('{"model_type": "llama"}')
    quantize_checkpoint(src, tmp_path / "q", "NVFP4A16", layout="compressed-tensors",
                        ignore=["model.layers.0.mlp.up_proj"], progress=False)
    q = tmp_path / "q"
    load_checkpoint(q)  # as written: accepted
    edit, phrase = CONTRADICTIONS[case]
    _edit_config(q, edit)
    for call in (lambda: load_checkpoint(q),
                 lambda: dequantize_checkpoint(q, tmp_path / "d", progress=False),
                 lambda: convert_checkpoint(q, tmp_path / "c", "lowprec", progress=False)):
        with pytest.raises(CheckpointError, match=phrase):
            call()
    assert main(["dequantize", str(q), str(tmp_path / "d"), "-q"]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert sorted(os.listdir(tmp_path)) == ["q", "src"]


def test_lowprec_layout_with_a_quantization_config_is_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    save(src / "model.safetensors", {NAME: np.ones((8, 64), np.float32)})
    (src / "config.json").write_text('{"model_type": "llama"}')
    quantize_checkpoint(src, tmp_path / "q", "mxfp4", progress=False)
    load_checkpoint(tmp_path / "q")
    _edit_config(tmp_path / "q", lambda c: c.update(quantization_config={
        "quant_method": "compressed-tensors", "config_groups": {}}))
    with pytest.raises(CheckpointError, match=rf"{NAME} is stored in lowprec's layout, which has "
                                              r"no quantization_config, but .*compressed-tensors"):
        load_checkpoint(tmp_path / "q")


# -- modules lowprec cannot decode (issue 33.1) ----------------------------------------------
LLMC = Path(__file__).parent / "data" / "llmcompressor_w4a16_fp8_dynamic"
MLP = [f"model.layers.0.mlp.{p}" for p in ("down_proj", "gate_proj", "up_proj")]
ATTN = [f"model.layers.0.self_attn.{p}" for p in ("k_proj", "o_proj", "q_proj", "v_proj")]


def test_int4_group_of_llm_compressor_is_refused_or_kept_never_half_decoded(tmp_path, capsys):
    """llm-compressor's W4A16 (int4, pack-quantized) on the MLP beside FP8_DYNAMIC on attention
    (tests/data/README.md): lowprec decoded the FP8 weights, passed the int4 parts through and
    dropped quantization_config — transformers then initialised the MLP at random. Now every
    reader refuses in one line naming the module; keep_undecodable copies the int4 modules as
    stored and keeps their group of the config intact (attention, decoded, joins its ignore),
    a config compressed-tensors itself reads."""
    stored, _ = _stored(LLMC / "model.safetensors")
    config = json.loads((LLMC / "config.json").read_text())["quantization_config"]
    int4 = next(k for k, g in config["config_groups"].items() if g["weights"]["type"] == "int")
    phrase = (rf"module {MLP[0]} \({MLP[0]}.weight_packed I32 \[128, 32\], {MLP[0]}.weight_scale "
              rf"BF16 \[128, 2\], {MLP[0]}.weight_shape I64 \[2\]\): .*gives it group '{int4}' "
              r"\(targets re:\.\*mlp\.\*: weights int 4-bit.*\), a scheme lowprec does not "
              r"decode \(and 2 more: .*--keep-undecodable")
    out = tmp_path / "out"
    for call in (lambda: dequantize_checkpoint(LLMC, out, progress=False),
                 lambda: load_checkpoint(LLMC),
                 lambda: convert_checkpoint(LLMC, out, "lowprec", progress=False)):
        with pytest.raises(CheckpointError, match=phrase):
            call()
    assert main(["dequantize", str(LLMC), str(out), "-q"]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1 and not out.exists()
    listing = inspect_checkpoint(LLMC).table()
    assert all(f"not decodable by lowprec: module {m} " in listing for m in MLP)

    assert main(["dequantize", str(LLMC), str(out), "-q", "--keep-undecodable"]) == 0
    got, _ = _stored(out / "model.safetensors")
    for name, value in stored.items():  # int4 parts as stored, byte for byte
        if name.startswith(tuple(MLP)) or not name.startswith(tuple(ATTN)):
            assert got[name].tobytes() == value.tobytes() and got[name].dtype == value.dtype
    for module in ATTN:  # FP8 per channel: e x s in float32, then the model dtype (bfloat16)
        e = stored[module + ".weight"].astype(np.float32)
        s = stored[module + ".weight_scale"].astype(np.float32)
        want = (e * s).astype(ml_dtypes.bfloat16)
        assert got[module + ".weight"].tobytes() == want.tobytes()
        assert module + ".weight_scale" not in got
    kept = json.loads((out / "config.json").read_text())["quantization_config"]
    assert kept["config_groups"] == {int4: config["config_groups"][int4]}
    assert kept["ignore"] == sorted(config["ignore"] + ATTN)
    assert {k: v for k, v in kept.items() if k not in ("config_groups", "ignore", "format")} == {
        k: v for k, v in config.items() if k not in ("config_groups", "ignore", "format")}
    assert kept["format"] == config["config_groups"][int4]["format"]
    loaded = load_checkpoint(LLMC, keep_undecodable=True)
    assert all(loaded[n].tobytes() == got[n].tobytes() for n in got)


@pytest.mark.slow  # imports torch; the config's content is checked field by field above
def test_kept_int4_config_is_one_compressed_tensors_reads(tmp_path):
    ct = pytest.importorskip("compressed_tensors.quantization")
    dequantize_checkpoint(LLMC, tmp_path / "out", keep_undecodable=True, progress=False)
    kept = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    parsed = ct.QuantizationConfig.model_validate(kept)
    assert set(parsed.ignore) >= set(ATTN) and len(parsed.config_groups) == 1
    (group,) = parsed.config_groups.values()
    assert group.weights.type == "int" and group.weights.num_bits == 4


def test_modelopt_mixed_precision_keeps_the_layers_it_cannot_decode(tmp_path, capsys):
    """ModelOpt's MIXED_PRECISION: an NVFP4 layer beside an AWQ int4 one (W4A16_AWQ: packed
    int4 weight, F16 weight_scale per 128, pre_quant_scale). The AWQ layer is refused, or
    kept as stored with its entry of quantized_layers, the NVFP4 layer decoded and excluded.
    NVFP4 weights beside a pre_quant_scale (NVFP4_AWQ) are not decoded alone either: the
    activations' scale is folded into them."""
    a, b = "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"
    src = tmp_path / "src"
    src.mkdir()
    save(src / "model.safetensors", {a + ".weight": np.linspace(-1, 1, 64 * 32, dtype=np.float32)
                                     .reshape(64, 32)})  # (the shape of the tests above)
    (src / "config.json").write_text('{"model_type": "llama"}')
    quantize_checkpoint(src, tmp_path / "q", "NVFP4A16", layout="modelopt", progress=False)
    q = tmp_path / "q"
    tensors, meta = _stored(q / "model.safetensors")
    awq = {b + ".weight": np.full((64, 32), 0x88, np.uint8),
           b + ".weight_scale": np.ones((64, 1), np.float16),
           b + ".pre_quant_scale": np.ones(64, np.float16)}
    save(q / "model.safetensors", {**tensors, **awq}, meta)
    layers = {a: {"quant_algo": "W4A16_NVFP4", "group_size": 16},
              b: {"quant_algo": "W4A16_AWQ", "group_size": 128}}
    hf = {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "MIXED_PRECISION", "exclude_modules": ["lm_head"], "quantized_layers": layers}}
    (q / "hf_quant_config.json").write_text(json.dumps(hf))
    (q / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "ignore": ["lm_head"],
        "quantized_layers": layers}}))
    with pytest.raises(CheckpointError, match=rf"module {b} .*quant_algo W4A16_AWQ, group_size "
                                              r"128\), a scheme lowprec does not decode"):
        load_checkpoint(q)
    out = tmp_path / "out"
    assert main(["dequantize", str(q), str(out), "-q", "--keep-undecodable"]) == 0
    got, _ = _stored(out / "model.safetensors")
    assert all(got[n].tobytes() == v.tobytes() for n, v in awq.items())
    assert got[a + ".weight"].dtype == np.float32 and a + ".weight_scale" not in got
    kept_hf = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert kept_hf["quantized_layers"] == {b: layers[b]}
    assert kept_hf["exclude_modules"] == ["lm_head", a]
    kept = json.loads((out / "config.json").read_text())["quantization_config"]
    assert kept["quantized_layers"] == {b: layers[b]} and kept["ignore"] == ["lm_head", a]

    # No config: NVFP4 codes beside a pre_quant_scale are not decoded as if it were not there.
    lone = tmp_path / "lone.safetensors"
    save(lone, {**tensors, a + ".pre_quant_scale": np.ones(32, np.float16)}, meta)
    with pytest.raises(CheckpointError, match=rf"module {a} \({a}.pre_quant_scale F16 \[32\], "
                                              rf"{a}.weight U8 \[64, 16\]"):
        load_checkpoint(lone)
    assert set(load_checkpoint(lone, keep_undecodable=True)) == set(tensors) | {
        a + ".pre_quant_scale"}
