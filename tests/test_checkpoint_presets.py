"""lowprec's engine checkpoints against the tools whose layouts they are (issue 33 items 2-8).

The expected outputs are not lowprec's: tests/data/engines holds what llm-compressor 0.14.0.1
(its presets, ``oneshot`` + ``QuantizationModifier``) and NVIDIA ModelOpt 0.47.0
(``mtq.quantize`` + ``export_hf_checkpoint``) wrote for one random tiny bfloat16 Llama, and the
activation amax they observed (scripts/make_engine_fixtures.py says how). lowprec, given the
same weights and the same activation statistics, must write the same configs and the same
bytes. Tests marked ``slow`` run the real loaders (transformers, compressed-tensors:
``[interop]``) and the producers themselves where they are installed (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from helpers.checkpoints import raw_tensors
from lowprec.checkpoint import (
    CheckpointError,
    convert_checkpoint,
    dequantize_checkpoint,
    load_checkpoint,
    quantize_checkpoint,
)
from lowprec.checkpoint._engine_layouts import CT_SCALE_RULES, CT_VERSION
from lowprec.checkpoint._safetensors import SafetensorsReader, SafetensorsWriter, dtype_name
from lowprec.cli import main

DATA = Path(__file__).parent / "data" / "engines"
BASE = DATA / "base"
AMAX = DATA / "activation_amax.json"
PRESETS = ["NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8", "FP8", "FP8_DYNAMIC"]
STATIC = ("NVFP4", "FP8")
#: ModelOpt's algorithm for each scheme lowprec writes in its layout.
MODELOPT = {"NVFP4": "NVFP4", "NVFP4A16": "W4A16_NVFP4", "FP8": "FP8",
            "FP8_DYNAMIC": "FP8_PER_CHANNEL_PER_TOKEN"}
# compressed-tensors' MX scale rule for MXFP8 rounds the block maximum at E2M1's precision
# (lowprec's even_e2m1, the layout's default in CT_SCALE_RULES); with rceil there the MXFP8
# presets' scales would differ from llm-compressor's where the rules disagree.
CT_MXFP8_RULE = CT_SCALE_RULES["mxfp8"] not in ("floor", "even", "ceil", "rceil")
_MXFP8_PENDING = pytest.mark.xfail(
    not CT_MXFP8_RULE, strict=True,
    reason="compressed-tensors' MXFP8 scale rule is not yet lowprec's default for the layout")


def save(path, tensors: dict) -> None:
    """Writes ``tensors`` (NumPy / ml_dtypes arrays: BF16 and F8_E4M3 too) as they are."""
    entries = [(k, dtype_name(v.dtype), v.shape) for k, v in tensors.items()]
    with SafetensorsWriter(path, entries, force=True) as w:
        for k, v in tensors.items():
            w.write(k, v)


def _amax() -> dict:
    return json.loads(AMAX.read_text())


def _quantize(dst, scheme, layout="compressed-tensors", **kw):
    if scheme in STATIC and "calibration" not in kw:
        kw.setdefault("activation_amax", AMAX)
    return quantize_checkpoint(BASE, dst, scheme, layout=layout, progress=False, **kw)


def _tensor_differences(ours: Path, theirs: Path) -> list:
    """What differs between two safetensors files: names, dtypes, shapes, bytes."""
    a, b = SafetensorsReader(ours), SafetensorsReader(theirs)
    out = []
    with a, b:
        for name in sorted(set(a.tensors) | set(b.tensors)):
            if name not in a.tensors or name not in b.tensors:
                out.append(f"{name}: only in {'theirs' if name not in a.tensors else 'ours'}")
                continue
            ia, ib = a.tensors[name], b.tensors[name]
            if (ia.dtype, tuple(ia.shape)) != (ib.dtype, tuple(ib.shape)):
                out.append(f"{name}: {ia.dtype} {ia.shape} vs {ib.dtype} {ib.shape}")
                continue
            xa = a.read(name).reshape(-1).view(np.uint8)
            xb = b.read(name).reshape(-1).view(np.uint8)
            if not np.array_equal(xa, xb):
                out.append(f"{name}: {int(np.count_nonzero(xa != xb))} of {xa.size} bytes")
    return out


def _check_ct_config(ours: dict, theirs: dict) -> None:
    """lowprec's quantization_config is llm-compressor's, field for field, but: ``version``
    (lowprec writes compressed-tensors 0.20's layout, llm-compressor 0.14 ran 0.19),
    ``moe_sparsity_config`` (0.20's field), and ``ignore``, where lowprec names every 2-D
    weight it kept (the embeddings too: it cannot tell a Linear from an Embedding by its
    weight) and llm-compressor the user's list."""
    assert theirs["version"] == "0.19.0" and ours["version"] == CT_VERSION == "0.20.0"
    assert ours.pop("moe_sparsity_config") is None and "moe_sparsity_config" not in theirs
    assert set(theirs["ignore"]) <= set(ours["ignore"])
    assert set(ours["ignore"]) - set(theirs["ignore"]) == {"model.embed_tokens"}
    for q in (ours, theirs):
        del q["version"], q["ignore"]
    assert ours == theirs


def _ct_config(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())["quantization_config"]


# -- llm-compressor's presets --------------------------------------------------------------
@pytest.mark.parametrize("preset", [p if not p.startswith("MXFP8") else
                                    pytest.param(p, marks=_MXFP8_PENDING) for p in PRESETS])
@pytest.mark.quick_cases(preset=("NVFP4", "FP8", "FP8_DYNAMIC"))
def test_presets_match_llmcompressor(tmp_path, preset):
    """Issue 33 items 2-4: for each preset, lowprec's output for llm-compressor's weights and
    activation amax holds llm-compressor's config and every one of its tensors, byte for
    byte: FP8 scales in the model dtype (BF16) with the codes of the quotient rounded to it,
    NVFP4's global scales shared by q/k/v and gate/up, the static input scales, MX scales by
    compressed-tensors' rule."""
    out = tmp_path / preset
    _quantize(out, preset)
    theirs = DATA / "llmcompressor" / preset
    _check_ct_config(_ct_config(out), _ct_config(theirs))
    assert _tensor_differences(out / "model.safetensors", theirs / "model.safetensors") == []


@pytest.mark.slow  # two MX presets' compiles (seconds); the MX paths run in quick tests too
def test_mxfp8_differs_from_llmcompressor_only_where_the_rules_do(tmp_path):
    """lowprec writes the layout's MXFP8 with compressed-tensors' rule (even_e2m1): every scale
    and code equals llm-compressor's. Were it rceil (ceil(log2(amax / 448)), 448 = 1.75 * 2^8),
    the scales would differ exactly where a block maximum's significand is 1.75, by one,
    which compressed-tensors' floor(log2(amax rounded half up to one fraction bit)) - 8 scales
    one higher; every element of a block whose scale agrees is the same code."""
    assert CT_MXFP8_RULE or CT_SCALE_RULES["mxfp8"] == "rceil"
    _quantize(tmp_path / "q", "MXFP8A16")
    ours = raw_tensors(tmp_path / "q/model.safetensors")
    theirs = raw_tensors(DATA / "llmcompressor/MXFP8A16/model.safetensors")
    base = raw_tensors(BASE / "model.safetensors")
    agree = ties = 0
    for name in ours:
        if not name.endswith(".weight_scale"):
            continue
        w = name[: -len("_scale")]
        same = (ours[name] == theirs[name])  # [out, in / 32]
        a = ours[w].view(np.uint8).reshape(*same.shape, 32)
        b = theirs[w].view(np.uint8).reshape(*same.shape, 32)
        assert np.array_equal(a[same], b[same]), w
        amax = np.abs(base[w].astype(np.float32)).reshape(*same.shape, 32).max(-1)
        tie = np.frexp(amax)[0] == 0.875  # significand 1.75 (frexp's is in [0.5, 1))
        if CT_MXFP8_RULE:
            assert same.all(), w
        else:
            assert np.array_equal(~same, tie), w
            assert np.all(theirs[name][tie].astype(int) == ours[name][tie].astype(int) + 1), w
        agree += int(same.sum())
        ties += int(tie.sum())
    assert agree > 2000 and ties > 0  # (2296 and 8 on these weights)


@pytest.mark.slow
@pytest.mark.parametrize("algo", list(MODELOPT))
def test_modelopt_exports_match(tmp_path, algo):
    """Issue 33 item 5: ModelOpt 0.47's export of the same weights (and activation amax):
    hf_quant_config.json (producer, quantization: quant_algo, kv_cache_quant_algo,
    group_size, exclude_modules), config.json's quantization_config (config_groups, ignore,
    quant_algo, producer, quant_method) and every tensor (weight_scale_2 shared by fused
    layers, input_scale), byte for byte."""
    out = tmp_path / algo
    _quantize(out, algo, layout="modelopt")
    theirs = DATA / "modelopt" / MODELOPT[algo]
    assert json.loads((out / "hf_quant_config.json").read_text()) == json.loads(
        (theirs / "hf_quant_config.json").read_text())
    assert _ct_config(out) == _ct_config(theirs)
    assert _tensor_differences(out / "model.safetensors", theirs / "model.safetensors") == []


def test_modelopt_nvfp4_export_matches(tmp_path):
    """The quick case of test_modelopt_exports_match (NVFP4, W4A4)."""
    test_modelopt_exports_match(tmp_path, "NVFP4")


# -- activation statistics -------------------------------------------------------------------
@pytest.mark.slow  # loads the model with transformers
@pytest.mark.parametrize("preset", STATIC)
def test_calibration_gives_llmcompressors_checkpoint(tmp_path, preset):
    """The calibration step (the model run with transformers on the token file
    llm-compressor calibrated on) observes llm-compressor's activation amax, so the whole
    static checkpoint is llm-compressor's; the report keeps the amax for reuse."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / preset
    rep = _quantize(out, preset, calibration=DATA / "calibration.json")
    assert rep.options["activation_amax"] == _amax()
    theirs = DATA / "llmcompressor" / preset
    assert _tensor_differences(out / "model.safetensors", theirs / "model.safetensors") == []


@pytest.mark.slow  # loads the model with transformers
def test_text_calibration_uses_the_folders_tokenizer(tmp_path):
    """A text file is tokenized by the checkpoint's own tokenizer, one sample a line (the
    fixture's tokenizer: word ``t{i}`` is token i): the same tokens, the same amax."""
    pytest.importorskip("transformers")
    tokens = json.loads((DATA / "calibration.json").read_text())
    text = tmp_path / "calib.txt"
    text.write_text("\n\n".join(" ".join(f"t{i}" for i in t) for t in tokens) + "\n")
    rep = _quantize(tmp_path / "q", "FP8", calibration=text)
    assert rep.options["activation_amax"] == _amax()
    # the report is an amax file too
    rep2 = _quantize(tmp_path / "q2", "NVFP4", calibration=text, report=tmp_path / "r.json")
    _quantize(tmp_path / "q3", "NVFP4", activation_amax=tmp_path / "r.json")
    assert _tensor_differences(tmp_path / "q2/model.safetensors",
                               tmp_path / "q3/model.safetensors") == []
    assert rep2.options["activation_amax"] == _amax()


@pytest.mark.slow  # imports torch and transformers; one case loads the model
@pytest.mark.parametrize("name,content,message", [
    ("c.json", '{"input_ids": [1, 2]}', r"a token calibration file is a JSON list of token id"),
    ("c.json", "[[1, 2], [3, -4]]", r"a token calibration file is a JSON list"),
    ("c.json", "[[1, 2], []]", r"a token calibration file is a JSON list"),
    ("c.json", "[[1, true]]", r"a token calibration file is a JSON list"),
    ("c.json", "[[1, 2", r"cannot read it as JSON"),
    ("c.json", "[[1, 2], [3, 128]]", r"sample 1 has token id 128, beyond the vocabulary \(128 ids\)"),
    ("c.txt", "\n  \n\n", r"no text to calibrate on"),
    ("absent.json", None, r"no such calibration file"),
])
def test_calibration_files_are_checked(tmp_path, name, content, message):
    """A calibration file that is not token ids or text, or whose ids the model does not
    have, is refused naming the file and what is wrong; nothing is written."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(CheckpointError, match=message):
        _quantize(tmp_path / "q", "FP8", calibration=path)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("layout,scheme", [("compressed-tensors", "FP8"),
                                           ("compressed-tensors", "NVFP4"), ("modelopt", "FP8"),
                                           ("modelopt", "NVFP4")])
def test_static_schemes_without_statistics_are_refused(tmp_path, layout, scheme):
    """Never a placeholder input scale: the static schemes need activation statistics."""
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj \(and 13 more\): "
                                              r"a static activation scheme.*--calibration.*"
                                              r"--activation-amax.*NVFP4A16"):
        _quantize(tmp_path / "q", scheme, layout=layout, activation_amax=None)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("edit,message", [
    (lambda a: a.pop("model.layers.1.mlp.up_proj"), r"no amax for model.layers.1.mlp.up_proj"),
    (lambda a: a.update({"model.layers.0.mlp.up_proj": 0.0}),
     r"amax of model.layers.0.mlp.up_proj is 0.0; an activation amax must be positive"),
    (lambda a: a.update({"model.layers.0.mlp.up_proj": "big"}), r"is 'big', not a number"),
    (lambda a: a.update({"model.layers.0.mlp.up_proj": float("inf")}), "must be positive and finite"),
    (lambda a: a.update({"model.layers.9.mlp.up_proj": 1.0}),
     r"model.layers.9.mlp.up_proj is no Linear module of this checkpoint"),
])
def test_amax_files_are_checked(tmp_path, edit, message):
    amax = _amax()
    edit(amax)
    path = tmp_path / "amax.json"
    path.write_text(json.dumps(amax))
    with pytest.raises(CheckpointError, match=message):
        _quantize(tmp_path / "q", "FP8", activation_amax=path)
    assert not (tmp_path / "q").exists()


def test_fused_layers_share_one_input_scale(tmp_path):
    """q/k/v read one input: if the statistics give them different amax, the largest is
    used for all (vLLM keeps one scale for the fused layer, the largest of the stored ones),
    so no member's input is clipped."""
    amax = _amax()
    q, k, v = (f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    amax[q], amax[k], amax[v] = 1.0, 7.5, 2.0
    rep = _quantize(tmp_path / "q", "FP8", activation_amax=amax)
    scales = {m: raw_tensors(tmp_path / "q/model.safetensors")[m + ".input_scale"]
              for m in (q, k, v)}
    want = np.array([7.5 / 448], np.float32).astype(ml_dtypes.bfloat16)  # D(7.5 / 448)
    assert all(s.dtype == ml_dtypes.bfloat16 and s.tobytes() == want.tobytes()
               for s in scales.values())
    assert rep.options["activation_amax"][q] == 1.0  # the report keeps what was given


def test_weight_only_and_dynamic_schemes_take_no_statistics(tmp_path):
    with pytest.raises(CheckpointError, match="only the static schemes .* store; these "
                                              "schemes have none"):
        _quantize(tmp_path / "q", "FP8_DYNAMIC", activation_amax=AMAX)


# -- reading the static schemes --------------------------------------------------------------
def test_static_checkpoints_are_read_and_checked(tmp_path):
    """A static checkpoint's input scales belong to their modules: dequantize drops them with
    the config; one missing where the config says static, or stored where it says dynamic,
    makes the checkpoint refused (an engine would run with an uninitialized scale)."""
    src = DATA / "llmcompressor" / "FP8"
    plain = tmp_path / "plain"
    dequantize_checkpoint(src, plain, progress=False)
    got = raw_tensors(plain / "model.safetensors")
    assert not any("input_scale" in n or n.endswith("_scale") for n in got)
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    # a missing input scale
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = raw_tensors(src / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.input_scale"]
    save(broken / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"gives model.layers.1.mlp.down_proj static input "
                                              r"activations .* but no input scale is stored"):
        load_checkpoint(broken)
    # an input scale the config does not know of
    odd = tmp_path / "odd"
    shutil.copytree(DATA / "llmcompressor" / "FP8_DYNAMIC", odd)
    tensors = raw_tensors(odd / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.input_scale"] = np.ones(1, ml_dtypes.bfloat16)
    save(odd / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"down_proj.weight has a stored input scale, but "
                                              r".* dynamic input activation quantization"):
        load_checkpoint(odd)


def test_static_schemes_convert_between_the_engine_layouts(tmp_path):
    """FP8 W8A8: compressed-tensors' BF16 weight and input scales widen to ModelOpt's float32
    exactly (every decoded value, and every input scale, the same). NVFP4 W4A4: the global
    scales 2688 / amax (BF16 values) have no exact float32 reciprocal, so moving them to
    ModelOpt's amax / 2688 is refused, or with --requantize re-encoded and counted."""
    ct = DATA / "llmcompressor" / "FP8"
    convert_checkpoint(ct, tmp_path / "mo", "modelopt", progress=False)
    hf = json.loads((tmp_path / "mo/hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == "FP8"
    a, b = load_checkpoint(ct, dtype="float32"), load_checkpoint(tmp_path / "mo", dtype="float32")
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    ours = raw_tensors(tmp_path / "mo/model.safetensors")
    theirs = raw_tensors(ct / "model.safetensors")
    m = "model.layers.0.self_attn.o_proj"
    assert ours[m + ".input_scale"].dtype == np.float32 and ours[m + ".input_scale"].shape == ()
    assert float(ours[m + ".input_scale"]) == float(theirs[m + ".input_scale"][0])
    nv = DATA / "llmcompressor" / "NVFP4"
    with pytest.raises(CheckpointError, match="no exact reciprocal.*--requantize"):
        convert_checkpoint(nv, tmp_path / "mo4", "modelopt", progress=False)
    assert not (tmp_path / "mo4").exists()
    rep = convert_checkpoint(nv, tmp_path / "mo4", "modelopt", requantize=True, progress=False)
    before = load_checkpoint(nv, dtype="float32")
    after = load_checkpoint(tmp_path / "mo4", dtype="float32")
    for t in rep.quantized:
        diff = int(np.count_nonzero(before[t.name].view(np.uint32) !=
                                    after[t.name].view(np.uint32)))
        module = t.name[: -len(".weight")]
        gs = raw_tensors(nv / "model.safetensors")[module + ".input_global_scale"][0]
        moved = int(np.float32(1) / (np.float32(1) / gs) != gs)
        assert t.changed == diff + moved, t.name
        assert np.all(np.abs(after[t.name] - before[t.name])
                      <= 2.0 ** -22 * np.abs(before[t.name]))
    assert sum(t.changed for t in rep.quantized) > 0


def _bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def test_fp8_moves_to_compressed_tensors_in_the_model_dtype(tmp_path):
    """Issue 33 item 2 for convert: compressed-tensors stores FP8 scales in the model dtype
    (transformers' default loader creates them so), so a float32 scale moved there must be a
    bfloat16 value. llm-compressor's FP8 files through ModelOpt's layout (float32, widened
    exactly) and back are llm-compressor's bytes again; ModelOpt's own export (amax / 448 in
    float32) is refused, or with requantize re-encoded by compressed-tensors' rule against
    the rounded scale, every changed value (and input scale) counted."""
    for preset in ("FP8", "FP8_DYNAMIC"):
        (tmp_path / preset).mkdir()
        convert_checkpoint(DATA / "llmcompressor" / preset, tmp_path / preset / "mo", "modelopt",
                           progress=False)
        convert_checkpoint(tmp_path / preset / "mo", tmp_path / preset / "ct",
                           "compressed-tensors", progress=False)
        assert _tensor_differences(tmp_path / preset / "ct/model.safetensors",
                                   DATA / "llmcompressor" / preset / "model.safetensors") == []
    src = DATA / "modelopt" / "FP8"
    with pytest.raises(CheckpointError, match=r"proj.weight: its FP8 scale \S+ is no BF16 value.*"
                                              r"--requantize"):
        convert_checkpoint(src, tmp_path / "ct", "compressed-tensors", progress=False)
    assert not (tmp_path / "ct").exists()
    rep = convert_checkpoint(src, tmp_path / "ct", "compressed-tensors", requantize=True,
                             progress=False)
    theirs, ours = raw_tensors(src / "model.safetensors"), raw_tensors(tmp_path / "ct/model.safetensors")
    before = load_checkpoint(src, dtype="float32")
    after = load_checkpoint(tmp_path / "ct", dtype="float32")
    assert len(rep.quantized) == 14
    for t in rep.quantized:
        m = t.name[: -len(".weight")]
        s = np.float32(theirs[m + ".weight_scale"])
        assert ours[m + ".weight_scale"].dtype == ml_dtypes.bfloat16
        assert ours[m + ".weight_scale"].shape == (1,)
        s2 = _bf16(s)[()]
        assert np.float32(ours[m + ".weight_scale"][0]) == s2
        # compressed-tensors' FP8 rule on the decoded values: E4M3(clamp(bf16(x / s'), 448))
        x = theirs[t.name].astype(np.float32) * s
        want = np.clip(_bf16(x / s2), -448, 448).astype(ml_dtypes.float8_e4m3fn)
        assert ours[t.name].tobytes() == want.tobytes(), t.name
        i_s = np.float32(theirs[m + ".input_scale"])
        assert ours[m + ".input_scale"].dtype == ml_dtypes.bfloat16
        assert np.float32(ours[m + ".input_scale"][0]) == _bf16(i_s)
        diff = int(np.count_nonzero(before[t.name].view(np.uint32) != after[t.name].view(np.uint32)))
        assert t.changed == diff + int(_bf16(i_s) != i_s) and t.changed > 0, t.name
        assert "an FP8 scale rounded to BF16" in t.reason


@pytest.mark.parametrize("dtype,stored", [("float16", np.float16), ("float32", np.float32)])
def test_fp8_scale_dtype_follows_the_model_dtype(tmp_path, dtype, stored):
    """ModelOpt's files do not record the model dtype beside the weights; config.json does
    (``dtype``), and compressed-tensors stores FP8 scales in it: float16 for a float16 model
    (ModelOpt's float32 scales are no float16 values: refused, or re-encoded against them),
    float32 for a float32 one (moved exactly, every decoded value the same)."""
    src = tmp_path / "mo"
    shutil.copytree(DATA / "modelopt" / "FP8", src)
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = dtype
    (src / "config.json").write_text(json.dumps(config))
    if dtype == "float16":
        with pytest.raises(CheckpointError, match=r"is no F16 value"):
            convert_checkpoint(src, tmp_path / "ct", "compressed-tensors", progress=False)
    rep = convert_checkpoint(src, tmp_path / "ct", "compressed-tensors", progress=False,
                             requantize=dtype == "float16")
    theirs, ours = raw_tensors(src / "model.safetensors"), raw_tensors(tmp_path / "ct/model.safetensors")
    for t in rep.quantized:
        m = t.name[: -len(".weight")]
        s = np.float32(theirs[m + ".weight_scale"])
        assert ours[m + ".weight_scale"].dtype == stored
        assert ours[m + ".weight_scale"][0] == s.astype(stored)
        assert ours[m + ".input_scale"].dtype == stored
    if dtype == "float32":
        a = load_checkpoint(src, dtype="float32")
        b = load_checkpoint(tmp_path / "ct", dtype="float32")
        assert all(a[k].tobytes() == b[k].tobytes() for k in a)
        assert {t.changed for t in rep.quantized} == {None}


# -- the fused-layer rule ------------------------------------------------------------------
@pytest.mark.parametrize("kw,names", [
    ({"schemes": ["re:.*layers\\.0\\.self_attn\\.q_proj=FP8A16"]},
     r"model.layers.0.self_attn.k_proj \(NVFP4A16\), model.layers.0.self_attn.q_proj \(FP8A16\), "
     r"model.layers.0.self_attn.v_proj \(NVFP4A16\)"),
    ({"ignore": ["model.layers.1.mlp.up_proj"]},
     r"model.layers.1.mlp.gate_proj \(NVFP4A16\), model.layers.1.mlp.up_proj \(kept in high "
     r"precision\)"),
])
def test_fused_layers_must_share_a_scheme(tmp_path, kw, names):
    """Issue 33 item 7: vLLM loads q/k/v and gate/up as one layer and refuses different
    schemes within it: refused, naming the modules and the fix."""
    with pytest.raises(CheckpointError, match=names + r": vLLM loads these as one fused layer.*"
                                                      r"--scheme 're:.*=SCHEME'"):
        _quantize(tmp_path / "q", "NVFP4A16", **kw)
    assert not (tmp_path / "q").exists()


def test_moe_experts_fuse_w1_and_w3(tmp_path):
    """An MoE expert's w1/w3 are vLLM's w13: one scheme, one NVFP4 global scale per expert
    (the larger amax of the two), experts independent of each other."""
    rng = np.random.default_rng(2)
    src = tmp_path / "moe"
    src.mkdir()
    tensors = {}
    for e, scale in enumerate((1.0, 8.0)):
        for w, shape, s in (("w1", (32, 64), scale), ("w2", (64, 32), 1.0),
                            ("w3", (32, 64), 3 * scale)):
            tensors[f"model.layers.0.experts.{e}.{w}.weight"] = (
                rng.standard_normal(shape) * s).astype(np.float32)
    save(src / "model.safetensors", tensors)
    (src / "config.json").write_text('{"model_type": "mixtral"}')
    with pytest.raises(CheckpointError, match=r"experts.1.w1 \(FP8A16\), model.layers.0.experts"
                                              r".1.w3 \(NVFP4A16\)"):
        quantize_checkpoint(src, tmp_path / "bad", "NVFP4A16", layout="compressed-tensors",
                            schemes=["re:.*experts\\.1\\.w1=FP8A16"], progress=False)
    quantize_checkpoint(src, tmp_path / "q", "NVFP4A16", layout="compressed-tensors",
                        progress=False)
    got = raw_tensors(tmp_path / "q/model.safetensors")
    for e in range(2):
        p = f"model.layers.0.experts.{e}"
        amax = max(np.abs(tensors[f"{p}.w1.weight"]).max(), np.abs(tensors[f"{p}.w3.weight"]).max())
        # compressed-tensors' gs for a float32 model: float32(float32(1 / amax) * 2688)
        want = np.float32(np.float32(1) / np.float32(amax)) * np.float32(2688)
        assert got[f"{p}.w1.weight_global_scale"][0] == got[f"{p}.w3.weight_global_scale"][0] == want
    assert got["model.layers.0.experts.0.w1.weight_global_scale"] != \
        got["model.layers.0.experts.1.w1.weight_global_scale"]


# -- MXFP6 in the compressed-tensors layout ---------------------------------------------------
E2M3_MAGNITUDES = np.array([m / 8 for m in range(8)] +
                           [(1 + m / 8) * 2.0 ** e for e in range(3) for m in range(8)],
                           np.float64)  # OCP MX v1.0 §5.3.2: bias 1, subnormals m/8


def _decode_mxfp6_ct(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """compressed-tensors 0.20's mxfp6-pack-quantized, restated from its layout: four 6-bit
    codes per three bytes (code j in bits 6j..6j+5 of the little-endian 24-bit word), code =
    sign << 5 | E2M3 magnitude index, value × 2^(scale code − 127) per 32."""
    out, n = packed.shape
    b = packed.reshape(out, n // 3, 3).astype(np.uint32)
    word = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16
    codes = np.stack([(word >> (6 * j)) & 0x3F for j in range(4)], -1).reshape(out, -1)
    values = np.where(codes & 0x20, -1.0, 1.0) * E2M3_MAGNITUDES[codes & 0x1F]
    return values * np.exp2(np.repeat(scales.astype(np.float64) - 127, 32, axis=1))


def test_mxfp6_in_the_compressed_tensors_layout(tmp_path):
    """Issue 33 item 8: written as compressed-tensors 0.20's mxfp6-pack-quantized (with the
    MXFP6A16 preset's config), read back bit for bit, and moved to and from lowprec's layout
    unchanged."""
    rep = _quantize(tmp_path / "q", "MXFP6A16")
    assert {t.scale_rule for t in rep.quantized} == {"even"}
    g = _ct_config(tmp_path / "q")["config_groups"]["group_0"]
    assert g["format"] == "mxfp6-pack-quantized" and g["input_activations"] is None
    assert (g["weights"]["num_bits"], g["weights"]["group_size"], g["weights"]["strategy"],
            g["weights"]["scale_dtype"]) == (6, 32, "group", "torch.uint8")
    stored = raw_tensors(tmp_path / "q/model.safetensors")
    ours = load_checkpoint(tmp_path / "q", dtype="float32")
    w = "model.layers.0.mlp.down_proj.weight"
    assert stored[w + "_packed"].shape == (64, 96) and stored[w + "_scale"].shape == (64, 4)
    for name in (n for n in ours if n + "_packed" in stored):
        want = _decode_mxfp6_ct(stored[name + "_packed"], stored[name + "_scale"])
        assert np.array_equal(ours[name], want.astype(np.float32)), name
    convert_checkpoint(tmp_path / "q", tmp_path / "lp", "lowprec", progress=False)
    convert_checkpoint(tmp_path / "lp", tmp_path / "back", "compressed-tensors", progress=False)
    assert _tensor_differences(tmp_path / "q/model.safetensors",
                               tmp_path / "back/model.safetensors") == []


@pytest.mark.slow  # imports torch
def test_mxfp6_is_compressed_tensors_bit_for_bit(tmp_path):
    """compressed-tensors 0.20 itself: its MXFP6A16 scales (calculate_qparams on each group's
    min and max) and its mxfp6 compressor give lowprec's bytes, and its decompressor
    lowprec's values."""
    torch = pytest.importorskip("torch")
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file

    if not hasattr(ct.quantization.quant_scheme, "MXFP6A16"):
        pytest.skip("compressed-tensors without MXFP6 (< 0.20)")
    _quantize(tmp_path / "q", "MXFP6A16")
    scheme: QuantizationScheme = preset_name_to_scheme("MXFP6A16", ["Linear"])
    compressor = BaseCompressor.get_value_from_registry("mxfp6-pack-quantized")
    base = load_file(BASE / "model.safetensors")
    ours = load_file(tmp_path / "q/model.safetensors")
    mine = load_checkpoint(tmp_path / "q", dtype="float32")
    done = 0
    for name, weight in base.items():
        if name + "_packed" not in ours:
            continue
        groups = weight.unflatten(-1, (-1, 32))
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        theirs = compressor.compress({"weight": weight, "weight_scale": scale}, scheme)
        assert torch.equal(theirs["weight_packed"], ours[name + "_packed"]), name
        assert torch.equal(theirs["weight_scale"], ours[name + "_scale"]), name
        back = compressor.decompress({"weight_packed": ours[name + "_packed"],
                                      "weight_scale": ours[name + "_scale"]}, scheme)["weight"]
        want = torch.from_numpy(mine[name]).to(back.dtype)
        assert torch.equal(back.view(torch.int16), want.view(torch.int16)), name
        done += 1
    assert done == 14


# -- every loader decodes the same bits (item 2) ----------------------------------------------
MIXED = {"schemes": ["re:.*self_attn\\.(q|k|v)_proj=FP8", "re:.*self_attn\\.o_proj=FP8A16",
                     "re:.*mlp\\.(gate|up)_proj=FP8_DYNAMIC"]}


def _loaded_weights(model) -> dict:
    """Each Linear's weight as the model holds it (after compressed-tensors' decompression)."""
    import torch

    return {f"{n}.weight": m.weight.detach() for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}


@pytest.mark.slow  # torch, transformers, compressed-tensors
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("case", ["FP8", "FP8_DYNAMIC", "FP8A16", "FP8A16_CHANNEL", "NVFP4",
                                  "mixed", "from-ModelOpt"])
def test_every_loader_decodes_lowprecs_bits(tmp_path, case):
    """Issue 33 item 2: FP8 scales are stored in the model dtype (BF16), so transformers'
    default from_pretrained (compressed-tensors decompressing on the first forward, scales
    kept as stored), its dequantize=True path and compressed-tensors' decompressors all
    compute e × s of the stored BF16 s — lowprec's decoded value, bit for bit — on files of
    one scheme, on a mixed one (FP8 W8A8 attention, FP8_DYNAMIC gate/up, NVFP4 down) and on
    ModelOpt's FP8 export converted to compressed-tensors."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils import match_targets
    from safetensors.torch import load_file

    out = tmp_path / case
    if case == "mixed":
        _quantize(out, "NVFP4", activation_amax=AMAX, **MIXED)
    elif case == "from-ModelOpt":  # ModelOpt's FP8 export moved over (scales rounded to BF16)
        convert_checkpoint(DATA / "modelopt" / "FP8", out, "compressed-tensors",
                           requantize=True, progress=False)
    else:
        _quantize(out, case)
    ours = load_checkpoint(out, dtype="float32")
    quantized = sorted(n for n in ours if n.endswith("proj.weight"))
    want = {n: torch.from_numpy(ours[n]).to(torch.bfloat16) for n in quantized}
    qc = QuantizationConfig.model_validate(_ct_config(out))
    stored = load_file(out / "model.safetensors")
    targets = {t: g for g in qc.config_groups.values() for t in g.targets}
    for name in quantized:  # compressed-tensors' own decompressors, found by its matching
        module = name[: -len(".weight")]
        group = targets[match_targets(module, torch.nn.Linear(1, 1), list(targets))[0]]
        local = {k[len(module) + 1:]: v for k, v in stored.items()
                 if k.startswith(module + ".weight")}
        got = BaseCompressor.get_value_from_registry(group.format).decompress(local, group)
        assert torch.equal(got["weight"].to(torch.bfloat16).view(torch.int16),
                           want[name].view(torch.int16)), name
    model = transformers.AutoModelForCausalLM.from_pretrained(out)  # the default path
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits  # decompresses
    assert bool(torch.isfinite(logits).all())
    loaded = _loaded_weights(model)
    for name in quantized:
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name].view(torch.int16), want[name].view(torch.int16)), name
    if case != "mixed":  # (transformers 5.24's dequantize=True takes one group per model)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            out, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
        loaded = _loaded_weights(model)
        for name in quantized:
            assert torch.equal(loaded[name].view(torch.int16), want[name].view(torch.int16))


# -- the command line ----------------------------------------------------------------------------
def test_cli_presets_statistics_and_requantize(tmp_path, capsys):
    base, ct, mo = str(BASE), str(tmp_path / "ct"), str(tmp_path / "mo")
    assert main(["quantize", base, ct, "--layout", "compressed-tensors", "--scheme", "fp8",
                 "--activation-amax", str(AMAX), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["options"]["activation_amax"] == _amax()
    reasons = {t["reason"] for t in report["tensors"] if t["format"] != "kept"}
    assert reasons == {"compressed-tensors FP8 (static activations)"}
    assert _tensor_differences(tmp_path / "ct/model.safetensors",
                               DATA / "llmcompressor/FP8/model.safetensors") == []
    assert main(["quantize", base, mo, "--layout", "modelopt", "-f", "NVFP4A16", "-q",
                 "--scheme", "FP8"]) == 1
    assert "--format and --scheme FP8: give the scheme of every module once" in \
        capsys.readouterr().err
    assert main(["quantize", base, mo, "--layout", "compressed-tensors", "--scheme", "W4A16",
                 "-q"]) == 1
    err = capsys.readouterr().err
    assert "unknown" in err and "NVFP4A16" in err
    nv = str(DATA / "llmcompressor" / "NVFP4")
    assert main(["convert", nv, mo, "--layout", "modelopt", "-q"]) == 1
    assert "--requantize" in capsys.readouterr().err and not os.path.exists(mo)
    assert main(["convert", nv, mo, "--layout", "modelopt", "--requantize", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert all(t["changed"] is not None for t in report["tensors"] if t["format"] != "kept")
    assert any("requantized" in t["reason"] for t in report["tensors"])


# -- the producers themselves, where installed -------------------------------------------------
LLMC = os.environ.get("LOWPREC_LLMCOMPRESSOR_PYTHON", "/work/venvs/llmc/bin/python")


@pytest.mark.slow  # llm-compressor in its own environment: about 20 s here
@pytest.mark.skipif(not os.path.exists(LLMC), reason="no llm-compressor environment (set "
                    "LOWPREC_LLMCOMPRESSOR_PYTHON to its python)")
def test_llmcompressor_live(tmp_path):
    """Regenerates the fixtures with llm-compressor and compares: the same bytes (so the
    committed fixtures are what llm-compressor writes today), hence the same as lowprec's."""
    script = Path(__file__).parents[1] / "scripts" / "make_engine_fixtures.py"
    subprocess.run([LLMC, str(script), "llmcompressor", str(tmp_path)], check=True,
                   capture_output=True, timeout=1800)
    assert json.loads((tmp_path / "activation_amax.json").read_text()) == _amax()
    for preset in PRESETS:
        for f in ("config.json", "model.safetensors"):
            a, b = tmp_path / "llmcompressor" / preset / f, DATA / "llmcompressor" / preset / f
            if f == "config.json":
                assert _ct_config(a.parent) == _ct_config(b.parent), preset
            else:
                assert _tensor_differences(a, b) == [], preset


@pytest.mark.slow  # ModelOpt: tens of seconds
def test_modelopt_live(tmp_path):
    """Regenerates the ModelOpt fixtures with ModelOpt itself and compares byte for byte."""
    pytest.importorskip("modelopt.torch.quantization")
    shutil.copytree(BASE, tmp_path / "base")
    shutil.copy(DATA / "calibration.json", tmp_path)
    script = Path(__file__).parents[1] / "scripts" / "make_engine_fixtures.py"
    subprocess.run([sys.executable, str(script), "modelopt", str(tmp_path)], check=True,
                   capture_output=True, timeout=1800)
    for algo in MODELOPT.values():
        a, b = tmp_path / "modelopt" / algo, DATA / "modelopt" / algo
        assert _tensor_differences(a / "model.safetensors", b / "model.safetensors") == []
        assert json.loads((a / "hf_quant_config.json").read_text()) == json.loads(
            (b / "hf_quant_config.json").read_text())
