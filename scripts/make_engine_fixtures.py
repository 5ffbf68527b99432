"""Makes tests/data/engines: the outputs of llm-compressor's presets, or of NVIDIA ModelOpt,
for one random tiny Llama, which tests/test_checkpoint_presets.py compares with lowprec's
output for the same weights (and the same activation statistics).

llm-compressor pins other compressed-tensors / transformers versions than lowprec's, so it
runs in its own environment::

    /work/venvs/llmc/bin/python scripts/make_engine_fixtures.py llmcompressor tests/data/engines
    .venv/bin/python scripts/make_engine_fixtures.py modelopt tests/data/engines

``llmcompressor`` writes (made with llm-compressor 0.14.0.1, compressed-tensors 0.19.0,
transformers 5.17.0, torch 2.13.0 CPU):

- ``base/``: the model (``config.json``, ``model.safetensors``, bfloat16): hidden 64,
  intermediate 128, 2 layers, 4 heads, 2 KV heads, vocabulary 128, untied head; and a
  word-level tokenizer whose token i is the word ``t{i}``.
- ``calibration.json``: the token ids every calibrated preset saw (4 sequences of 16).
- ``activation_amax.json``: the largest magnitude of each Linear's input over those tokens,
  observed by a forward hook on the unquantized model (as llm-compressor's sequential
  pipeline observes it: quantization disabled while calibrating).
- ``llmcompressor/<PRESET>/``: ``config.json`` and ``model.safetensors`` of
  ``oneshot(model, recipe=QuantizationModifier(targets="Linear", scheme=PRESET,
  ignore=["lm_head"]))`` saved with ``save_compressed=True``, for the presets NVFP4A16,
  NVFP4, MXFP4A16, MXFP4, MXFP8A16, MXFP8, FP8 and FP8_DYNAMIC (the static ones, FP8 and
  NVFP4, calibrated on calibration.json).

``modelopt`` writes ``modelopt/<ALGO>/`` (``config.json``, ``hf_quant_config.json``,
``model.safetensors``): ``mtq.quantize`` of the same base model with ``NVFP4_DEFAULT_CFG``,
``W4A16_NVFP4_CFG``, ``FP8_DEFAULT_CFG`` or ``FP8_PER_CHANNEL_PER_TOKEN_CFG``, calibrated on
the same tokens, then ``export_hf_checkpoint`` (made with nvidia-modelopt 0.47.0,
transformers 5.24.0, torch 2.13.0 CPU).
"""

import json
import os
import shutil
import sys
import tempfile

import torch

PRESETS = ("NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8", "FP8", "FP8_DYNAMIC")
STATIC = ("NVFP4", "FP8")


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, tie_word_embeddings=False,
                       architectures=["LlamaForCausalLM"])


def _tokens():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (4, 16), generator=g).tolist()


def _tokenizer():
    """A word-level tokenizer of the words ``t0`` ... ``t127`` (token i is ``t{i}``): enough
    for llm-compressor's dataset handling and for a text calibration file."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0")


def _keep(src, dst, names):
    os.makedirs(dst, exist_ok=True)
    for name in names:
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))


def _amax(model, tokens) -> dict:
    seen = {}

    def hook(name):
        def f(module, args):
            a = float(args[0].detach().abs().max())
            seen[name] = max(seen.get(name, 0.0), a)
        return f

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    with torch.no_grad():
        for t in tokens:
            model(torch.tensor([t]))
    for h in handles:
        h.remove()
    return dict(sorted(seen.items()))


def llmcompressor(out: str) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import LlamaForCausalLM

    tokens = _tokens()
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        torch.manual_seed(0)
        LlamaForCausalLM(_config()).to(torch.bfloat16).save_pretrained(base)
        tokenizer = _tokenizer()
        tokenizer.save_pretrained(base)
        _keep(base, os.path.join(out, "base"),
              ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"))
        with open(os.path.join(out, "calibration.json"), "w") as f:
            json.dump(tokens, f)
        model = LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        with open(os.path.join(out, "activation_amax.json"), "w") as f:
            json.dump(_amax(model, tokens), f, indent=1)
        for preset in PRESETS:
            model = LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
            recipe = QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"])
            kw = {}
            if preset in STATIC:
                ds = Dataset.from_dict({"input_ids": tokens,
                                        "attention_mask": [[1] * len(t) for t in tokens]})
                kw = dict(dataset=ds, num_calibration_samples=len(tokens),
                          max_seq_length=len(tokens[0]), shuffle_calibration_samples=False)
            oneshot(model=model, recipe=recipe, processor=tokenizer, **kw)
            made = os.path.join(tmp, preset)
            model.save_pretrained(made, save_compressed=True)
            _keep(made, os.path.join(out, "llmcompressor", preset),
                  ("config.json", "model.safetensors"))


def modelopt(out: str) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import LlamaForCausalLM

    base = os.path.join(out, "base")
    with open(os.path.join(out, "calibration.json")) as f:
        tokens = json.load(f)
    for algo, cfg in (("NVFP4", mtq.NVFP4_DEFAULT_CFG), ("W4A16_NVFP4", mtq.W4A16_NVFP4_CFG),
                      ("FP8", mtq.FP8_DEFAULT_CFG),
                      ("FP8_PER_CHANNEL_PER_TOKEN", mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG)):
        model = LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16)

        def loop(m):
            with torch.no_grad():
                for t in tokens:
                    m(torch.tensor([t]))

        model = mtq.quantize(model, cfg, loop)
        with tempfile.TemporaryDirectory() as tmp:
            export_hf_checkpoint(model, export_dir=tmp)
            _keep(tmp, os.path.join(out, "modelopt", algo),
                  ("config.json", "hf_quant_config.json", "model.safetensors"))


if __name__ == "__main__":
    {"llmcompressor": llmcompressor, "modelopt": modelopt}[sys.argv[1]](sys.argv[2])
