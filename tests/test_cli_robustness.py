"""One-line errors, never tracebacks: hostile headers and metadata, names that are not
Unicode, and a stdout that cannot be written after the output is complete."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from helpers.checkpoints import save
from lowprec.checkpoint import CheckpointError, load_checkpoint, quantize_checkpoint
from lowprec.cli import main

DEPTH = 100_000  # far beyond the interpreter's recursion limit


def _raw_file(path, header_text: str, data: bytes = b""):
    raw = header_text.encode("utf-8")
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _header(entries: dict, metadata=None) -> str:
    h = dict(entries)
    if metadata is not None:
        h["__metadata__"] = metadata
    return json.dumps(h)


@pytest.mark.parametrize("where", ["header", "metadata_value", "index"])
def test_json_nesting_bombs_are_clean_errors(tmp_path, capsys, where):
    bomb = "[" * DEPTH + "]" * DEPTH
    path = tmp_path / "m.safetensors"
    if where == "header":
        _raw_file(path, '{"a": ' + bomb + "}")
        target = path
    elif where == "metadata_value":
        # The lowprec metadata value is itself JSON: parsed when the file is read.
        entry = {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
        _raw_file(path, _header(entry, {"lowprec.tensors": bomb,
                                        "lowprec.format_version": "1"}), b"\0" * 4)
        target = path
    else:
        folder = tmp_path / "ckpt"
        folder.mkdir()
        save(folder / "model-00001-of-00001.safetensors", {"w": np.ones(4, np.float32)})
        (folder / "model.safetensors.index.json").write_text('{"weight_map": ' + bomb + "}")
        target = folder
    with pytest.raises(CheckpointError, match="nested too deeply"):
        load_checkpoint(target)
    assert main(["inspect", str(target)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nested too deeply" in err


def test_lone_surrogate_names_are_clean_errors(tmp_path, capsys):
    path = tmp_path / "m.safetensors"
    # JSON escapes may spell a lone surrogate; Python decodes it into an unencodable str.
    text = '{"w\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    _raw_file(path, text, b"\0" * 4)
    with pytest.raises(CheckpointError, match="not valid Unicode"):
        load_checkpoint(path)
    assert main(["quantize", str(path), str(tmp_path / "o.safetensors"), "-f", "mxfp4"]) == 1
    assert "not valid Unicode" in capsys.readouterr().err
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_full_stdout_after_the_output_is_published(tmp_path):
    src, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save(src, {"model.layers.0.mlp.up_proj.weight": np.ones((4, 64), np.float32)})
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "lowprec", "quantize", str(src), str(out),
                               "-f", "mxfp4"], stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "lowprec quantize: error: cannot write the report to stdout")
    # The output was complete before stdout failed, and it is kept.
    ref = tmp_path / "ref.safetensors"
    quantize_checkpoint(src, ref, "mxfp4", progress=False)
    assert out.read_bytes() == ref.read_bytes()
