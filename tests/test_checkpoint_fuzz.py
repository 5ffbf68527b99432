"""Fuzzing: malformed safetensors files always give a clean ``lowprec`` error.

Hypothesis builds files with a wrong header length, broken or odd JSON, bad offsets,
unknown dtypes, bad shapes and crafted ``lowprec.tensors`` metadata, and mutates valid
quantized files byte by byte. Whatever the file, every entry point (``lowprec inspect``,
``dequantize``, ``quantize`` and :func:`load_checkpoint`) either succeeds or raises
:class:`CheckpointError` (exit status 1, one line on stderr, no traceback), and the input
file is never modified. ``FUZZ_EXAMPLES=3000 pytest tests/test_checkpoint_fuzz.py
--hypothesis-profile=explore`` searches longer (about 2 minutes on 2 cores). The quick tier
(``-m "not slow"``) runs a quarter of the default run's examples, as it runs a sample of
other sweeps.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowprec.checkpoint import CheckpointError, SafetensorsWriter, load_checkpoint, quantize_checkpoint
from lowprec.checkpoint._safetensors import DTYPES, nbytes_of
from lowprec.cli import main

FUZZ = settings(deadline=None, max_examples=int(os.environ.get("FUZZ_EXAMPLES", 150)),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


def _examples(config, default: int) -> int:
    """``FUZZ_EXAMPLES``, else ``default``, a quarter of it in the quick tier."""
    if "FUZZ_EXAMPLES" in os.environ:
        return int(os.environ["FUZZ_EXAMPLES"])
    quick = "not slow" in (config.getoption("markexpr", "") or "")
    return max(1, default // 4) if quick else default


NAMES = st.sampled_from(["w", "w_elements", "w_scales", "w_blocks", "w_scale", "v", "x.weight",
                         "x.weight_elements", "__metadata__", "", "é"])
GOOD_SHAPES = st.sampled_from([[2, 32], [64], [1, 32, 2], [], [0, 4], [32, 2]])
BAD_SHAPES = st.one_of(
    st.lists(st.integers(-3, 70), max_size=3),
    st.just([2**62, 2**62]), st.just([True, 32]), st.just([2.0, 32]), st.just("32"),
    st.just([[32]]), st.none(),
)
DTYPE_NAMES = st.one_of(st.sampled_from(sorted(DTYPES)),
                        st.sampled_from(["F128", "", "f32", "float32", 7, None]))
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def spec_entries(draw, name):
    """A ``lowprec.tensors`` entry for tensor ``name``: plausible, then perturbed."""
    fmt = draw(st.sampled_from(["mxfp4", "mxfp8_e4m3", "mxfp8_e5m2", "e4m3", "fp8_e4m3", "e5m2",
                                "bf16", "fp16", "tf32", "nf4", 3]))
    entry = {"format": fmt, "shape": draw(st.one_of(GOOD_SHAPES, BAD_SHAPES)),
             "dtype": draw(st.sampled_from(["F32", "BF16", "F16", "F64", "I64", "U8", "X"])),
             "axis": draw(st.sampled_from([0, 1, -1, 5, True, "1"])),
             "scale_rule": draw(st.sampled_from(["floor", "rceil", "round", None, 1])),
             "layout": draw(st.sampled_from(["lowprec", "gpt-oss", "hf"])),
             "fp8_scale": draw(st.sampled_from(["tensor", "none", "row", None])),
             "parts": draw(st.sampled_from([
                 {"elements": f"{name}_elements", "scales": f"{name}_scales"},
                 {"blocks": f"{name}_blocks", "scales": f"{name}_scales"},
                 {"values": name, "scale": f"{name}_scale"}, {"values": name}, {}, None]))}
    for key in draw(st.lists(st.sampled_from(sorted(entry)), max_size=2)):
        if draw(st.booleans()):
            entry.pop(key, None)
        else:
            entry[key] = draw(JSONISH)
    return entry


@st.composite
def malformed_files(draw) -> bytes:
    header, data = {}, b""
    for _ in range(draw(st.integers(0, 4))):
        name = draw(NAMES)
        dtype = draw(DTYPE_NAMES)
        shape = draw(st.one_of(GOOD_SHAPES, GOOD_SHAPES, BAD_SHAPES))
        ints = isinstance(shape, list) and all(type(d) is int for d in shape)
        size = 8
        if ints and dtype in DTYPES and 0 <= math.prod(shape) < 4096 and min(shape, default=0) >= 0:
            size = nbytes_of(dtype, shape)
        offsets = [len(data), len(data) + size]
        if draw(st.integers(0, 4)) == 0:
            offsets = draw(st.one_of(
                st.lists(st.integers(-10, 2**64), min_size=0, max_size=3), JSONISH))
        entry = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        if draw(st.integers(0, 5)) == 0:
            entry = draw(JSONISH)
        header[name] = entry
        data += draw(st.sampled_from([b"\x00", b"\x7f", b"\xff", b"\x3c"])) * max(size, 0)
    if draw(st.booleans()):
        meta = {"lowprec.tensors": json.dumps({n: draw(spec_entries(n)) for n in
                                               draw(st.lists(st.sampled_from(["w", "x.weight", "v"]),
                                                             max_size=2, unique=True))})}
        if draw(st.integers(0, 3)) == 0:
            meta = draw(st.one_of(JSONISH, st.just({"lowprec.tensors": "{not json"}),
                                  st.just({"lowprec.tensors": "[1]"})))
        header["__metadata__"] = meta
    text = json.dumps(header).encode()
    how = draw(st.integers(0, 9))
    if how == 0:  # corrupt the JSON text
        i = draw(st.integers(0, max(0, len(text) - 1)))
        text = text[:i] + draw(st.binary(min_size=1, max_size=3)) + text[i + 1:]
    elif how == 1:
        text = text[: draw(st.integers(0, len(text)))]
    length = len(text)
    if draw(st.integers(0, 6)) == 0:
        length = draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, len(text) + 16)))
    if draw(st.integers(0, 6)) == 0:  # data too short or too long
        data = data[: draw(st.integers(0, len(data)))] + draw(st.binary(max_size=8))
    return struct.pack("<Q", length) + text + data


def _valid_quantized(tmpdir: str) -> bytes:
    rng = np.random.default_rng(0)
    src, out = os.path.join(tmpdir, "src.safetensors"), os.path.join(tmpdir, "q.safetensors")
    entries = [("a.weight", "F32", (2, 64)), ("b.weight", "F32", (64, 2)), ("norm", "F32", (3,))]
    with SafetensorsWriter(src, entries) as w:
        for name, _, shape in entries:
            w.write(name, rng.standard_normal(shape).astype(np.float32))
    quantize_checkpoint(src, out, "mxfp4", include="weight")  # b.weight stays (axis len 2)
    return open(out, "rb").read()


_TEMPLATE: dict = {}


def valid_quantized_bytes() -> bytes:
    if "q" not in _TEMPLATE:
        with tempfile.TemporaryDirectory() as d:
            _TEMPLATE["q"] = _valid_quantized(d)
    return _TEMPLATE["q"]


def _split(data: bytes) -> tuple:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _join(header, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


@st.composite
def mutated_files(draw) -> bytes:
    """A valid quantized file, then bytes or header fields changed."""
    data = bytearray(valid_quantized_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    kind = draw(st.integers(0, 5))
    if kind >= 3:  # JSON-level: the file still parses, the lies are deeper
        header, body = _split(bytes(data))
        meta = header["__metadata__"]
        table = json.loads(meta["lowprec.tensors"])
        if kind == 3:  # a tensor entry's dtype / shape / offsets
            name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
            field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            header[name][field] = draw({"dtype": DTYPE_NAMES, "shape": st.one_of(GOOD_SHAPES, BAD_SHAPES),
                                        "data_offsets": st.lists(st.integers(-1, 600), max_size=3)}[field])
        elif kind == 4:  # one field of the lowprec metadata of the quantized tensor
            entry = table["a.weight"]
            key = draw(st.sampled_from(["format", "shape", "dtype", "axis", "scale_rule", "layout",
                                        "parts", "fp8_scale", "extra"]))
            entry[key] = draw(st.one_of(JSONISH, st.sampled_from(
                ["mxfp8", "e4m3", "fp8_e4m3", "bf16", "gpt-oss", [2, 32], [2, 128], [64, 2], 0, 1, "I64",
                 "F16", {"values": "a.weight"}, {"elements": "b.weight", "scales": "a.weight_scales"}])))
            meta["lowprec.tensors"] = json.dumps(table)
        else:  # a whole new entry, e.g. claiming a kept tensor is quantized
            name = draw(st.sampled_from(["a.weight", "b.weight", "norm", "ghost"]))
            table[name] = draw(spec_entries(name))
            meta["lowprec.tensors"] = json.dumps(table)
        return _join(header, body)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 3))
        if kind == 0 and len(data) > 8:  # flip a bit in the header (JSON) region
            i = draw(st.integers(8, min(8 + n, len(data)) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == 1 and data:  # anywhere, including the data (values, codes, scales)
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        elif kind == 2:
            del data[draw(st.integers(0, len(data))):]
        else:
            data += draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


def check_clean(content: bytes, capsys) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "in.safetensors")
        with open(path, "wb") as f:
            f.write(content)
        commands = [["inspect", path], ["inspect", path, "--json"],
                    ["dequantize", path, os.path.join(d, "d.safetensors")],
                    ["quantize", path, os.path.join(d, "q.safetensors"), "-f", "mxfp8",
                     "--include", "."],
                    ["quantize", path, os.path.join(d, "e.safetensors"), "-f", "e4m3",
                     "--include", "."]]
        for cmd in commands:
            status = main(cmd)  # anything but CheckpointError/OSError would propagate
            captured = capsys.readouterr()
            assert status in (0, 1), (cmd, status)
            if status == 1:
                assert captured.err.startswith(f"lowprec {cmd[0]}: error: ")
                assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
        try:
            load_checkpoint(path)
        except CheckpointError:
            pass
        with open(path, "rb") as f:
            assert f.read() == content  # the input is never modified
        leftovers = set(os.listdir(d)) - {"in.safetensors", "d.safetensors", "q.safetensors",
                                          "e.safetensors"}
        assert not leftovers  # no temp files


def _fuzz_cli(request, capsys, files, default_examples: int) -> None:
    """Runs check_clean on ``files``' examples (a quarter of them in the quick tier)."""
    @settings(FUZZ, max_examples=_examples(request.config, default_examples))
    @given(files)
    def fuzz(content):
        check_clean(content, capsys)

    fuzz()


def test_malformed_files_give_clean_errors(request, capsys):
    _fuzz_cli(request, capsys, malformed_files(), 150)


def test_mutated_quantized_files_give_clean_errors(request, capsys):
    _fuzz_cli(request, capsys, mutated_files(), 100)


def test_the_generators_reach_the_decoders(capsys):
    """Guards the fuzzing above: the template itself decodes, so mutations start from a
    file that gets past the parser into the quantized-tensor code."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "q.safetensors")
        with open(path, "wb") as f:
            f.write(valid_quantized_bytes())
        assert set(load_checkpoint(path)) == {"a.weight", "b.weight", "norm"}
        assert main(["dequantize", path, os.path.join(d, "d.safetensors"), "-q"]) == 0
