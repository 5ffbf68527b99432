"""Writes tests/data/llmc_mx.npz: what llm-compressor itself writes for MX weights.

Run with an interpreter that has llm-compressor (0.14 needs compressed-tensors 0.19 and
transformers <= 5.17, so it lives in its own environment)::

    /path/to/llmc-venv/bin/python scripts/make_llmc_fixture.py tests/data/llmc_mx.npz

A one-layer Llama whose q/k/gate projections hold three kinds of weights (Gaussian; "ties":
block maxima on every binade edge of the scale rules and elements on every rounding boundary
of the element grids; "edges": block maxima a few float32 ulps around 1.75 x 2^k and the
powers of two) is quantized by ``oneshot`` with the MXFP4A16 and MXFP8A16 presets (their W4A4
and W8A8 siblings, MXFP4 and MXFP8, quantize weights the same way) in bfloat16 and in float32,
saved with ``save_compressed=True`` and read back. The archive holds, per dtype, preset and
module, the input weight's bits and the saved ``weight_packed``/``weight`` and
``weight_scale`` bytes, plus the library versions. tests/test_engine_rules.py checks lowprec's
codes against it (and regenerates it when LOWPREC_LLMC_PYTHON names such an interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

MODULES = ("q_proj", "k_proj", "gate_proj")
PRESETS = ("MXFP4A16", "MXFP8A16")
DTYPES = ("bfloat16", "float32")
HIDDEN = 64


def weights(kind: str, rng) -> np.ndarray:
    """A [64, 64] float64 weight of the given kind (exact in bfloat16)."""
    shape = (HIDDEN, HIDDEN // 32, 32)
    if kind == "gauss":
        return rng.standard_normal((HIDDEN, HIDDEN)) * 0.05
    if kind == "ties":
        # Block maxima s x 2^e with s on the thresholds of floor/even/even_e2m1/rceil, and
        # elements f x amax with f in 64ths: every E2M1/E4M3 midpoint under any of them.
        sig = rng.choice([1.0, 1.25, 1.5, 1.625, 1.75, 1.875, 1.9375, 1.96875], shape[:2])
        amax = sig * 2.0 ** rng.integers(-9, 3, shape[:2])
        x = rng.integers(0, 65, shape) / 64.0 * amax[..., None]
        x *= rng.choice([-1.0, 1.0], shape)
        x[..., 0] = amax * rng.choice([-1.0, 1.0], shape[:2])
        return x.reshape(HIDDEN, HIDDEN)
    # "edges": block maxima on and one or two bfloat16 ulps around 1.75 x 2^k and 2^k
    base = rng.choice([1.75, 2.0], shape[:2]) * 2.0 ** rng.integers(-6, 2, shape[:2])
    amax = base * (1.0 + rng.choice([-2, -1, 0, 1, 2], shape[:2]) * 2.0**-7)
    x = rng.uniform(-1, 1, shape) * amax[..., None]
    x[..., 3] = amax
    return x.reshape(HIDDEN, HIDDEN)


def run(preset: str, dtype: str, ws: dict, workdir: str) -> dict:
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=HIDDEN, intermediate_size=HIDDEN,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    tdtype = getattr(torch, dtype)
    model = LlamaForCausalLM(cfg).to(tdtype)
    layer = model.model.layers[0]
    for name, w in ws.items():
        module = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
        module.weight.data = torch.tensor(w, dtype=torch.float32).to(tdtype)
    # As a user does: oneshot on a model loaded from a checkpoint (it reads the config there).
    src = os.path.join(workdir, f"source-{dtype}")
    model.save_pretrained(src)
    model = LlamaForCausalLM.from_pretrained(src, dtype=tdtype)
    targets = [f"re:.*{name}$" for name in MODULES]
    oneshot(model=model, recipe=QuantizationModifier(targets=targets, scheme=preset))
    out = os.path.join(workdir, f"{preset}-{dtype}")
    model.save_pretrained(out, save_compressed=True)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    saved = {}
    for name in MODULES:
        part = "self_attn" if name != "gate_proj" else "mlp"
        prefix = f"model.layers.0.{part}.{name}."
        codes = tensors.get(prefix + "weight_packed", tensors.get(prefix + "weight"))
        scales = tensors[prefix + "weight_scale"]
        saved[name] = tuple(t.contiguous().view(torch.uint8).numpy() for t in (codes, scales))
    return saved, qc["format"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("output", help="the .npz to write")
    args = ap.parse_args(argv)
    import compressed_tensors
    import llmcompressor
    import torch
    import transformers

    rng = np.random.default_rng(20261127)
    ws = {name: weights(kind, rng) for name, kind in zip(MODULES, ("gauss", "ties", "edges"))}
    arrays = {}
    with tempfile.TemporaryDirectory() as workdir:
        for dtype in DTYPES:
            for name, w in ws.items():
                t = torch.tensor(w, dtype=torch.float32).to(getattr(torch, dtype))
                bits = t.view(torch.int16 if dtype == "bfloat16" else torch.int32).numpy()
                arrays[f"{dtype}/{name}/input_bits"] = bits
            for preset in PRESETS:
                saved, fmt = run(preset, dtype, ws, workdir)
                arrays[f"{dtype}/{preset}/format"] = np.array(fmt)
                for name, (codes, scales) in saved.items():
                    arrays[f"{dtype}/{preset}/{name}/codes"] = codes
                    arrays[f"{dtype}/{preset}/{name}/scales"] = scales
    arrays["versions"] = np.array(json.dumps({
        "llmcompressor": llmcompressor.__version__, "compressed_tensors": compressed_tensors.__version__,
        "transformers": transformers.__version__, "torch": torch.__version__}))
    tmp = args.output + ".tmp.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, args.output)
    print(f"wrote {args.output}: {len(arrays)} arrays", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
