"""Decoding is never silently wrong: a finite value beyond the output dtype's range is refused,
or clamped with ``saturate`` and counted; the report counts NaN/inf it writes; invalid tensor
scales, unknown format versions and missing names are refused."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from helpers.checkpoints import save
from lowprec.checkpoint import (
    CheckpointError,
    SafetensorsReader,
    convert_checkpoint,
    dequantize_checkpoint,
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


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan")])
@pytest.mark.quick_first(1)
def test_nvfp4_file_with_invalid_tensor_scale_is_refused(tmp_path, bad):
    src, q, edited = (tmp_path / n for n in ("in.safetensors", "q.safetensors", "e.safetensors"))
    save(src, {NAME: np.linspace(-2.0, 2.0, 64, dtype=np.float32).reshape(2, 32)})
    quantize_checkpoint(src, q, "nvfp4", progress=False)
    with SafetensorsReader(q) as r:
        tensors = {n: r.read(n) for n in r.tensors}
        metadata = r.metadata
    assert tensors[NAME + "_scale"] > 0
    tensors[NAME + "_scale"] = np.asarray(bad, np.float32).reshape(tensors[NAME + "_scale"].shape)
    save(edited, tensors, metadata)
    with pytest.raises(CheckpointError, match="tensor_scale must be positive and finite"):
        load_checkpoint(edited)


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


# Every stored scale that multiplies decoded values, in every layout lowprec reads: (layout,
# format, stored scale). compressed-tensors' global scale divides (e × s / gs), the others
# multiply; any of them negative, zero, NaN or infinite turns finite weights into flipped
# signs, ±inf, NaN or zeros.
SCALES = [
    ("lowprec", "e4m3", "_scale"),
    ("compressed-tensors", "nvfp4", "_global_scale"),
    ("compressed-tensors", "fp8", "_scale"),
    ("compressed-tensors", "fp8_channel", "_scale"),
    ("modelopt", "nvfp4", "_scale_2"),
    ("modelopt", "fp8", "_scale"),
]


@pytest.mark.parametrize("layout,fmt,suffix", SCALES, ids=[f"{a}-{b}" for a, b, _ in SCALES])
@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf")])
@pytest.mark.quick_first(6)
def test_invalid_scales_are_refused_in_every_layout(tmp_path, capsys, layout, fmt, suffix, bad):
    src, q, edited = (tmp_path / n for n in ("in.safetensors", "q.safetensors", "e.safetensors"))
    save(src, {NAME: np.linspace(-2.0, 2.0, 64 * 32, dtype=np.float32).reshape(64, 32)})
    quantize_checkpoint(src, q, fmt, layout=layout, progress=False)
    with SafetensorsReader(q) as r:
        tensors = {n: r.read(n) for n in r.tensors}
        metadata = dict(r.metadata)
    scale = tensors[NAME + suffix]
    assert np.all(scale.astype(np.float32) > 0) and np.isfinite(scale).all()
    tensors[NAME + suffix] = np.full_like(scale, bad)
    save(edited, tensors, metadata)
    with pytest.raises(CheckpointError, match=rf"{NAME}{suffix}: .*not positive and finite"):
        load_checkpoint(edited, dtype="float32")
    out = tmp_path / "d.safetensors"
    assert main(["dequantize", str(edited), str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert "not positive and finite" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    # moving such a tensor to another layout would carry the damage on unnoticed
    target = "lowprec" if layout != "lowprec" else "compressed-tensors"
    with pytest.raises(CheckpointError, match=rf"{NAME}: its .*scale: .*not positive and finite"):
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
    phrase = r"blk.weight \(F8_E4M3 \[128, 128\]\) comes with blk.weight_scale_inv .*lowprec does not read"
    for call in (lambda: load_checkpoint(path),
                 lambda: dequantize_checkpoint(path, tmp_path / "d.safetensors"),
                 lambda: convert_checkpoint(path, tmp_path / "c.safetensors", "compressed-tensors"),
                 lambda: quantize_checkpoint(path, tmp_path / "q.safetensors", "mxfp4",
                                             include="norm"),
                 lambda: quantize_checkpoint(path, tmp_path / "e.safetensors", "nvfp4",
                                             layout="compressed-tensors")):
        with pytest.raises(CheckpointError, match=phrase):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]
    assert main(["dequantize", str(path), str(tmp_path / "d.safetensors")]) == 1
    assert "lowprec does not read" in capsys.readouterr().err
