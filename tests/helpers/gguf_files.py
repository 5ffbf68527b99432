"""GGUF fixtures written by gguf's own writer (llama.cpp's Python library), shared by
tests/test_gguf.py and scripts/layout_hashes.py: a tiny llama GGUF and the template
llama.cpp's converter would write for a Hugging Face folder."""

from __future__ import annotations

import numpy as np

#: Hugging Face Llama names (layer 0) → the GGUF names convert_hf_to_gguf.py gives them.
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
    "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def write_gguf(path, tensors, *, arch="llama", keys=(), raw=None):
    """A GGUF of one block, 4 heads and 2 KV heads, then the metadata ``keys`` ((key,
    value, gguf.GGUFValueType) in order), the float32 ``tensors`` {name: array} and the
    ``raw`` ones {name: (uint8 bytes [.., nbytes], ggml type)}. Returns ``path``."""
    import gguf  # noqa: PLC0415 - an optional extra

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    for k, v, t in keys:
        w.add_key_value(k, v, t)
    for n, a in tensors.items():
        w.add_tensor(n, np.asarray(a, np.float32))
    for n, (b, t) in (raw or {}).items():
        w.add_tensor(n, b, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rope_rows(n_rows: int, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order, stated directly: GGUF row h·d + 2i + j is HF row
    h·d + j·d/2 + i (d = rows per head, i < d/2, j in {0, 1})."""
    d = n_rows // n_head
    return np.array([h * d + j * (d // 2) + i for h in range(n_head) for i in range(d // 2)
                     for j in range(2)])


def llama_template(path, hf: dict, *, keys=()):
    """What convert_hf_to_gguf.py writes for the Hugging Face tensors ``hf`` (4 heads of 16,
    2 KV heads): names by :data:`HF_TO_GGUF`, Q and K rows in llama.cpp's order. Returns
    (path, {HF name: GGUF name} of ``hf``'s tensors)."""
    perm = {"blk.0.attn_q.weight": rope_rows(64, 4), "blk.0.attn_k.weight": rope_rows(32, 2)}
    out = {}
    for n, a in hf.items():
        g = HF_TO_GGUF[n]
        a = np.asarray(a, np.float32)
        out[g] = a[perm[g]] if g in perm else a
    return write_gguf(path, out, keys=keys), {n: HF_TO_GGUF[n] for n in hf}
