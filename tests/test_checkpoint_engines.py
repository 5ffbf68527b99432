"""Checkpoints in the layouts inference engines load (compressed-tensors, ModelOpt).

The loader tests use the real clients: a tiny random Llama built from a transformers config
is saved with safetensors, quantized by lowprec, then loaded by transformers (which runs
compressed-tensors' decompressors on CPU); its weights must equal lowprec's decoded weights
bit for bit (both rounded to the model dtype, bfloat16, as the loader does) and the forward
pass must run. They skip when torch / compressed-tensors / transformers are absent
(``pip install 'lowprec[interop]'``). The conversion tests need only lowprec.
"""

import filecmp
import json
import os
import shutil

import numpy as np
import pytest

from helpers.checkpoints import save as save_tensors
from lowprec.checkpoint import (
    CheckpointError,
    convert_checkpoint,
    dequantize_checkpoint,
    inspect_checkpoint,
    load_checkpoint,
    quantize_checkpoint,
)
from lowprec.checkpoint._engine_layouts import engine_specs
from lowprec.checkpoint._layout import make_spec
from lowprec.checkpoint._logical import METADATA_KEY, METADATA_VERSION, METADATA_VERSION_KEY
from lowprec.checkpoint._safetensors import SafetensorsReader, SafetensorsWriter

# The weight-only schemes, one per weight format (the presets' own tests, activations included,
# are in test_checkpoint_presets.py); WEIGHTS: each one's weight format.
SCHEMES = ["NVFP4A16", "MXFP4A16", "MXFP6A16", "MXFP8A16", "FP8A16", "FP8A16_CHANNEL"]
WEIGHTS = dict(zip(SCHEMES, ["nvfp4", "mxfp4", "mxfp6", "mxfp8", "fp8", "fp8_channel"]))


