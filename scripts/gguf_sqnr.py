"""SQNR of ggml's MXFP4 rule (what llama.cpp's quantizer writes into GGUF files) against
lowprec's other rules, on Gaussian data and on real MiniLM weights and activations.

Each row is one tensor quantized along its last axis (blocks of 32; NVFP4: 16 under one
float32 tensor scale), SQNR = 10 log10(sum x^2 / sum (x - q)^2) in dB. Every rule's bytes
are checked elsewhere (tests/test_engine_rules.py, tests/test_gguf.py); this only measures.

    python scripts/gguf_sqnr.py           # prints the markdown table in README / docs
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

import lowprec

RULES = [  # (column, format, options)
    ("ggml: floor_log2f + toward 0", "mxfp4",
     dict(scale_rule="floor_log2f", rounding="nearest_toward_zero")),
    ("OCP floor + even", "mxfp4", dict(scale_rule="floor", rounding="nearest_even")),
    ("floor_log2f + even", "mxfp4", dict(scale_rule="floor_log2f", rounding="nearest_even")),
    ("rceil + even", "mxfp4", dict(scale_rule="rceil", rounding="nearest_even")),
    ("even_e2m1 + even", "mxfp4", dict(scale_rule="even_e2m1", rounding="nearest_even")),
    ("nvfp4 (lowprec)", "nvfp4", {}),
]


def sqnr(x, fmt, opts) -> float:
    q = np.asarray(lowprec.dequantize(lowprec.quantize_mx(jnp.asarray(x), fmt, **opts)),
                   np.float64)
    x = np.asarray(x, np.float64)
    return 10 * np.log10((x ** 2).sum() / ((x - q) ** 2).sum())


def tensors() -> dict:
    rng = np.random.default_rng(0)
    out = {"gaussian 1024x1024": rng.standard_normal((1024, 1024)).astype(np.float32),
           "student-t(4) 1024x1024": rng.standard_t(4, (1024, 1024)).astype(np.float32)}
    here = os.path.dirname(os.path.abspath(__file__))
    z = np.load(os.path.join(here, "..", "notebooks", "data", "minilm_sample.npz"))
    for k in z.files:
        if k != "meta_json":
            out[f"MiniLM {k}"] = z[k].astype(np.float32)
    return out


def changed(x, a: dict, b: dict) -> float:
    """Fraction of elements whose decoded MXFP4 value differs between options a and b."""
    qa, qb = (np.asarray(lowprec.dequantize(lowprec.quantize_mx(jnp.asarray(x), "mxfp4", **o)))
              for o in (a, b))
    return float(np.mean(qa != qb))


def main() -> None:
    cols = [c for c, _, _ in RULES] + ["elements ggml ≠ OCP"]
    print("| tensor | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, x in tensors().items():
        row = [f"{sqnr(x, fmt, opts):.3f}" for _, fmt, opts in RULES]
        row.append(f"{changed(x, RULES[0][2], RULES[1][2]):.1e}")
        print(f"| {name} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
