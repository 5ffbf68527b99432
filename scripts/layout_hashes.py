"""sha256 of every output file of every checkpoint layout, for a refactor's "same bytes" check.

Writes small checkpoints (a bfloat16 Llama-shaped Hugging Face folder with config.json, a
float32 single file with a 3-D tensor, a GGUF), then runs quantize into every layout and
format, dequantize of each result, convert of each result into every other layout, and the
GGUF verbs (requantize, dequantize, convert both ways, the MXFP4 → NVFP4 cast). Prints one
line per output file (``case/file sha256``), and per refused case the error message; a
report's JSON is hashed without its timing. Run it before and after a change and diff:

    .venv/bin/python scripts/layout_hashes.py > /tmp/before.txt
    (change)
    .venv/bin/python scripts/layout_hashes.py > /tmp/after.txt && diff /tmp/before.txt /tmp/after.txt

Not a test: the suite checks properties against peers and the reference; this checks a
refactor moved no byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile

import ml_dtypes
import numpy as np

from lowprec.checkpoint import (
    CheckpointError,
    SafetensorsWriter,
    convert_checkpoint,
    dequantize_checkpoint,
    inspect_checkpoint,
    quantize_checkpoint,
)
from lowprec.checkpoint import _gguf as G

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
from helpers.gguf_files import llama_template, write_gguf  # noqa: E402 - the tests' fixtures


def _hf_folder(path, rng):
    os.makedirs(path)
    names = {"model.embed_tokens.weight": (32, 64), "lm_head.weight": (32, 64),
             "model.norm.weight": (64,), "model.layers.0.input_layernorm.weight": (64,),
             "model.layers.0.self_attn.q_proj.weight": (64, 64),
             "model.layers.0.self_attn.k_proj.weight": (32, 64),
             "model.layers.0.self_attn.v_proj.weight": (32, 64),
             "model.layers.0.mlp.up_proj.weight": (128, 64),
             "model.layers.0.mlp.gate_proj.weight": (128, 64),
             "model.layers.0.mlp.down_proj.weight": (64, 128)}
    t = {n: (rng.standard_normal(s) * 0.05).astype(ml_dtypes.bfloat16) for n, s in names.items()}
    t["model.layers.0.mlp.down_proj.weight"][3, :16] *= 40  # a wide block: clipping, big scales
    with SafetensorsWriter(f"{path}/model.safetensors",
                           [(n, "BF16", a.shape) for n, a in t.items()]) as f:
        for n, a in t.items():
            f.write(n, a)
    with open(f"{path}/config.json", "w") as f:
        json.dump({"model_type": "llama", "torch_dtype": "bfloat16", "num_attention_heads": 4,
                   "num_key_value_heads": 2, "hidden_size": 64}, f)
    with open(f"{path}/tokenizer.json", "w") as f:
        f.write("{}\n")
    return t


def _f32_file(path, rng):
    t = {"fc.weight": rng.normal(size=(8, 64)).astype(np.float32),
         "acts.weight": (rng.normal(size=(2, 3, 64)) * 4).astype(np.float32),
         "fc.bias": rng.normal(size=(8,)).astype(np.float32)}
    with SafetensorsWriter(path, [(n, "F32", v.shape) for n, v in t.items()]) as f:
        for n, v in t.items():
            f.write(n, v)


def _gguf_file(path, rng):
    import gguf
    t = {"token_embd.weight": (32, 64), "output.weight": (32, 64), "output_norm.weight": (64,),
         "blk.0.attn_norm.weight": (64,), "blk.0.attn_q.weight": (64, 64),
         "blk.0.attn_k.weight": (32, 64), "blk.0.ffn_down.weight": (64, 128),
         "blk.0.ffn_up.weight": (128, 64)}
    write_gguf(path, {n: rng.normal(size=s).astype(np.float32) for n, s in t.items()},
               keys=[("test.name", "tiny", gguf.GGUFValueType.STRING)])


def _hash_tree(root, out):
    lines = []
    if os.path.isfile(root):
        files = [root]
    elif os.path.isdir(root):
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)
    else:
        return ["(no output)"]
    for p in files:
        with open(p, "rb") as f:
            data = f.read()
        if p.endswith(".report.json"):
            rep = json.loads(data)
            for key in ("source", "destination"):  # temporary paths
                rep.pop(key, None)
            rep.get("totals", {}).pop("seconds", None)  # timing
            data = json.dumps(rep, sort_keys=True).encode()
        lines.append(f"{os.path.relpath(p, out)} {hashlib.sha256(data).hexdigest()[:24]}")
    return lines


def main():
    rng = np.random.default_rng(0)
    out = tempfile.mkdtemp(prefix="layout-hashes-")
    hf = _hf_folder(f"{out}/in/hf", rng)
    _f32_file(f"{out}/in/m.safetensors", rng)
    _gguf_file(f"{out}/in/m.gguf", rng)
    llama_template(f"{out}/in/t.gguf", hf)
    amax = {m: 1.5 + i / 8 for i, m in enumerate(
        f"model.layers.0.{p}" for p in ("self_attn.q_proj", "self_attn.k_proj",
                                        "self_attn.v_proj", "mlp.up_proj", "mlp.gate_proj",
                                        "mlp.down_proj"))}
    lines = []

    def run(case, fn, dst):
        rep = f"{out}/r/{case}.report.json"
        os.makedirs(os.path.dirname(rep), exist_ok=True)
        try:
            fn(report=rep)
        except CheckpointError as e:
            lines.append(f"{case}: refused: {e}".replace(out, "OUT"))
            return False
        lines.extend(f"{case}: {h}" for h in _hash_tree(dst, out))
        lines.extend(f"{case}: {h}" for h in _hash_tree(rep, out))
        return True

    quantized = []
    lowprec_cases = [("hf", "lowprec", f) for f in ("mxfp4", "mxfp8_e4m3", "nvfp4", "e4m3",
                                                    "mxfp6_e2m3", "mxfp4_b16")]
    lowprec_cases += [("hf", "gpt-oss", "mxfp4"), ("m", "lowprec", "mxfp4"),
                      ("m", "lowprec", "nvfp4"), ("m", "gpt-oss", "mxfp4")]
    engine_cases = [("hf", "compressed-tensors", s) for s in (
        "NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "MXFP6A16", "MXFP8A16", "FP8", "FP8_DYNAMIC",
        "FP8A16", "FP8A16_CHANNEL")]
    engine_cases += [("hf", "modelopt", s) for s in ("NVFP4A16", "NVFP4", "FP8", "FP8_DYNAMIC")]
    for src, layout, fmt in lowprec_cases + engine_cases:
        case = f"q-{src}-{layout}-{fmt}"
        dst = f"{out}/{case}" + (".safetensors" if src == "m" else "")
        path = f"{out}/in/hf" if src == "hf" else f"{out}/in/m.safetensors"
        kw = {}
        if fmt in ("NVFP4", "FP8"):
            kw["activation_amax"] = amax
        if run(case, lambda report, path=path, dst=dst, fmt=fmt, layout=layout, kw=kw:
               quantize_checkpoint(path, dst, fmt, layout=layout, report=report, **kw), dst):
            quantized.append((case, dst))
            lines.append(f"{case}: inspect {json.dumps(inspect_checkpoint(dst).options['layouts'])}")
    for case, src in quantized:
        dst = f"{out}/dq-{case}" + (".safetensors" if src.endswith(".safetensors") else "")
        run(f"dq-{case}", lambda report, src=src, dst=dst:
            dequantize_checkpoint(src, dst, report=report), dst)
        for layout in ("lowprec", "compressed-tensors", "modelopt"):
            for rq in (False, True):
                c = f"cv-{case}-{layout}" + ("-rq" if rq else "")
                dst = f"{out}/{c}" + (".safetensors" if src.endswith(".safetensors") else "")
                run(c, lambda report, src=src, dst=dst, layout=layout, rq=rq:
                    convert_checkpoint(src, dst, layout, requantize=rq, report=report), dst)
    # GGUF
    g = f"{out}/in/m.gguf"
    for fmt in ("mxfp4", "nvfp4"):
        q = f"{out}/gq-{fmt}.gguf"
        run(f"gq-{fmt}", lambda report, q=q, fmt=fmt: G.quantize_gguf(g, q, fmt, report=report), q)
        for dt in ("float32", "bfloat16"):
            d = f"{out}/gdq-{fmt}-{dt}.gguf"
            run(f"gdq-{fmt}-{dt}", lambda report, q=q, d=d, dt=dt:
                G.dequantize_gguf(q, d, dtype=dt, report=report), d)
        d = f"{out}/gdq-{fmt}.safetensors"
        run(f"gdqs-{fmt}", lambda report, q=q, d=d: G.dequantize_gguf(q, d, report=report), d)
        for layout in ("lowprec", "compressed-tensors", "modelopt"):
            d = f"{out}/g2s-{fmt}-{layout}.safetensors"
            run(f"g2s-{fmt}-{layout}", lambda report, q=q, d=d, layout=layout:
                G.convert_gguf(q, d, layout=layout, report=report), d)
            d2 = f"{out}/g2s-{fmt}-{layout}-nv.safetensors"
            run(f"g2s-{fmt}-{layout}-nv", lambda report, q=q, d=d2, layout=layout:
                G.convert_gguf(q, d, layout=layout, to="nvfp4", report=report), d2)
        d = f"{out}/g2g-{fmt}-nv.gguf"
        run(f"g2g-{fmt}-nv", lambda report, q=q, d=d: G.convert_gguf(q, d, to="nvfp4",
                                                                       report=report), d)
    for case, src in quantized:
        if src.endswith(".safetensors"):
            continue
        d = f"{out}/s2g-{case}.gguf"
        run(f"s2g-{case}", lambda report, src=src, d=d:
            G.convert_gguf(src, d, template=f"{out}/in/t.gguf", report=report), d)
        d = f"{out}/s2g-{case}-nv.gguf"
        run(f"s2g-{case}-nv", lambda report, src=src, d=d:
            G.convert_gguf(src, d, template=f"{out}/in/t.gguf", to="nvfp4", report=report), d)
    print("\n".join(lines))
    if "--keep" not in sys.argv:
        import shutil
        shutil.rmtree(out)


if __name__ == "__main__":
    main()
