"""Makes tests/data/llmcompressor_w4a16_fp8_dynamic: a random tiny Llama quantized by
llm-compressor with two config groups, int4 W4A16 on the MLP (a scheme lowprec does not
decode) and FP8_DYNAMIC on attention (which it does). tests/test_checkpoint_decode_safety.py
checks that lowprec refuses to half-decode it, or keeps the int4 modules quantized on request.

Run with llm-compressor's own environment (it pins other compressed-tensors/transformers
versions than lowprec's)::

    /work/venvs/llmc/bin/python scripts/make_llmcompressor_fixture.py tests/data/llmcompressor_w4a16_fp8_dynamic

Made with llm-compressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0, torch 2.13.0
(CPU). Only config.json, model.safetensors and recipe.yaml are kept.
"""

import os
import shutil
import sys
import tempfile

import torch
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import FP8_DYNAMIC, W4A16
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import LlamaConfig, LlamaForCausalLM


def main(out: str) -> None:
    torch.manual_seed(0)
    # hidden 128: W4A16's groups of 128 input features; one layer keeps the files small.
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    with tempfile.TemporaryDirectory() as tmp:
        base, made = os.path.join(tmp, "base"), os.path.join(tmp, "made")
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(base)
        model = LlamaForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        groups = {"a": QuantizationScheme(targets=["re:.*mlp.*"], weights=W4A16["weights"]),
                  "b": QuantizationScheme(targets=["re:.*self_attn.*"], **FP8_DYNAMIC)}
        oneshot(model=model, recipe=QuantizationModifier(config_groups=groups, ignore=["lm_head"]))
        model.save_pretrained(made, save_compressed=True)
        os.makedirs(out, exist_ok=True)
        for name in ("config.json", "model.safetensors", "recipe.yaml"):
            shutil.copyfile(os.path.join(made, name), os.path.join(out, name))


if __name__ == "__main__":
    main(sys.argv[1])
