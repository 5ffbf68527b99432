"""Sharded checkpoint folders: a directory or its ``*.safetensors.index.json`` in, quantized
shards + a rewritten index + every other file out, under the same safety rules."""

from __future__ import annotations

import hashlib
import json
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
import lowprec.checkpoint._convert as convert_mod
from lowprec.checkpoint import (
    CheckpointError,
    SafetensorsReader,
    dequantize_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    quantize_checkpoint,
)
from lowprec.cli import main

from helpers.asserts import assert_bits_equal

st_numpy = pytest.importorskip("safetensors.numpy")  # an independent writer of the shards

SHARDS = {
    "model-00001-of-00002.safetensors": {
        "model.embed_tokens.weight": (32, 64),
        "model.layers.0.mlp.up_proj.weight": (96, 64),
        "model.layers.0.input_layernorm.weight": (64,),
    },
    "model-00002-of-00002.safetensors": {
        "model.layers.1.mlp.up_proj.weight": (96, 64),
        "model.layers.1.self_attn.o_proj.weight": (64, 64),
        "lm_head.weight": (32, 64),
    },
}
OTHER_FILES = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b'{"version": "1.0"}',
    "1_Pooling/config.json": b'{"pooling_mode_mean_tokens": true}',
}


def digests(folder) -> dict:
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, folder)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture
def sharded(tmp_path):
    """A Hugging Face style sharded folder; shard files are symbolic links into the blob
    store, laid out as in a hub cache (``<repo>/snapshots/<rev>/shard -> <repo>/blobs/...``)."""
    rng = np.random.default_rng(0)
    repo = tmp_path / "models--org--tiny"
    folder, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    folder.mkdir(parents=True)
    blobs.mkdir()
    tensors, weight_map = {}, {}
    for shard, specs in SHARDS.items():
        t = {k: rng.standard_normal(s).astype(np.float32) for k, s in specs.items()}
        st_numpy.save_file(t, str(blobs / shard), metadata={"format": "pt"})
        os.symlink(blobs / shard, folder / shard)
        tensors.update(t)
        weight_map.update(dict.fromkeys(t, shard))
    total = sum(v.nbytes for v in tensors.values())
    index = {"metadata": {"total_size": total, "note": "kept"}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    for rel, data in OTHER_FILES.items():
        (folder / rel).parent.mkdir(exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder, tensors


def data_bytes(path) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return os.path.getsize(path) - 8 - n


@pytest.mark.parametrize("given", ["folder", "index"])
def test_quantize_folder(tmp_path, sharded, given):
    folder, tensors = sharded
    before = digests(folder)
    src = folder if given == "folder" else folder / "model.safetensors.index.json"
    out = tmp_path / "out"
    rep = quantize_checkpoint(src, out, "mxfp4", report=tmp_path / "report.json")
    assert digests(folder) == before  # the input is only read
    assert sorted(digests(out)) == sorted(before)  # same files, same names
    for rel, data in OTHER_FILES.items():
        assert (out / rel).read_bytes() == data
    index = json.loads((out / "model.safetensors.index.json").read_text())
    quantized = {r.name for r in rep.tensors if r.quantized}
    assert quantized == {"model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight",
                         "model.layers.1.self_attn.o_proj.weight"}
    # The rewritten index maps every stored tensor to the shard that holds it.
    stored = {}
    for shard in SHARDS:
        with SafetensorsReader(out / shard) as r:
            stored.update(dict.fromkeys(r.tensors, shard))
    assert index["weight_map"] == stored
    assert "model.layers.1.mlp.up_proj.weight_elements" in stored
    assert index["metadata"]["total_size"] == sum(data_bytes(out / s) for s in SHARDS)
    assert index["metadata"]["note"] == "kept"
    # Values: each tensor is the in-memory API's result.
    got = load_checkpoint(out)
    assert set(got) == set(tensors)
    for name, x in tensors.items():
        want = (lowprec.dequantize(lowprec.quantize_mx(jnp.asarray(x), "mxfp4"))
                if name in quantized else x)
        assert_bits_equal(got[name], want)
    assert {r.shard for r in rep.tensors} == set(SHARDS)
    assert json.loads((tmp_path / "report.json").read_text())["totals"]["tensors_quantized"] == 3
    # ... and back.
    back = tmp_path / "back"
    dequantize_checkpoint(out, back)
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    for name, v in load_checkpoint(back).items():
        np.testing.assert_array_equal(v, got[name])
    assert len(inspect_checkpoint(out).tensors) == len(tensors)


def test_folder_without_index_converts_every_safetensors_file(tmp_path, sharded):
    folder, tensors = sharded
    os.unlink(folder / "model.safetensors.index.json")
    out = tmp_path / "out"
    rep = quantize_checkpoint(folder, out, "bf16")
    assert {r.name for r in rep.tensors} == set(tensors)
    assert not (out / "model.safetensors.index.json").exists()
    assert (out / "config.json").read_bytes() == OTHER_FILES["config.json"]


def test_cli_folder_with_progress(tmp_path, sharded, capsys):
    folder, _ = sharded
    out = tmp_path / "out"
    assert main(["quantize", str(folder), str(out), "-f", "mxfp8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["totals"]["tensors_quantized"] == 3
    rep = quantize_checkpoint(folder, tmp_path / "out2", "mxfp8", progress=True)
    err = capsys.readouterr().err
    assert "quantize:" in err and "B/s" in err  # a tqdm bar, on stderr
    assert rep.totals()["tensors_quantized"] == 3


# -- safety ------------------------------------------------------------------------------
def test_output_folder_checks(tmp_path, sharded):
    folder, _ = sharded
    with pytest.raises(CheckpointError, match="is the input folder"):
        quantize_checkpoint(folder, folder, "mxfp4", force=True)
    os.symlink(folder, tmp_path / "alias")
    with pytest.raises(CheckpointError, match="is the input folder"):
        quantize_checkpoint(folder, tmp_path / "alias", "mxfp4", force=True)
    with pytest.raises(CheckpointError, match="inside the input folder"):
        quantize_checkpoint(folder, folder / "q", "mxfp4")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a folder"):
        quantize_checkpoint(folder, tmp_path / "file", "mxfp4", force=True)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("mine")
    with pytest.raises(CheckpointError, match="config.json: already exists"):
        quantize_checkpoint(folder, out, "mxfp4")
    os.unlink(out / "config.json")
    os.mkfifo(out / "config.json")
    with pytest.raises(CheckpointError, match="FIFO"):
        quantize_checkpoint(folder, out, "mxfp4", force=True)
    os.unlink(out / "config.json")
    os.link(folder / "tokenizer.json", out / "tokenizer.json")
    with pytest.raises(CheckpointError, match="link to the input file"):
        quantize_checkpoint(folder, out, "mxfp4", force=True)
    assert sorted(os.listdir(out)) == ["tokenizer.json"]


def test_failure_midway_publishes_nothing(tmp_path, sharded, monkeypatch):
    folder, _ = sharded
    calls = []
    real = convert_mod.quantize_chunk

    def fail_late(*a, **k):  # fails in the second shard, after the first was finished
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated failure")
        return real(*a, **k)

    monkeypatch.setattr(convert_mod, "quantize_chunk", fail_late)
    with pytest.raises(RuntimeError, match="simulated"):
        quantize_checkpoint(folder, tmp_path / "out", "mxfp4")
    assert not (tmp_path / "out").exists()  # the folder it created is removed again


@pytest.mark.parametrize("case,phrase", [
    ("missing_shard", "is missing from"),
    ("traversal", "not a plain file name"),
    ("wrong_shard", "which has no such tensor"),
    ("not_json", "not a valid JSON index"),
    ("no_weight_map", "weight_map"),
])
def test_bad_index_is_a_clean_error(tmp_path, sharded, case, phrase):
    folder, _ = sharded
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    wm = index["weight_map"]
    if case == "missing_shard":
        wm["lm_head.weight"] = "model-00003-of-00003.safetensors"
    elif case == "traversal":
        wm["lm_head.weight"] = "../blobs/model-00002-of-00002.safetensors"
    elif case == "wrong_shard":
        wm["lm_head.weight"] = "model-00001-of-00002.safetensors"
    elif case == "no_weight_map":
        del index["weight_map"]
    path.write_text("{nope" if case == "not_json" else json.dumps(index))
    with pytest.raises(CheckpointError, match=phrase):
        quantize_checkpoint(folder, tmp_path / "out", "mxfp4")
    assert not (tmp_path / "out").exists()


def test_special_files_in_the_folder_are_skipped_and_listed(tmp_path, sharded):
    folder, _ = sharded
    os.mkfifo(folder / "pipe")
    rep = quantize_checkpoint(folder, tmp_path / "out", "mxfp4")
    assert rep.skipped == [("pipe", "not a regular file")]
    assert "not copied: pipe" in rep.table()
    assert not (tmp_path / "out" / "pipe").exists()


# -- symbolic links out of the folder; sibling shards -------------------------------------


def test_link_out_of_the_folder_is_refused_unless_asked(tmp_path, sharded, capsys):
    folder, _ = sharded
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the model")
    os.symlink(secret, folder / "notes.txt")
    out = tmp_path / "out"
    for call in (lambda: quantize_checkpoint(folder, out, "mxfp4", progress=False),
                 lambda: convert_mod.dequantize_checkpoint(folder, out, progress=False)):
        with pytest.raises(CheckpointError, match=r"notes.txt: is a symbolic link to .*secret.txt"
                                                  r", outside the input folder.*--follow-symlinks"):
            call()
        assert not out.exists()
    assert main(["quantize", str(folder), str(out), "-f", "mxfp4", "-q"]) == 1
    assert "--follow-symlinks" in capsys.readouterr().err and not out.exists()
    # Asked for: read and copied (the shards' links into the cache's blobs/ never needed it).
    assert main(["quantize", str(folder), str(out), "-f", "mxfp4", "-q", "--follow-symlinks"]) == 0
    assert (out / "notes.txt").read_text() == "not part of the model"
    assert not (out / "notes.txt").is_symlink()


def test_force_never_replaces_a_sibling_shard(sharded):
    folder, _ = sharded
    first, second = (folder / f"model-0000{i}-of-00002.safetensors" for i in (1, 2))
    before = hashlib.sha256(second.read_bytes()).hexdigest()
    for dst in (second, folder / "model.safetensors.index.json"):
        with pytest.raises(CheckpointError, match="is a file of the input checkpoint"):
            quantize_checkpoint(first, dst, "mxfp4", force=True, progress=False)
    assert hashlib.sha256(second.read_bytes()).hexdigest() == before


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_jobs_give_the_same_output(tmp_path, sharded, fmt):
    folder, _ = sharded
    one, two, back1, back2 = (tmp_path / n for n in ("one", "two", "back1", "back2"))
    rep1 = quantize_checkpoint(folder, one, fmt, progress=False)
    rep2 = quantize_checkpoint(folder, two, fmt, progress=False, jobs=2)
    assert digests(one) == digests(two)
    assert [t.to_dict() for t in rep1.tensors] == [t.to_dict() for t in rep2.tensors]
    dequantize_checkpoint(one, back1, progress=False)
    assert main(["dequantize", str(two), str(back2), "-q", "--jobs", "3"]) == 0
    assert digests(back1) == digests(back2)


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True])
def test_jobs_must_be_a_positive_int(tmp_path, sharded, jobs):
    folder, _ = sharded
    with pytest.raises(CheckpointError, match="jobs must be a positive int"):
        quantize_checkpoint(folder, tmp_path / "o", "mxfp4", progress=False, jobs=jobs)
    assert not (tmp_path / "o").exists()