def _tiny_folder(path, rng=np.random.default_rng(0)):
    """A Llama-shaped folder without torch: q/k/v/o and MLP weights, norms, embeddings, head."""
    os.makedirs(path)
    names = {"model.embed_tokens.weight": (128, 64), "lm_head.weight": (128, 64),
             "model.norm.weight": (64,)}
    for i in range(2):
        for proj, shp in [("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (32, 64)),
                          ("mlp.up_proj", (128, 64)), ("mlp.down_proj", (64, 128))]:
            names[f"model.layers.{i}.{proj}.weight"] = shp
    tensors = {n: (rng.standard_normal(s) * 0.05).astype(np.float32) for n, s in names.items()}
    with SafetensorsWriter(f"{path}/model.safetensors",
                           [(n, "F32", t.shape) for n, t in tensors.items()]) as f:
        for n, t in tensors.items():
            f.write(n, t)
    with open(f"{path}/config.json", "w") as f:
        json.dump({"model_type": "llama"}, f)
    return tensors


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_engine_layout_names_and_config(tmp_path, scheme):
    src = tmp_path / "m"
    x = _tiny_folder(src)
    quantize_checkpoint(src, tmp_path / "q", scheme, layout="compressed-tensors")
    with SafetensorsReader(tmp_path / "q/model.safetensors") as r:
        names = set(r.tensors)
        specs = engine_specs(r)
        dtypes = {n: i.dtype for n, i in r.tensors.items()}
    w = "model.layers.0.mlp.up_proj.weight"
    expected = {  # compressed-tensors 0.20's compressors: names and dtypes (an F32 model)
        "nvfp4": {w + "_packed": "U8", w + "_scale": "F8_E4M3", w + "_global_scale": "F32"},
        "mxfp4": {w + "_packed": "U8", w + "_scale": "U8"},
        "mxfp6": {w + "_packed": "U8", w + "_scale": "U8"},
        "mxfp8": {w: "F8_E4M3", w + "_scale": "U8"},
        "fp8": {w: "F8_E4M3", w + "_scale": "F32"},
        "fp8_channel": {w: "F8_E4M3", w + "_scale": "F32"},
    }[WEIGHTS[scheme]]
    assert {n: dtypes[n] for n in expected} == expected
    assert specs[w].scheme == WEIGHTS[scheme] and specs[w].shape == (128, 64)
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names  # kept
    for kept in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert dtypes[kept] == "F32" and not any(n.startswith(kept + "_") for n in names)
    qc = json.load(open(tmp_path / "q/config.json"))["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert "lm_head" in qc["ignore"] and qc["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert "model.embed_tokens" in qc["ignore"]  # a 2-D weight the loader must not look for
    got = load_checkpoint(tmp_path / "q", dtype="float32")[w]
    err = np.abs(got - x[w]).max() / np.abs(x[w]).max()
    assert err < {"nvfp4": 0.2, "mxfp4": 0.3, "mxfp6": 0.1, "mxfp8": 0.1, "fp8": 0.07,
                  "fp8_channel": 0.07}[WEIGHTS[scheme]]
    assert qc["config_groups"]["group_0"]["input_activations"] is None  # weight-only


def test_mixed_schemes_and_ignore(tmp_path):
    src = tmp_path / "m"
    _tiny_folder(src)
    rep = quantize_checkpoint(src, tmp_path / "q", "NVFP4A16", layout="compressed-tensors",
                              schemes=["re:.*self_attn.*=FP8A16"],
                              ignore=["re:.*layers\\.1\\.mlp\\.down_proj"])
    qc = json.load(open(tmp_path / "q/config.json"))["quantization_config"]
    assert qc["format"] == "mixed-precision"
    by_format = {g["format"]: g["targets"] for g in qc["config_groups"].values()}
    assert by_format["float-quantized"] == sorted(
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("k_proj", "q_proj"))
    assert "model.layers.1.mlp.down_proj" in qc["ignore"]
    assert "model.layers.1.mlp.down_proj" not in by_format["nvfp4-pack-quantized"]
    # The fields compressed-tensors 0.20's ModelCompressor.update_config writes beside the
    # groups (run on this config: test_config_has_the_fields_compressed_tensors_writes).
    assert (qc["version"], qc["sparsity_config"], qc["transform_config"]) == ("0.20.0", {}, {})
    kinds = {t.name: t.format for t in rep.tensors}
    assert kinds["model.layers.1.mlp.down_proj.weight"] == "kept"
    assert kinds["model.layers.0.self_attn.q_proj.weight"].startswith("e4m3")


@pytest.mark.parametrize("fmt,scheme", [("mxfp4", "MXFP4A16"), ("mxfp8_e4m3", "MXFP8A16"),
                                        ("mxfp6_e2m3", "MXFP6A16"), ("e4m3", "FP8A16")])
@pytest.mark.quick_first(1)
def test_convert_round_trips_byte_identical(tmp_path, fmt, scheme):
    src = tmp_path / "m"
    _tiny_folder(src)
    quantize_checkpoint(src, tmp_path / "lp", fmt)
    convert_checkpoint(tmp_path / "lp", tmp_path / "ct", "compressed-tensors")
    convert_checkpoint(tmp_path / "ct", tmp_path / "lp2", "lowprec")
    assert filecmp.cmp(tmp_path / "lp/model.safetensors", tmp_path / "lp2/model.safetensors",
                       shallow=False)
    a, b = load_checkpoint(tmp_path / "lp"), load_checkpoint(tmp_path / "ct")
    assert a.keys() == b.keys()
    assert all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)
    # and the other way: written as compressed-tensors, through lowprec, back
    quantize_checkpoint(src, tmp_path / "c1", scheme, layout="compressed-tensors")
    convert_checkpoint(tmp_path / "c1", tmp_path / "l1", "lowprec")
    convert_checkpoint(tmp_path / "l1", tmp_path / "c2", "compressed-tensors")
    for f in ("model.safetensors", "config.json"):
        assert filecmp.cmp(tmp_path / "c1" / f, tmp_path / "c2" / f, shallow=False)


def test_nvfp4_modelopt_and_compressed_tensors(tmp_path):
    src = tmp_path / "m"
    _tiny_folder(src)
    # lowprec's tensor scale amax/2688 is ModelOpt's weight_scale_2: moved as is; lowprec's
    # layout holds weights only, so ModelOpt's weight-only algorithm. (Not q/k: each has its
    # own tensor scale in lowprec's layout, but vLLM one per fused layer; refused below.)
    quantize_checkpoint(src, tmp_path / "lp", "nvfp4", exclude="self_attn")
    convert_checkpoint(tmp_path / "lp", tmp_path / "mo", "modelopt")
    hf = json.load(open(tmp_path / "mo/hf_quant_config.json"))
    assert hf["quantization"]["quant_algo"] == "W4A16_NVFP4"
    assert hf["quantization"]["group_size"] == 16
    w = "model.layers.0.mlp.up_proj.weight"
    with SafetensorsReader(tmp_path / "mo/model.safetensors") as r, \
            SafetensorsReader(tmp_path / "lp/model.safetensors") as q:
        assert r.tensors[w].dtype == "U8" and r.tensors[w + "_scale"].dtype == "F8_E4M3"
        assert r.read(w + "_scale_2").tobytes() == q.read(w + "_scale").tobytes()
    convert_checkpoint(tmp_path / "mo", tmp_path / "lp2", "lowprec")
    assert filecmp.cmp(tmp_path / "lp/model.safetensors", tmp_path / "lp2/model.safetensors",
                       shallow=False)
    assert not os.path.exists(tmp_path / "lp2/hf_quant_config.json")
    dequantize_checkpoint(tmp_path / "mo", tmp_path / "plain")
    assert not os.path.exists(tmp_path / "plain/hf_quant_config.json")
    assert "quantization_config" not in json.load(open(tmp_path / "plain/config.json"))
    # a tensor scale that is not a power of two has no exact reciprocal: refused, not rounded
    with pytest.raises(CheckpointError, match="no exact reciprocal.*--requantize"):
        convert_checkpoint(tmp_path / "lp", tmp_path / "ct", "compressed-tensors")
    assert not os.path.exists(tmp_path / "ct")
    # q and k quantized on their own have two tensor scales: vLLM would use one for both
    quantize_checkpoint(src, tmp_path / "lp3", "nvfp4")
    with pytest.raises(CheckpointError, match=r"self_attn.k_proj, model.layers.0.self_attn."
                                              r"q_proj: NVFP4 tensor scales .* differ"):
        convert_checkpoint(tmp_path / "lp3", tmp_path / "mo3", "modelopt")
    assert not os.path.exists(tmp_path / "mo3")


def test_quantized_input_is_refused(tmp_path):
    src = tmp_path / "m"
    _tiny_folder(src)
    quantize_checkpoint(src, tmp_path / "c", "FP8A16", layout="compressed-tensors")
    for layout in ("lowprec", "compressed-tensors"):
        with pytest.raises(CheckpointError, match="already quantized"):
            quantize_checkpoint(tmp_path / "c", tmp_path / "again", "mxfp4", layout=layout)


@pytest.mark.slow  # imports torch (compressed-tensors)
def test_config_has_the_fields_compressed_tensors_writes(tmp_path):
    """Issue 33.9: the config lacked version, sparsity_config, transform_config. The fields
    are those compressed-tensors itself writes for the same groups (its
    ModelCompressor.update_config, run here), values included."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    src = tmp_path / "m"
    _tiny_folder(src)
    quantize_checkpoint(src, tmp_path / "q", "NVFP4A16", layout="compressed-tensors",
                        schemes=["re:.*self_attn.*=FP8A16"])
    ours = json.load(open(tmp_path / "q/config.json"))["quantization_config"]
    (tmp_path / "ct").mkdir()
    (tmp_path / "ct/config.json").write_text("{}")
    ModelCompressor(quantization_config=QuantizationConfig.model_validate(ours)).update_config(
        str(tmp_path / "ct"))
    theirs = json.load(open(tmp_path / "ct/config.json"))["quantization_config"]
    assert set(ours) == set(theirs)
    top = set(ours) - {"version", "config_groups"}  # (groups: their own arguments' fields)
    assert {k: ours[k] for k in top} == {k: theirs[k] for k in top}
    assert theirs["version"] == ct.__version__ and ours["version"] == "0.20.0"


def test_quantize_refuses_a_checkpoint_whose_config_says_it_is_quantized(tmp_path):
    """Issue 33.9: an existing quantization_config was replaced without a word (engine
    layouts) or copied, still claiming its method, beside lowprec's tensors. A config that
    says the checkpoint is quantized is refused in every layout: start from the unquantized
    checkpoint, or delete the stale config."""
    src = tmp_path / "m"
    _tiny_folder(src)
    config = json.load(open(src / "config.json"))
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (src / "config.json").write_text(json.dumps(config))
    for layout in ("lowprec", "compressed-tensors", "modelopt"):
        with pytest.raises(CheckpointError, match=r"config.json: already quantized, says its "
                                                  r"quantization_config \(quant_method "
                                                  r"'bitsandbytes'\).*delete quantization_config"):
            quantize_checkpoint(src, tmp_path / "q", "nvfp4", layout=layout)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("fmt", ["NVFP4A16", "FP8A16", "FP8A16_CHANNEL"])
def test_scale_rule_is_refused_where_no_scheme_takes_one(tmp_path, fmt):
    """Issue 33.9: --scale-rule was ignored for NVFP4 in the engine layouts but an error in
    lowprec's; it is refused by both when no scheme of the run takes one (MXFP4/MXFP8 do)."""
    src = tmp_path / "m"
    _tiny_folder(src)
    with pytest.raises(CheckpointError, match=rf"applies to the MX schemes \(MXFP4, MXFP6, "
                                              rf"MXFP8\), not {fmt}"):
        quantize_checkpoint(src, tmp_path / "q", fmt, layout="compressed-tensors",
                            scale_rule="rceil")
    if fmt == "NVFP4A16":
        with pytest.raises(CheckpointError, match="takes no scale rule"):
            quantize_checkpoint(src, tmp_path / "q", "nvfp4", scale_rule="rceil")
    assert not (tmp_path / "q").exists()


def test_convert_refuses_what_it_cannot_move_naming_the_target(tmp_path):
    """Converting an unquantized checkpoint silently copied it (quantize calls that an
    error); converting lowprec's own MXFP4 with 16-element blocks, MXFP6 E3M2 or blocks along
    axis 0 to lowprec named compressed-tensors/ModelOpt as what could not hold it."""
    src = tmp_path / "m.safetensors"
    save_tensors(src, {"fc.weight": np.ones((64, 64), np.float32)})
    with pytest.raises(CheckpointError, match="holds no quantized tensors; nothing to convert"):
        convert_checkpoint(src, tmp_path / "c.safetensors", "compressed-tensors")
    for fmt, axis in [("mxfp4_b16", -1), ("mxfp6_e3m2", -1), ("mxfp4", 0)]:
        # The file as lowprec's writer lays it out (its parts zero: nothing is decoded here).
        spec = make_spec(fmt, (64, 64), "F32", axis=axis)
        q = tmp_path / f"{fmt}{axis}.safetensors"
        save_tensors(q, {stored: np.zeros(shp, np.uint8)
                         for _, stored, _, shp in spec.parts("fc.weight")},
                     {METADATA_VERSION_KEY: METADATA_VERSION,
                      METADATA_KEY: json.dumps({"fc.weight": spec.to_json("fc.weight")})})
        with pytest.raises(CheckpointError, match="already in the lowprec layout"):
            convert_checkpoint(q, tmp_path / "c.safetensors", "lowprec")
        with pytest.raises(CheckpointError, match="no compressed-tensors equivalent"):
            convert_checkpoint(q, tmp_path / "c.safetensors", "compressed-tensors")
    assert not (tmp_path / "c.safetensors").exists()


def test_engine_layouts_list_empty_weights_and_advise_their_own_option(tmp_path):
    """A 0-size [out, in] weight was kept but not listed in ignore (so an engine looked for
    its quantized parts); a name clash advised --exclude, which the engine layouts refuse."""
    src = tmp_path / "m"
    os.makedirs(src)
    save_tensors(src / "model.safetensors", {"model.layers.0.mlp.up_proj.weight":
                                             np.ones((32, 64), np.float32),
                                             "model.layers.0.mlp.empty.weight":
                                             np.ones((0, 64), np.float32)})
    quantize_checkpoint(src, tmp_path / "q", "NVFP4A16", layout="compressed-tensors")
    qc = json.load(open(tmp_path / "q/config.json"))["quantization_config"]
    assert "model.layers.0.mlp.empty" in qc["ignore"]
    clash = tmp_path / "clash.safetensors"
    save_tensors(clash, {"fc.weight": np.ones((8, 64), np.float32),
                         "fc.weight_scale": np.ones((8, 1), np.float32)})
    with pytest.raises(CheckpointError, match=r"'fc.weight_scale' would be used twice.*--ignore "
                                              "the module of one of them"):
        quantize_checkpoint(clash, tmp_path / "c.safetensors", "FP8A16",
                            layout="compressed-tensors")


def test_unknown_layout_lists_every_layout(tmp_path):
    with pytest.raises(CheckpointError, match="unknown layout 'bogus'; choose one of: lowprec, "
                                              "gpt-oss, compressed-tensors, modelopt"):
        quantize_checkpoint(tmp_path / "m", tmp_path / "q", "mxfp4", layout="bogus")


def test_per_channel_fp8_has_no_lowprec_layout(tmp_path):
    src = tmp_path / "m"
    _tiny_folder(src)
    quantize_checkpoint(src, tmp_path / "c", "FP8A16_CHANNEL", layout="compressed-tensors")
    with pytest.raises(CheckpointError, match="per-channel FP8 has no lowprec layout"):
        convert_checkpoint(tmp_path / "c", tmp_path / "l", "lowprec")


# -- the real loaders ------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    torch = pytest.importorskip("torch")
    pytest.importorskip("compressed_tensors")
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("llama") / "model"
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_transformers_and_compressed_tensors_load_lowprec_output(tmp_path, llama_folder, scheme):
    import torch
    import transformers

    out = tmp_path / scheme
    quantize_checkpoint(llama_folder, out, scheme, layout="compressed-tensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    theirs = model.state_dict()
    ours = load_checkpoint(out, dtype="float32")
    quantized = [n for n in ours if n.endswith("proj.weight")]
    assert len(quantized) == 14
    for name, value in ours.items():
        want = torch.from_numpy(np.asarray(value, np.float32)).to(torch.bfloat16)
        got = theirs[name]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
    # the loader really decoded lowprec's bits: weights differ from the original ones
    orig = load_checkpoint(llama_folder)
    assert not np.array_equal(np.asarray(orig[quantized[0]]).view(np.uint16),
                              theirs[quantized[0]].view(torch.int16).numpy().view(np.uint16))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 128) and bool(torch.isfinite(logits).all())


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_compressed_tensors_decompressors_match_lowprec(tmp_path, llama_folder, scheme):
    """compressed-tensors itself, without transformers: its config schema accepts lowprec's
    quantization_config, and each group's decompressor gives lowprec's decoded values (in the
    decompressor's own output dtype: bfloat16 for the FP4 and MX schemes, the scale's dtype
    for FP8: bfloat16 here, the model's)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    out = tmp_path / scheme
    quantize_checkpoint(llama_folder, out, scheme, layout="compressed-tensors")
    qc = QuantizationConfig.model_validate(json.load(open(out / "config.json"))["quantization_config"])
    (group,) = qc.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(group.format)
    stored = load_file(out / "model.safetensors")
    ours = load_checkpoint(out, dtype="float32")
    modules = sorted({n.rsplit(".weight", 1)[0] for n in stored if ".weight_" in n or
                      (n.endswith(".weight") and stored[n].dtype == torch.float8_e4m3fn)})
    assert len(modules) == 14
    for m in modules:
        local = {k[len(m) + 1:]: v for k, v in stored.items() if k.startswith(m + ".weight")}
        got = compressor.decompress(local, group)["weight"]
        want = torch.from_numpy(np.asarray(ours[m + ".weight"], np.float32)).to(got.dtype)
        assert got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), m


def test_reads_any_global_scale_as_compressed_tensors_does(tmp_path, llama_folder):
    """llm-compressor writes gs = 2688 / amax (not a power of two): lowprec decodes
    e × float32(s / gs), exactly the decompressor's arithmetic."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file, save_file

    quantize_checkpoint(llama_folder, tmp_path / "q", "NVFP4A16", layout="compressed-tensors")
    stored = load_file(tmp_path / "q/model.safetensors")
    for name in stored:
        if name.endswith("_global_scale"):
            stored[name] = stored[name] * torch.tensor([1.3], dtype=torch.float32)
    os.makedirs(tmp_path / "odd")
    save_file(stored, tmp_path / "odd/model.safetensors", metadata={"format": "pt"})
    qc = json.load(open(tmp_path / "q/config.json"))["quantization_config"]
    (group,) = QuantizationConfig.model_validate(qc).config_groups.values()
    ours = load_checkpoint(tmp_path / "odd", dtype="float32")
    m = "model.layers.1.mlp.down_proj"
    local = {k[len(m) + 1:]: v for k, v in stored.items() if k.startswith(m + ".weight")}
    got = BaseCompressor.get_value_from_registry(group.format).decompress(local, group)["weight"]
    want = torch.from_numpy(ours[m + ".weight"]).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # moved to lowprec's layout only where exact: refused, or every value unchanged
    try:
        convert_checkpoint(tmp_path / "odd", tmp_path / "lp", "lowprec")
    except CheckpointError as e:
        assert "no exact reciprocal" in str(e)
    else:
        back = load_checkpoint(tmp_path / "lp", dtype="float32")
        assert all(back[k].tobytes() == ours[k].tobytes() for k in ours)
    # with requantize, moved: what changed is counted, and every value moves by at most the
    # two float32 roundings that separate float32(s / gs) from float32(float32(1 / gs) × s)
    # (the elements are re-encoded against the latter: they keep their codes)
    rep = convert_checkpoint(tmp_path / "odd", tmp_path / "lp2", "lowprec", requantize=True)
    back = load_checkpoint(tmp_path / "lp2", dtype="float32")
    for t in rep.quantized:
        diff = np.count_nonzero(back[t.name].view(np.uint32) != ours[t.name].view(np.uint32))
        assert t.changed == diff
        assert np.all(np.abs(back[t.name] - ours[t.name]) <= 2.0 ** -22 * np.abs(ours[t.name]))


def test_cli_engine_layouts(tmp_path, capsys):
    from lowprec.cli import main

    src = tmp_path / "m"
    x = _tiny_folder(src)
    ct, lp, back = (str(tmp_path / n) for n in ("ct", "lp", "back"))
    assert main(["quantize", str(src), ct, "--layout", "compressed-tensors",
                 "--scheme", "nvfp4a16", "--ignore", "re:.*down_proj",
                 "--scheme", "re:.*(q|k)_proj=FP8A16_CHANNEL", "-q"]) == 0
    qc = json.load(open(f"{ct}/config.json"))["quantization_config"]
    assert sorted(g["format"] for g in qc["config_groups"].values()) == [
        "float-quantized", "nvfp4-pack-quantized"]
    assert {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"} <= set(qc["ignore"])
    capsys.readouterr()
    assert main(["inspect", ct, "--json"]) == 0
    formats = {t["name"]: t["format"] for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert formats["model.layers.0.self_attn.q_proj.weight"] == "e4m3 (compressed-tensors, per channel)"
    assert formats["model.layers.0.mlp.up_proj.weight"] == "nvfp4 (compressed-tensors)"
    assert formats["model.layers.0.mlp.down_proj.weight"] == "kept"
    # per-channel FP8 has no lowprec layout: one line, exit 1, nothing written
    assert main(["convert", ct, lp, "--layout", "lowprec", "-q"]) == 1
    assert "per-channel FP8" in capsys.readouterr().err and not os.path.exists(lp)
    assert main(["dequantize", ct, back, "--dtype", "float32", "-q"]) == 0
    assert "quantization_config" not in json.load(open(f"{back}/config.json"))  # plain again
    w = "model.layers.0.mlp.up_proj.weight"
    assert np.abs(load_checkpoint(back)[w] - x[w]).max() < 0.2 * np.abs(x[w]).max()
    assert main(["quantize", str(src), lp, "--layout", "modelopt", "-f", "mxfp4", "-q"]) == 1
    assert "ModelOpt layout holds" in capsys.readouterr().err
    # a static scheme without activation statistics: refused, naming the fix
    assert main(["quantize", str(src), lp, "--layout", "compressed-tensors", "-f", "nvfp4",
                 "-q"]) == 1
    err = capsys.readouterr().err
    assert "static activation scheme" in err and "--calibration" in err and "NVFP4A16" in err
    assert not os.path.exists(lp)


def test_modelopt_fp8_channel_moves_to_compressed_tensors(tmp_path):
    """ModelOpt's per-channel FP8 (FP8_PER_CHANNEL_PER_TOKEN: weight_scale F32 [out]) is
    compressed-tensors' FP8_DYNAMIC ([out, 1]): the bits move, the values stay."""
    src = tmp_path / "m"
    _tiny_folder(src)
    quantize_checkpoint(src, tmp_path / "mo", "FP8_DYNAMIC", layout="modelopt")
    hf = json.load(open(tmp_path / "mo/hf_quant_config.json"))["quantization"]
    assert hf["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN" and "lm_head" in hf["exclude_modules"]
    qc = json.load(open(tmp_path / "mo/config.json"))["quantization_config"]
    assert qc["quant_method"] == "modelopt" and "lm_head" in qc["ignore"]
    convert_checkpoint(tmp_path / "mo", tmp_path / "ct", "compressed-tensors")
    groups = json.load(open(tmp_path / "ct/config.json"))["quantization_config"]["config_groups"]
    (g,) = groups.values()
    assert g["weights"]["strategy"] == "channel" and g["input_activations"]["strategy"] == "token"
    a, b = load_checkpoint(tmp_path / "mo"), load_checkpoint(tmp_path / "ct")
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    convert_checkpoint(tmp_path / "ct", tmp_path / "mo2", "modelopt")
    assert filecmp.cmp(tmp_path / "mo/model.safetensors", tmp_path / "mo2/model.safetensors",
                       shallow=False)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
def test_row_blocks_give_the_whole_tensor_bits(tmp_path, monkeypatch, scheme):
    """Conversions hold a block of rows at a time; the tensor-wide scale comes from a first
    pass, so blocks of 3 rows write the bytes the whole tensor does."""
    import lowprec.checkpoint._engine_layouts as el

    src = tmp_path / "m"
    _tiny_folder(src)
    quantize_checkpoint(src, tmp_path / "whole", scheme, layout="compressed-tensors")
    whole = load_checkpoint(tmp_path / "whole", dtype="float32")
    monkeypatch.setattr(el, "ROW_BLOCK_ELEMENTS", 3 * 64)
    quantize_checkpoint(src, tmp_path / "rows", scheme, layout="compressed-tensors")
    assert filecmp.cmp(tmp_path / "whole/model.safetensors", tmp_path / "rows/model.safetensors",
                       shallow=False)
    rows = load_checkpoint(tmp_path / "rows", dtype="float32")
    assert all(whole[k].tobytes() == rows[k].tobytes() for k in whole)
    if scheme not in ("FP8A16_CHANNEL", "NVFP4A16"):  # (NVFP4: gs has no exact reciprocal)
        convert_checkpoint(tmp_path / "rows", tmp_path / "lp", "lowprec")
        convert_checkpoint(tmp_path / "lp", tmp_path / "back", "compressed-tensors")
        assert filecmp.cmp(tmp_path / "whole/model.safetensors",
                           tmp_path / "back/model.safetensors", shallow=False)


def test_gpt_oss_mxfp4_moves_to_compressed_tensors(tmp_path):
    """gpt-oss blocks [out, K/32, 16] are the packed bytes [out, K/2]: a reshape."""
    src = tmp_path / "m"
    _tiny_folder(src)
    quantize_checkpoint(src, tmp_path / "oss", "mxfp4", layout="gpt-oss")
    convert_checkpoint(tmp_path / "oss", tmp_path / "ct", "compressed-tensors")
    a = load_checkpoint(tmp_path / "oss", dtype="float32")
    b = load_checkpoint(tmp_path / "ct", dtype="float32")
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    w = "model.layers.0.mlp.up_proj.weight"
    with SafetensorsReader(tmp_path / "oss/model.safetensors") as r, \
            SafetensorsReader(tmp_path / "ct/model.safetensors") as c:
        assert r.read(w + "_blocks").tobytes() == c.read(w + "_packed").tobytes()


@pytest.mark.parametrize("scale_dtype", ["BF16", "F16"])
def test_reads_fp8_with_half_precision_scales(tmp_path, scale_dtype):
    """Other producers store FP8 weight_scale in the model dtype; values are e × s."""
    from lowprec.checkpoint._safetensors import numpy_dtype

    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (8, 32), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    scale = (rng.random((8, 1)) * 0.01 + 1e-3).astype(numpy_dtype(scale_dtype))
    w = "fc.weight"
    with SafetensorsWriter(tmp_path / "m.safetensors", [(w, "F8_E4M3", (8, 32)),
                                                         (w + "_scale", scale_dtype, (8, 1))]) as f:
        f.write(w, codes.view(numpy_dtype("F8_E4M3")))
        f.write(w + "_scale", scale)
    got = load_checkpoint(tmp_path / "m.safetensors", dtype="float32")[w]
    want = codes.view(numpy_dtype("F8_E4M3")).astype(np.float64) * scale.astype(np.float64)
    assert np.array_equal(got, want.astype(np.float32))  # the product is exact in float32
    with pytest.raises(CheckpointError, match="already in the compressed-tensors layout"):
        convert_checkpoint(tmp_path / "m.safetensors", tmp_path / "c.safetensors",
                           "compressed-tensors")


@pytest.mark.slow
def test_mixed_groups_load_in_compressed_tensors(tmp_path, llama_folder):
    """One checkpoint, three groups (NVFP4, per-channel FP8, MXFP8) and an ignored Linear:
    each module's group (found by compressed-tensors' own target matching) decompresses to
    lowprec's values, and transformers runs the model compressed (its dequantize=True path
    takes one dense group per model: a transformers 5.24 limitation)."""
    import torch
    import transformers
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils import match_targets
    from safetensors.torch import load_file

    out = tmp_path / "mixed"
    quantize_checkpoint(llama_folder, out, "NVFP4A16", layout="compressed-tensors",
                        schemes=["re:.*self_attn.*=FP8A16_CHANNEL", "re:.*down_proj=MXFP8A16"],
                        ignore=["re:.*layers\\.1\\.mlp\\.(gate|up)_proj"])
    qc = QuantizationConfig.model_validate(json.load(open(out / "config.json"))["quantization_config"])
    assert qc.format == "mixed-precision" and len(qc.config_groups) == 3
    target_to_group = {t: g for g in qc.config_groups.values() for t in g.targets}
    stored = load_file(out / "model.safetensors")
    ours = load_checkpoint(out, dtype="float32")
    formats = set()
    for name in ours:
        module = name.rsplit(".weight", 1)[0]
        matched = match_targets(module, torch.nn.Linear(1, 1), list(target_to_group))
        if module in ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj") or \
                not name.endswith("proj.weight"):
            assert not matched and stored[name].dtype == torch.bfloat16  # kept
            continue
        group = target_to_group[matched[0]]
        formats.add(group.format)
        local = {k[len(module) + 1:]: v for k, v in stored.items() if k.startswith(module + ".weight")}
        got = BaseCompressor.get_value_from_registry(group.format).decompress(local, group)["weight"]
        want = torch.from_numpy(np.asarray(ours[name], np.float32)).to(got.dtype)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    assert formats == {"nvfp4-pack-quantized", "float-quantized", "mxfp8-quantized"}
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 128) and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_tied_head_is_ignored(tmp_path, layout):
    """Tied embeddings: no lm_head.weight in the file, but the model has an lm_head Linear
    that the loader must not look for."""
    os.makedirs(tmp_path / "m")
    w = np.ones((32, 64), np.float32)
    with SafetensorsWriter(tmp_path / "m/model.safetensors", [("model.layers.0.mlp.up_proj.weight", "F32", w.shape)]) as f:
        f.write("model.layers.0.mlp.up_proj.weight", w)
    quantize_checkpoint(tmp_path / "m", tmp_path / "q", "NVFP4A16", layout=layout)
    qc = json.load(open(tmp_path / "q/config.json"))["quantization_config"]
    assert "lm_head" in qc["ignore"]  # (ModelOpt 0.47's config.json names it "ignore" too)
    if layout == "modelopt":
        hf = json.load(open(tmp_path / "q/hf_quant_config.json"))["quantization"]
        assert "lm_head" in hf["exclude_modules"]


# -- a ModelOpt export as ModelOpt writes it -------------------------------------------------
E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _modelopt_folder(path, algo, ts):
    """A ModelOpt unified export, built here from codes (not by lowprec): one quantized Linear
    with its activation ``input_scale``, a BF16 head, ``hf_quant_config.json`` and
    ``config.json``'s ``quantization_config``; returns the stored tensors."""
    import ml_dtypes

    rng = np.random.default_rng(7)
    out, k = 32, 64
    w = "model.layers.0.mlp.up_proj.weight"
    if algo == "NVFP4":
        scales = rng.choice(np.array([0.25, 0.5, 1.0, 1.5, 3.0, 7.0, 448.0], np.float32),
                            (out, k // 16)).astype(ml_dtypes.float8_e4m3fn)
        stored = {w: rng.integers(0, 256, (out, k // 2), dtype=np.uint8),
                  w + "_scale": scales, w + "_scale_2": np.array(ts, np.float32)}
    else:
        codes = rng.integers(0, 256, (out, k), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes
        stored = {w: codes.view(ml_dtypes.float8_e4m3fn), w + "_scale": np.array(ts, np.float32)}
    stored[w.replace("weight", "input_scale")] = np.array(0.0625, np.float32)
    stored["lm_head.weight"] = np.ones((8, k), ml_dtypes.bfloat16)
    os.makedirs(path)
    save_tensors(path / "model.safetensors", stored)
    q = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
    if algo == "NVFP4":
        q["group_size"] = 16
    (path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": q}))
    (path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "quantization_config": {"quant_method": "modelopt", **q}}))
    return w, stored


@pytest.mark.parametrize("algo,ts", [("NVFP4", 3.7 / 2688), ("NVFP4", 2.0 ** -10),
                                     ("FP8", 0.0123)])
def test_reads_a_modelopt_export(tmp_path, algo, ts):
    """Values from ModelOpt's definition, computed here: NVFP4 e × float32(ts × s) with e the
    E2M1 value of each nibble (low first) and s the E4M3 block scale; FP8 e × s in float32."""
    src = tmp_path / "mo"
    w, stored = _modelopt_folder(src, algo, ts)
    ts = np.float32(ts)
    if algo == "NVFP4":
        packed = stored[w]
        e = E2M1_VALUES[np.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)]
        s = stored[w + "_scale"].astype(np.float64)  # E4M3: exact
        total = (np.float64(ts) * s).astype(np.float32)  # one float32 rounding of ts × s
        want = e * np.repeat(total, 16, axis=1)
    else:
        want = stored[w].astype(np.float32) * ts
    got = load_checkpoint(src, dtype="float32")
    assert got[w].dtype == np.float32 and got[w].tobytes() == want.tobytes()
    # its activation input_scale is claimed with the weight: not a weight of the model
    assert w.replace("weight", "input_scale") not in got
    rep = {t.name: t.format for t in inspect_checkpoint(src).tensors}
    assert rep[w] == ("nvfp4" if algo == "NVFP4" else "e4m3") + " (modelopt, static input scale)"
    assert rep["lm_head.weight"] == "kept"
    # to lowprec's layout and to compressed-tensors: the bits move and the values stay, or
    # (NVFP4 to compressed-tensors, whose gs = 1/ts: exact for a power of two, and otherwise
    # only if every block scale used gives the same float32 both ways; FP8 to
    # compressed-tensors, which stores the scale in the model dtype, bfloat16 here: 0.0123 is
    # no bfloat16 value) it is refused
    for layout in ("lowprec", "compressed-tensors"):
        dst = tmp_path / layout
        try:
            convert_checkpoint(src, dst, layout, progress=False)
        except CheckpointError as e:
            assert layout == "compressed-tensors" and not dst.exists()
            if algo == "NVFP4":
                assert ts != 2.0 ** -10 and "no exact reciprocal" in str(e)
            else:
                assert "FP8 scale 0.0123" in str(e) and "is no BF16 value" in str(e)
                assert "--requantize" in str(e)
            continue
        assert load_checkpoint(dst, dtype="float32")[w].tobytes() == want.tobytes()
        assert not (dst / "hf_quant_config.json").exists()
    plain = tmp_path / "plain"
    dequantize_checkpoint(src, plain, dtype="float32", progress=False)
    assert not (plain / "hf_quant_config.json").exists()
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    assert load_checkpoint(plain)[w].tobytes() == want.tobytes()


# -- what converting a large checkpoint for an engine needs ----------------------------------
def _sharded_tiny(path):
    """``_tiny_folder``'s tensors in two shards with an index."""
    tensors = _tiny_folder(path)
    os.remove(path / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for rel, members in shards.items():
        save_tensors(path / rel, {n: tensors[n] for n in members})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": {n: rel for rel, members in shards.items() for n in members}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def _digests(folder) -> dict:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("layout,fmt,schemes", [
    ("compressed-tensors", "NVFP4A16", ["re:.*(q|k)_proj=FP8A16_CHANNEL"]),
    ("modelopt", "FP8_DYNAMIC", None)])
def test_engine_layouts_jobs_give_the_same_output(tmp_path, layout, fmt, schemes):
    src = tmp_path / "m"
    _sharded_tiny(src)
    one, two = tmp_path / "one", tmp_path / "two"
    rep1 = quantize_checkpoint(src, one, fmt, layout=layout, schemes=schemes, progress=False)
    rep2 = quantize_checkpoint(src, two, fmt, layout=layout, schemes=schemes, progress=False,
                               jobs=2)
    assert _digests(one) == _digests(two)
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
            "model.safetensors.index.json", "config.json"} <= set(_digests(one))
    assert [t.to_dict() for t in rep1.tensors] == [t.to_dict() for t in rep2.tensors]
    target = "modelopt" if layout != "modelopt" else "compressed-tensors"
    for op, kw in [(convert_checkpoint, {"layout": target, "requantize": True}),
                   (dequantize_checkpoint, {})]:
        try:
            op(one, tmp_path / "a", progress=False, **kw)
        except CheckpointError as e:  # weight-only per-channel FP8 has no ModelOpt layout
            assert "FP8A16_CHANNEL has no ModelOpt layout" in str(e)
            continue
        op(one, tmp_path / "b", progress=False, jobs=2, **kw)
        assert _digests(tmp_path / "a") == _digests(tmp_path / "b")
        shutil.rmtree(tmp_path / "a"), shutil.rmtree(tmp_path / "b")


@pytest.mark.parametrize("op", ["quantize", "convert"])
def test_engine_layouts_never_write_beside_or_over_the_input(tmp_path, op):
    src = tmp_path / "m"
    _sharded_tiny(src)
    if op == "convert":
        quantize_checkpoint(src, tmp_path / "q", "NVFP4A16", layout="compressed-tensors",
                            progress=False)
        src = tmp_path / "q"

    def run(dst, **kw):
        if op == "quantize":
            return quantize_checkpoint(src, dst, "NVFP4A16", layout="compressed-tensors",
                                       progress=False, **kw)
        return convert_checkpoint(src, dst, "lowprec", progress=False, requantize=True, **kw)

    before = _digests(src)
    for dst, words in [(src, "is the input folder"), (src / "sub", "inside the input folder")]:
        with pytest.raises(CheckpointError, match=words):
            run(dst, force=True)
    shard = src / "model-00001-of-00002.safetensors"
    sibling = src / "model-00002-of-00002.safetensors"
    if op == "quantize":
        with pytest.raises(CheckpointError, match="is a file of the input checkpoint"):
            quantize_checkpoint(shard, sibling, "NVFP4A16", layout="compressed-tensors",
                                force=True, progress=False)
    assert _digests(src) == before and not (src / "sub").exists()


@pytest.mark.parametrize("layout,fmt", [("compressed-tensors", "NVFP4A16"),
                                        ("compressed-tensors", "FP8A16"), ("modelopt", "NVFP4A16")])
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_engine_layouts_peak_memory_does_not_grow_with_the_checkpoint(tmp_path, monkeypatch,
                                                                      layout, fmt):
    """Quantize, convert and dequantize hold a block of rows at a time (and the tensor-wide
    scale's first pass reads rows too): the peak for 12 tensors is that for 2, short of one
    more tensor's bytes. (Not a ratio: JAX keeps ~7 KiB of bookkeeping per call in its own
    caches, measured with tracemalloc, which after a worker's earlier tests grew the peak
    from 185 to 260 KB, 1.4x, with no tensor data held.)"""
    import tracemalloc

    import lowprec.checkpoint._engine_layouts as el

    monkeypatch.setattr(el, "ROW_BLOCK_ELEMENTS", 16 * 256)
    w = np.random.default_rng(4).standard_normal((256, 256)).astype(np.float32)  # 256 KiB
    peaks = {}
    for n in (2, 12):
        path = tmp_path / f"m{n}.safetensors"
        save_tensors(path, {f"layers.{i}.mlp.up_proj.weight": w for i in range(n)})
        quantize_checkpoint(path, tmp_path / "warm.safetensors", fmt, layout=layout, force=True,
                            progress=False)
        tracemalloc.start()
        quantize_checkpoint(path, tmp_path / f"q{n}.safetensors", fmt, layout=layout,
                            progress=False)
        convert_checkpoint(tmp_path / f"q{n}.safetensors", tmp_path / f"l{n}.safetensors",
                           "lowprec", progress=False, requantize=True)
        dequantize_checkpoint(tmp_path / f"q{n}.safetensors", tmp_path / f"d{n}.safetensors",
                              progress=False)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks[12] < peaks[2] + w.nbytes, peaks  # holding any one more tensor exceeds it
    assert peaks[12] < 12 * w.nbytes / 2, peaks


def test_schemes_can_name_the_head_and_ignore_beats_them(tmp_path):
    """The default keeps lm_head; a --scheme naming it quantizes it; an --ignore pattern
    matching it keeps it whatever the schemes say (ignore is checked first)."""
    src = tmp_path / "m"
    _tiny_folder(src)
    quantize_checkpoint(src, tmp_path / "a", "NVFP4A16", layout="compressed-tensors",
                        schemes=["lm_head=FP8A16"], progress=False)
    qc = json.load(open(tmp_path / "a/config.json"))["quantization_config"]
    groups = {g["format"]: g["targets"] for g in qc["config_groups"].values()}
    assert groups["float-quantized"] == ["lm_head"] and "lm_head" not in qc["ignore"]
    with SafetensorsReader(tmp_path / "a/model.safetensors") as r:
        assert r.tensors["lm_head.weight"].dtype == "F8_E4M3"
    quantize_checkpoint(src, tmp_path / "b", "NVFP4A16", layout="compressed-tensors",
                        schemes=["lm_head=FP8A16"], ignore=["re:.*lm_head"], progress=False)
    qc = json.load(open(tmp_path / "b/config.json"))["quantization_config"]
    assert "lm_head" in qc["ignore"] and len(qc["config_groups"]) == 1
    with SafetensorsReader(tmp_path / "b/model.safetensors") as r:
        assert r.tensors["lm_head.weight"].dtype == "F32"
