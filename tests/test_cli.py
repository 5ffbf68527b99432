"""The ``lowprec`` command line (lowprec.cli): quantize, dequantize, inspect."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
from lowprec.checkpoint import SafetensorsReader, SafetensorsWriter
from lowprec.cli import main


@pytest.fixture
def ckpt(tmp_path):
    rng = np.random.default_rng(0)
    t = {
        "model.embed_tokens.weight": rng.standard_normal((16, 64)).astype(np.float32),
        "model.layers.0.self_attn.o_proj.weight": rng.standard_normal((32, 64)).astype(np.float32),
        "model.layers.0.post_attention_layernorm.weight": np.ones(64, np.float32),
    }
    path = tmp_path / "in.safetensors"
    with SafetensorsWriter(path, [(k, "F32", v.shape) for k, v in t.items()]) as w:
        for k, v in t.items():
            w.write(k, v)
    return path, t


def test_quantize_prints_table_and_writes_json_report(tmp_path, ckpt, capsys):
    path, t = ckpt
    out, rep = tmp_path / "out.safetensors", tmp_path / "report.json"
    assert main(["quantize", str(path), str(out), "--format", "mxfp4", "--report", str(rep)]) == 0
    text = capsys.readouterr().out
    assert "model.layers.0.self_attn.o_proj.weight" in text and "SQNR dB" in text
    assert "1 of 3 tensors quantized" in text
    report = json.loads(rep.read_text())
    by = {e["name"]: e for e in report["tensors"]}
    o = by["model.layers.0.self_attn.o_proj.weight"]
    assert o["format"] == "mxfp4" and o["bits_per_param"] == 4.25 and o["sqnr_db"] > 10
    assert by["model.embed_tokens.weight"]["format"] == "kept"
    assert report["totals"]["tensors_quantized"] == 1


def test_quantize_json_quiet_and_options(tmp_path, ckpt, capsys):
    path, t = ckpt
    out = tmp_path / "out.safetensors"
    args = ["quantize", str(path), str(out), "-f", "mxfp4", "--layout", "gpt-oss",
            "--scale-rule", "rceil", "--include", "embed|proj", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["options"]["scale_rule"] == "rceil"
    with SafetensorsReader(out) as r:
        names = set(r.tensors)
    assert "model.embed_tokens.weight_blocks" in names
    assert "model.layers.0.self_attn.o_proj.weight_scales" in names
    assert main(["quantize", str(path), str(out), "-f", "bf16", "--force", "--quiet"]) == 0
    assert capsys.readouterr().out == ""


def test_dequantize_and_inspect(tmp_path, ckpt, capsys):
    path, t = ckpt
    q, d = tmp_path / "q.safetensors", tmp_path / "d.safetensors"
    assert main(["quantize", str(path), str(q), "-f", "mxfp8_e4m3", "-q"]) == 0
    assert main(["inspect", str(q)]) == 0
    text = capsys.readouterr().out
    assert "mxfp8_e4m3 floor" in text and "8.25" in text
    assert main(["inspect", str(q), "--json"]) == 0
    rows = {e["name"]: e for e in json.loads(capsys.readouterr().out)["tensors"]}
    assert rows["model.layers.0.self_attn.o_proj.weight"]["bits_per_param"] == 8.25
    assert main(["dequantize", str(q), str(d), "--dtype", "bfloat16", "-q"]) == 0
    with SafetensorsReader(d) as r:
        got = r.read("model.layers.0.self_attn.o_proj.weight")
        assert r.read("model.embed_tokens.weight").dtype == np.float32  # kept tensor unchanged
    mx = lowprec.quantize_mx(jnp.asarray(t["model.layers.0.self_attn.o_proj.weight"]), "mxfp8")
    want = np.asarray(lowprec.dequantize(mx, jnp.bfloat16))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize(
    "args,phrase",
    [
        (["quantize", "{in}", "{in}", "-f", "mxfp4", "--force"], "is the input file"),
        (["quantize", "{in}", "{exists}", "-f", "mxfp4"], "already exists"),
        (["quantize", "{pt}", "{out}", "-f", "mxfp4"], "pickle"),
        (["quantize", "{in}", "{out}", "-f", "mxfp8", "--layout", "gpt-oss"], "MXFP4 only"),
        (["quantize", "{in}", "{out}", "-f", "nf4"], "unknown checkpoint format"),
        (["inspect", "{junk}"], "not a safetensors file"),
        (["dequantize", "{in}", "{out}", "--dtype", "int8"], "not a supported output dtype"),
    ],
)
def test_errors_exit_1_with_message(tmp_path, ckpt, capsys, args, phrase):
    path, _ = ckpt
    (tmp_path / "exists.safetensors").write_bytes(b"keep me")
    (tmp_path / "model.pt").write_bytes(b"\x80\x02}q\x00.")
    (tmp_path / "junk.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00hi")
    names = {"in": path, "out": tmp_path / "out.safetensors", "exists": tmp_path /
             "exists.safetensors", "pt": tmp_path / "model.pt", "junk": tmp_path /
             "junk.safetensors"}
    argv = [a.format(**{k: str(v) for k, v in names.items()}) for a in args]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert phrase in err and err.startswith(f"lowprec {args[0]}: error:")
    assert (tmp_path / "exists.safetensors").read_bytes() == b"keep me"
    assert not (tmp_path / "out.safetensors").exists()


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["quantize", "a.safetensors"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["quantize", "a", "b", "-f", "mxfp4", "--scale-rule", "nearest"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_python_dash_m_entry_point(tmp_path, ckpt):
    path, _ = ckpt
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "lowprec", "inspect", str(path)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "model.layers.0.self_attn.o_proj.weight" in r.stdout and "3 tensors" in r.stdout
