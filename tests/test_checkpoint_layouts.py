"""A checkpoint layout is one module: the Layout registry, and a toy layout defined here
running through quantize, dequantize, inspect and convert, via the Python API and the CLI.

The toy stores an E8M0-scaled FP4/FP8 block tensor as ``<name>.codes`` U8 [..., K] (one
element code per byte, not packed) and ``<name>.exps`` I16 [..., K/B] (the scale exponent,
E8M0 code − 127). Expected values come from lowprec's own layout written by its own
streaming pipeline (another path: pieces, ``quantize_chunk``), from the NumPy reference
(``reference.mx``), and from the derivation of the toy's encoding written below.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import lowprec_reference as ref
import numpy as np
import pytest

from lowprec import MXArray, pack_fp4, unpack_fp4
from lowprec._format import MXFormat
from lowprec.checkpoint import (
    CheckpointError,
    Layout,
    SafetensorsReader,
    SafetensorsWriter,
    convert_checkpoint,
    dequantize_checkpoint,
    get_layout,
    inspect_checkpoint,
    layout_names,
    load_checkpoint,
    quantize_checkpoint,
    register,
)
from lowprec.checkpoint._engine_layouts import EngineSpec, modelopt_nvfp4
from lowprec.checkpoint._engine_schemes import engine_scheme
from lowprec.checkpoint._layout_codes import CodesLayout
from lowprec.checkpoint._layout_ct import EngineLayout
from lowprec.checkpoint._layouts import unregister
from lowprec.cli import main


# -- the toy layout: everything a new layout has to say ------------------------------
@dataclasses.dataclass(frozen=True)
class ToyLayout(CodesLayout):
    def holds(self, fmt) -> bool:
        return (isinstance(fmt, MXFormat) and fmt.scheme.name == "e8m0"
                and fmt.element.code_bits in (4, 8))

    def holdable(self) -> str:
        return "E8M0-scaled FP4/FP8 block formats"

    def parts(self, name, fmt, shape):
        return [("codes", f"{name}.codes", "U8", shape),
                ("exps", f"{name}.exps", "I16", shape[:-1] + (shape[-1] // fmt.block_size,))]

    def pack(self, mx):
        codes = np.asarray(mx.elements)
        if mx.fmt.element.code_bits == 4:
            codes = np.asarray(unpack_fp4(mx.elements))
        return {"codes": codes, "exps": np.asarray(mx.scales).astype(np.int16) - 127}

    def unpack(self, arrays, fmt, shape):
        codes, exps = arrays["codes"], arrays["exps"].astype(np.int32) + 127
        if codes.max(initial=0) >= 1 << fmt.element.code_bits:
            raise ValueError(f"element code {int(codes.max())} does not fit "
                             f"{fmt.element.code_bits} bits")
        if exps.min(initial=0) < 0 or exps.max(initial=0) > 255:
            raise ValueError("a scale exponent is outside E8M0's -127..128")
        elements = pack_fp4(jnp.asarray(codes)) if fmt.element.code_bits == 4 else codes
        return MXArray(jnp.asarray(elements), jnp.asarray(exps.astype(np.uint8)), fmt,
                       len(shape) - 1, tuple(shape))


TOY = ToyLayout("toy", "one element code per byte + int16 scale exponents")
FORMATS = ["mxfp4", "mxfp8_e4m3"]


# -- a toy engine layout: an inference engine's NVFP4 under names of its own --------------
@dataclasses.dataclass(frozen=True)
class ToyEngineLayout(EngineLayout):
    """NVFP4 weight-only as ``M.weight.codes`` U8 [out, K/2], ``M.weight.bscale`` F8_E4M3
    [out, K/16], ``M.weight.tscale`` F32 [] (the tensor scale as is), written with
    ModelOpt's arithmetic; no config files (a single safetensors file)."""

    one_scheme = True

    def schemes(self):
        return [engine_scheme("NVFP4A16")]

    def recognize_weights(self, reader):
        t, found = reader.tensors, {}
        for name, info in t.items():
            if name.endswith(".weight.codes") and info.dtype == "U8" and len(info.shape) == 2:
                w = name[: -len(".codes")]
                if f"{w}.bscale" in t and f"{w}.tscale" in t:
                    found[w] = EngineSpec("nvfp4", self.name, (info.shape[0], 2 * info.shape[1]))
        return found

    def weight_parts(self, spec, name, out, k):
        return [("elements", f"{name}.codes", "U8", (out, k // 2)),
                ("scales", f"{name}.bscale", "F8_E4M3", (out, k // 16)),
                ("scale", f"{name}.tscale", "F32", ())]

    def input_scale_part(self, spec, module):
        return ("input_scale", f"{module}.input_scale", "F32", ())

    def encode_nvfp4(self, x32, dtype, amax):
        return modelopt_nvfp4(x32, dtype, amax)

    def config(self, source, outputs, groups, kept):
        return None, {}


TOY_ENGINE = ToyEngineLayout("toy-engine", "NVFP4 as .codes / .bscale / .tscale")


@pytest.fixture
def toy():
    register(TOY)
    yield TOY
    unregister(TOY.name)


@pytest.fixture
def toy_engine():
    register(TOY_ENGINE)
    yield TOY_ENGINE
    unregister(TOY_ENGINE.name)


@pytest.fixture
def model(tmp_path):
    """A float32 checkpoint: a Linear weight, a 3-D [batch, seq, d] tensor, a kept bias."""
    rng = np.random.default_rng(0)
    t = {"fc.weight": rng.normal(size=(8, 64)).astype(np.float32),
         "acts.weight": (rng.normal(size=(2, 3, 64)) * 4).astype(np.float32),
         "fc.bias": rng.normal(size=(8,)).astype(np.float32)}
    path = tmp_path / "m.safetensors"
    with SafetensorsWriter(path, [(n, "F32", v.shape) for n, v in t.items()]) as f:
        for n, v in t.items():
            f.write(n, v)
    return path, t


def _stored(path) -> dict:
    with SafetensorsReader(path) as r:
        return {n: (i.dtype, tuple(i.shape), r.read(n)) for n, i in r.tensors.items()}


def _reference(x: np.ndarray, fmt: str) -> tuple:
    """The NumPy reference's MX codes of ``x`` (unpacked, blocks along the last axis), scale
    codes and values."""
    codes, scales = ref.quantize_mx(x, fmt, axis=-1)
    return codes, scales, ref.dequantize_mx(codes, scales, fmt, axis=-1)


# -- the registry -------------------------------------------------------------------
def test_registry_holds_every_layout_and_refuses_unknown_names():
    assert layout_names()[:5] == ("lowprec", "gpt-oss", "compressed-tensors", "modelopt", "gguf")
    lay = get_layout("gpt-oss")
    assert isinstance(lay, Layout) and hash(lay) == hash(get_layout("gpt-oss"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.name = "x"
    with pytest.raises(CheckpointError, match=r"unknown layout 'gpt_oss'; choose one of: "
                                              r"lowprec, gpt-oss.*did you mean 'gpt-oss'"):
        get_layout("gpt_oss")
    with pytest.raises(ValueError, match="already registered"):
        register(dataclasses.replace(TOY, name="lowprec"))
    with pytest.raises(TypeError, match="takes a Layout"):
        register("toy")


def test_registered_toy_is_listed_and_refuses_what_it_cannot_hold(toy, model, tmp_path):
    path, _ = model
    assert "toy" in layout_names() and "toy" in layout_names(writes="convert")
    with pytest.raises(CheckpointError, match="unknown layout 'bogus'; choose one of: .*toy"):
        quantize_checkpoint(path, tmp_path / "q.safetensors", "mxfp4", layout="bogus")
    for fmt in ("nvfp4", "mxfp6_e2m3", "e4m3"):
        with pytest.raises(CheckpointError, match=f"the toy layout holds E8M0-scaled FP4/FP8 "
                                                  f"block formats, not {fmt}"):
            quantize_checkpoint(path, tmp_path / "q.safetensors", fmt, layout="toy")
    with pytest.raises(CheckpointError, match="fp8_scale, ignore: not options of the toy"):
        quantize_checkpoint(path, tmp_path / "q.safetensors", "mxfp4", layout="toy",
                            ignore=["x"], fp8_scale="none")
    assert not (tmp_path / "q.safetensors").exists()


# -- the toy through every verb -----------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("via", ["api", "cli"])
def test_toy_layout_quantize_dequantize_inspect_convert(toy, model, tmp_path, fmt, via):
    path, t = model
    q, lp = tmp_path / "toy.safetensors", tmp_path / "lowprec.safetensors"
    deq, back, moved = (tmp_path / f"{n}.safetensors" for n in ("deq", "back", "moved"))
    if via == "api":
        rep = quantize_checkpoint(path, q, fmt, layout="toy")
        assert [(r.name, r.format) for r in rep.tensors] == [
            ("fc.weight", fmt), ("acts.weight", fmt), ("fc.bias", "kept")]
        dequantize_checkpoint(q, deq)
        listing = inspect_checkpoint(q)
        convert_checkpoint(q, back, "lowprec")
    else:
        assert main(["quantize", str(path), str(q), "-f", fmt, "--layout", "toy", "-q"]) == 0
        assert main(["dequantize", str(q), str(deq), "-q"]) == 0
        listing = inspect_checkpoint(q)
        assert main(["convert", str(q), str(back), "--layout", "lowprec", "-q"]) == 0
    quantize_checkpoint(path, lp, fmt)  # lowprec's own layout, its own piece pipeline

    # stored parts: the toy's names, dtypes and shapes, holding the reference's codes
    stored, ours = _stored(q), _stored(lp)
    assert stored["fc.weight.codes"][:2] == ("U8", (8, 64))
    assert stored["acts.weight.exps"][:2] == ("I16", (2, 3, 64 // 32))
    assert np.array_equal(stored["fc.bias"][2], t["fc.bias"])
    got = load_checkpoint(deq)
    for name in ("fc.weight", "acts.weight"):
        codes, scales, values = _reference(t[name], fmt)
        assert np.array_equal(stored[f"{name}.codes"][2], codes)
        assert np.array_equal(stored[f"{name}.exps"][2], scales.astype(np.int16) - 127)
        # dequantize and load: the reference's values, bit for bit
        np.testing.assert_array_equal(got[name], values.astype(np.float32))
        np.testing.assert_array_equal(load_checkpoint(q)[name], values.astype(np.float32))

    # inspect: the layout is named, each tensor with its stored parts
    assert listing.options["layouts"] == {"toy": []}
    assert "layout: toy" in listing.table()
    w = next(r for r in listing.tensors if r.name == "fc.weight")
    assert w.format == f"{fmt} (toy)" and w.stored_as == ("fc.weight.codes", "fc.weight.exps")

    # convert: toy -> lowprec gives lowprec's own file's tensors byte for byte, and back
    back_stored = _stored(back)
    assert back_stored.keys() == ours.keys()
    for n in ours:
        assert back_stored[n][:2] == ours[n][:2] and np.array_equal(back_stored[n][2], ours[n][2])
    convert_checkpoint(lp, moved, "toy")
    moved_stored = _stored(moved)
    assert moved_stored.keys() == stored.keys()
    for n in stored:
        assert np.array_equal(moved_stored[n][2], stored[n][2])
    with SafetensorsReader(moved) as r:
        assert "lowprec.tensors" not in r.metadata and "toy.tensors" in r.metadata


def test_toy_reader_trusts_nothing(toy, model, tmp_path):
    """A damaged toy file is refused, naming the tensor: a code beyond FP4, a part with the
    wrong dtype, a table entry that does not parse."""
    path, _ = model
    q = tmp_path / "toy.safetensors"
    quantize_checkpoint(path, q, "mxfp4", layout="toy")
    with SafetensorsReader(q) as r:
        meta = dict(r.metadata)
        parts = {n: (i.dtype, i.shape, r.read(n)) for n, i in r.tensors.items()}

    def write(dst, parts, meta):
        with SafetensorsWriter(dst, [(n, dt, s) for n, (dt, s, _) in parts.items()], meta) as f:
            for n, (_, _, v) in parts.items():
                f.write(n, v)

    bad = dict(parts)
    codes = bad["fc.weight.codes"][2].copy()
    codes[0, 0] = 0x1F
    bad["fc.weight.codes"] = ("U8", codes.shape, codes)
    write(tmp_path / "code.safetensors", bad, meta)
    with pytest.raises(CheckpointError, match=r"cannot decode mxfp4 \(toy\).*code 31 does not "
                                              r"fit 4 bits"):
        load_checkpoint(tmp_path / "code.safetensors")

    bad = dict(parts)
    exps = bad["fc.weight.exps"][2].astype(np.int32)
    bad["fc.weight.exps"] = ("I32", exps.shape, exps)
    write(tmp_path / "dtype.safetensors", bad, meta)
    with pytest.raises(CheckpointError, match=r"'fc.weight.exps' is I32 \[8, 2\]; mxfp4 of "
                                              r"shape \[8, 64\] needs I16"):
        load_checkpoint(tmp_path / "dtype.safetensors")

    table = json.loads(meta["toy.tensors"])
    table["fc.weight"]["shape"] = [8, 60]
    write(tmp_path / "shape.safetensors", parts, {**meta, "toy.tensors": json.dumps(table)})
    with pytest.raises(CheckpointError, match="tensor 'fc.weight': last axis 60 is not a "
                                              "multiple of the block size 32"):
        inspect_checkpoint(tmp_path / "shape.safetensors")


@pytest.mark.parametrize("layout,scheme", [("lowprec", "mxfp4"),
                                           ("compressed-tensors", "MXFP8A16"),
                                           ("modelopt", "NVFP4A16")])
def test_inspect_names_the_layout_and_preset(model, tmp_path, capsys, layout, scheme):
    """inspect says which layout a checkpoint is in and, for the engines' layouts, the preset
    (llm-compressor scheme) it was written with: the one given to quantize."""
    path, _ = model
    q = tmp_path / "q.safetensors"
    quantize_checkpoint(path, q, scheme, layout=layout)
    presets = [] if layout == "lowprec" else [scheme]
    assert inspect_checkpoint(q).options["layouts"] == {layout: presets}
    assert main(["inspect", str(q)]) == 0
    line = f"layout: {layout}" + (f" (preset {scheme})" if presets else "")
    assert line in capsys.readouterr().out.splitlines()


# -- a new layout is one module ---------------------------------------------------------
@pytest.mark.parametrize("toy_class, base", [(ToyLayout, CodesLayout),
                                             (ToyEngineLayout, EngineLayout)])
def test_a_new_layout_implements_only_what_its_base_declares(toy_class, base):
    """Each toy defines no method or attribute its base class does not declare: what a
    layout says is the Layout protocol (docs/design.md §16), and the package asks nothing
    else of it (the verbs below run with the toys registered and no other edit)."""
    own = {k for k in vars(toy_class) if not k.startswith("__")}
    declared = {k for k in dir(base) if not k.startswith("__")}
    assert own and own <= declared, own - declared


def test_toy_engine_layout_quantize_dequantize_inspect_convert(toy_engine, tmp_path, capsys):
    """An engine layout in one class: quantize writes ModelOpt's NVFP4 bytes under the
    toy's names, every reader decodes them as ModelOpt's, inspect names layout and preset,
    and convert moves the bits to lowprec's layout and back, byte for byte."""
    rng = np.random.default_rng(3)
    t = {"model.layers.0.mlp.up_proj.weight": rng.normal(size=(32, 64)).astype(np.float32),
         "model.layers.0.mlp.down_proj.weight": (rng.normal(size=(64, 32)) * 3).astype(
             np.float32),
         "model.norm.weight": np.ones(64, np.float32)}
    src = tmp_path / "m.safetensors"
    with SafetensorsWriter(src, [(n, "F32", v.shape) for n, v in t.items()]) as f:
        for n, v in t.items():
            f.write(n, v)
    q, mo = tmp_path / "toy.safetensors", tmp_path / "mo.safetensors"
    assert main(["quantize", str(src), str(q), "-f", "NVFP4A16", "--layout", "toy-engine",
                 "-q"]) == 0
    quantize_checkpoint(src, mo, "NVFP4A16", layout="modelopt")  # ModelOpt's own names
    stored, theirs = _stored(q), _stored(mo)
    for w in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        for ours, other in ((".codes", ""), (".bscale", "_scale"), (".tscale", "_scale_2")):
            assert stored[w + ours][:2] == theirs[w + other][:2]
            assert stored[w + ours][2].tobytes() == theirs[w + other][2].tobytes()
    np.testing.assert_array_equal(stored["model.norm.weight"][2], t["model.norm.weight"])

    # every reader: the same values as ModelOpt's layout, bit for bit
    want = load_checkpoint(mo)
    dequantize_checkpoint(q, tmp_path / "deq.safetensors")
    for got in (load_checkpoint(q), load_checkpoint(tmp_path / "deq.safetensors")):
        for n in want:
            assert got[n].tobytes() == want[n].tobytes(), n
    assert inspect_checkpoint(q).options["layouts"] == {"toy-engine": ["NVFP4A16"]}

    # convert: to lowprec's layout as ModelOpt's file converts, and back to the toy's bytes
    lp, lp_mo, back = (tmp_path / f"{n}.safetensors" for n in ("lp", "lp_mo", "back"))
    convert_checkpoint(q, lp, "lowprec")
    convert_checkpoint(mo, lp_mo, "lowprec")
    a, b = _stored(lp), _stored(lp_mo)
    assert a.keys() == b.keys() and all(a[n][2].tobytes() == b[n][2].tobytes() for n in a)
    assert main(["convert", str(lp), str(back), "--layout", "toy-engine", "-q"]) == 0
    c = _stored(back)
    assert c.keys() == stored.keys()
    assert all(c[n][:2] == stored[n][:2] and c[n][2].tobytes() == stored[n][2].tobytes()
               for n in c)
    capsys.readouterr()
