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
import ml_dtypes

from lowprec.checkpoint import SafetensorsReader, SafetensorsWriter
from lowprec.checkpoint._safetensors import dtype_name
from lowprec.cli import main

from helpers.asserts import assert_bits_equal


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
    assert_bits_equal(got, want)


@pytest.mark.parametrize(
    "args,phrase",
    [
        (["quantize", "{in}", "{in}", "-f", "mxfp4", "--force"], "is the input file"),
        (["quantize", "{in}", "{exists}", "-f", "mxfp4"], "already exists"),
        (["quantize", "{pt}", "{out}", "-f", "mxfp4"], "pickle"),
        (["quantize", "{in}", "{out}", "-f", "mxfp8", "--layout", "gpt-oss"], "MXFP4 only"),
        (["quantize", "{in}", "{out}", "-f", "mxfp4", "--axis", "5"], "axis 5 is out of range"),
        (["quantize", "{in}", "{out}", "-f", "mxfp4", "--include", "nomatch"],
         "--include 'nomatch' matches none of the 3 tensor names"),
        (["quantize", "{in}", "{out}", "-f", "bf16", "--axis", "0"], "MX formats only"),
        (["quantize", "{in}", "{out}", "-f", "nvfp4", "--scale-rule", "floor"],
         "nvfp4 has its own scale recipe"),
        (["quantize", "{in}", "{out}", "-f", "mxint8", "--block-size", "48"], "block size 48"),
        (["quantize", "{in}", "{out}", "-f", "e5m2", "--block-size", "16"], "block formats only"),
        (["quantize", "{in}", "{out}", "-f", "mxfp4", "--report", "{in}"], "is the input file"),
        (["dequantize", "{in}", "{out}"], "holds no quantized tensors"),
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
    assert "Traceback" not in err


@pytest.mark.parametrize("args,phrase", [
    (["quantize", "a.safetensors"], "required"),
    (["quantize", "a", "b", "-f", "mxfp4", "--scale-rule", "nearest"],
     "argument --scale-rule: unknown scale_rule 'nearest'"),
    (["quantize", "a", "b", "-f", "nf4"], "argument --format/-f: unknown checkpoint format 'nf4'"),
    (["quantize", "a", "b", "-f", "tf32"], "format 'tf32' is not a checkpoint storage format"),
    (["quantize", "a", "b", "-f", "ue8m0"], "(e8m0) is not a checkpoint storage format"),
    (["quantize", "a", "b", "-f", "float8_e3m4"], "(e3m4) is not a checkpoint storage format"),
    (["quantize", "a", "b", "-f", "mxfp4", "--block-size", "x"], "--block-size: invalid int"),
    # every layout is listed (issue 33.9: only lowprec and gpt-oss were), and convert's own
    (["quantize", "a", "b", "-f", "mxfp4", "--layout", "hf"],
     "unknown layout 'hf'; choose one of: lowprec, gpt-oss, compressed-tensors, modelopt"),
    (["convert", "a", "b", "--layout", "gpt-oss"],
     "unknown layout 'gpt-oss' for convert; choose one of: lowprec, compressed-tensors, modelopt"),
    (["quantize", "a", "b", "-f", "e4m3", "--fp8-scale", "row"], "unknown fp8_scale 'row'"),
])
def test_usage_errors_exit_2(capsys, args, phrase):
    """Bad option values exit 2 with the library's own validation message."""
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert phrase in capsys.readouterr().err


def test_new_block_formats_and_block_size(tmp_path, ckpt, capsys):
    """--block-size is recorded in the format name; NVFP4 stores its tensor scale; both read
    back as the library's in-memory round trip."""
    path, t = ckpt
    name = "model.layers.0.self_attn.o_proj.weight"
    x = jnp.asarray(t[name])
    for args, fmt in ((["-f", "mxfp6", "--block-size", "16"], "mxfp6_e2m3_b16"),
                      (["-f", "nvfp4"], "nvfp4")):
        out, back = tmp_path / f"{fmt}.safetensors", tmp_path / f"{fmt}-back.safetensors"
        assert main(["quantize", str(path), str(out), *args, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["options"]["format"] == fmt
        assert {e["name"]: e["format"] for e in report["tensors"]}[name] == fmt
        assert main(["inspect", str(out), "--json"]) == 0
        rows = {e["name"]: e for e in json.loads(capsys.readouterr().out)["tensors"]}
        assert rows[name]["format"] == fmt
        assert main(["dequantize", str(out), str(back), "-q"]) == 0
        with SafetensorsReader(out) as r:
            stored = set(r.tensors)
        with SafetensorsReader(back) as r:
            got = r.read(name)
        mx = lowprec.quantize_mx(x, fmt)
        assert_bits_equal(got, lowprec.dequantize(mx))
        assert (f"{name}_scale" in stored) == (fmt == "nvfp4")


def test_library_format_names_and_old_names(tmp_path, ckpt, capsys):
    """The CLI takes the library's names; old checkpoint names still read and mean the same."""
    path, _ = ckpt
    outs = {}
    for name in ("e4m3", "fp8_e4m3", "float8_e4m3fn"):
        outs[name] = tmp_path / f"{name}.safetensors"
        assert main(["quantize", str(path), str(outs[name]), "-f", name, "-q"]) == 0
    data = {n: p.read_bytes() for n, p in outs.items()}
    assert data["e4m3"] == data["fp8_e4m3"] == data["float8_e4m3fn"]
    with SafetensorsReader(outs["e4m3"]) as r:
        meta = json.loads(r.metadata["lowprec.tensors"])
        tensors = {k: r.read(k) for k in r.tensors}
        metadata = dict(r.metadata)
    assert {e["format"] for e in meta.values()} == {"e4m3"}
    # A file written by an earlier lowprec says "fp8_e4m3": it still reads, as e4m3.
    old = tmp_path / "old.safetensors"
    for e in meta.values():
        e["format"] = "fp8_e4m3"
    metadata["lowprec.tensors"] = json.dumps(meta)
    with SafetensorsWriter(old, [(k, dtype_name(v.dtype), v.shape) for k, v in tensors.items()],
                           metadata) as w:
        for k, v in tensors.items():
            w.write(k, v)
    assert main(["inspect", str(old), "--json"]) == 0
    rows = {e["name"]: e for e in json.loads(capsys.readouterr().out)["tensors"]}
    assert rows["model.layers.0.self_attn.o_proj.weight"]["format"] == "e4m3"
    back_old, back_new = tmp_path / "b1.safetensors", tmp_path / "b2.safetensors"
    assert main(["dequantize", str(old), str(back_old), "-q"]) == 0
    assert main(["dequantize", str(outs["e4m3"]), str(back_new), "-q"]) == 0
    assert back_old.read_bytes() == back_new.read_bytes()


def test_inf_weights_are_not_reported_exact(tmp_path, capsys):
    """+inf cast with saturation to bf16 max: not 'exact, max abs err 0'."""
    x = np.ones((4, 32), np.float32)
    x[0, 0], x[1, 1] = np.inf, -np.inf
    path = tmp_path / "m.safetensors"
    with SafetensorsWriter(path, [("w", "F32", x.shape)]) as w:
        w.write("w", x)
    out, rep = tmp_path / "q.safetensors", tmp_path / "r.json"
    assert main(["quantize", str(path), str(out), "-f", "bf16", "--include", "w",
                 "--report", str(rep)]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("w "))
    assert "exact" not in row and "2 inf->max" in row and "0*" in row
    assert "their SQNR and errors are over the elements finite" in table
    entry = json.loads(rep.read_text())["tensors"][0]
    assert entry["exact"] is False and entry["inf_saturated"] == 2 and entry["nonfinite"] == 2
    stored = SafetensorsReader(out).read("w").astype(np.float32)
    assert stored[0, 0] == float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)  # what "->max" says


def test_nan_blocks_show_in_the_table(tmp_path, capsys):
    x = np.ones((2, 64), np.float32)
    x[0, 3] = np.nan
    x[1, 40] = np.inf
    path = tmp_path / "m.safetensors"
    with SafetensorsWriter(path, [("w", "F32", x.shape)]) as w:
        w.write("w", x)
    assert main(["quantize", str(path), str(tmp_path / "q.safetensors"), "-f", "mxfp8",
                 "--include", "w"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("w "))
    # two blocks got the NaN scale; their 62 finite elements now decode to NaN
    assert "2 NaN blocks" in row and "62 finite->NaN" in row and "exact" not in row


def test_metadata_claiming_a_non_float_dtype_is_a_clean_error(tmp_path, ckpt, capsys):
    path, _ = ckpt
    q = tmp_path / "q.safetensors"
    assert main(["quantize", str(path), str(q), "-f", "mxfp4", "-q"]) == 0
    with SafetensorsReader(q) as r:
        tensors = {k: r.read(k) for k in r.tensors}
        metadata = dict(r.metadata)
    meta = json.loads(metadata["lowprec.tensors"])
    meta["model.layers.0.self_attn.o_proj.weight"]["dtype"] = "I64"
    metadata["lowprec.tensors"] = json.dumps(meta)
    bad = tmp_path / "bad.safetensors"
    with SafetensorsWriter(bad, [(k, dtype_name(v.dtype), v.shape) for k, v in tensors.items()],
                           metadata) as w:
        for k, v in tensors.items():
            w.write(k, v)
    for cmd in (["inspect", str(bad)], ["dequantize", str(bad), str(tmp_path / "d.safetensors")]):
        assert main(cmd) == 1
        err = capsys.readouterr().err
        assert "claims original dtype 'I64'" in err and "Traceback" not in err
    assert not (tmp_path / "d.safetensors").exists()


def test_inspect_into_a_closed_pipe_exits_quietly(tmp_path):
    """`lowprec inspect f | head -1`: no BrokenPipeError traceback."""
    path = tmp_path / "many.safetensors"
    names = [f"model.layers.{i}.mlp.gate_proj.weight" for i in range(3000)]
    with SafetensorsWriter(path, [(n, "F32", (1,)) for n in names]) as w:
        for n in names:
            w.write(n, np.ones(1, np.float32))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "lowprec", "inspect", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does after its line
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert first.startswith(b"tensor")
    assert proc.returncode == 141, err
    assert err == ""


def test_python_dash_m_entry_point(tmp_path, ckpt):
    path, _ = ckpt
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "lowprec", "inspect", str(path)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "model.layers.0.self_attn.o_proj.weight" in r.stdout and "3 tensors" in r.stdout
