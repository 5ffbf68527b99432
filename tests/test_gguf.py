"""GGUF (llama.cpp) read / write / requantize / convert, and the exact MXFP4 → NVFP4 cast.

Oracles: gguf-py's own ``gguf.quants`` (ggml's block bytes and decoders), gguf's reader and
writer (files written by llama.cpp's library, read back by it), the reference's MX decoder
(``lowprec_reference.mx``), and llama.cpp itself through llama-cpp-python (skipped when it
is not importable). Tensors are tiny: the whole file runs in seconds.
"""

import hashlib
import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import jax.numpy as jnp  # noqa: E402

import lowprec  # noqa: E402
from lowprec.checkpoint import CheckpointError, SafetensorsWriter, load_checkpoint  # noqa: E402
from lowprec.checkpoint import quantize_checkpoint  # noqa: E402
from lowprec.checkpoint import _gguf as G  # noqa: E402
from lowprec.cli import main  # noqa: E402
from lowprec_reference import mx as ref_mx  # noqa: E402
from helpers.gguf_files import llama_template, rope_rows, write_gguf  # noqa: E402

T = gguf.GGMLQuantizationType


#: The metadata every test GGUF carries beyond the block and head counts.
_KEYS = (("test.name", "tiny", gguf.GGUFValueType.STRING),
         ("test.ints", [3, 1, 4], gguf.GGUFValueType.ARRAY),
         ("test.f", 0.25, gguf.GGUFValueType.FLOAT32))


def _write(path, tensors, *, arch="llama", raw=None, extra=None):
    """A GGUF written by gguf's own writer: float32 ``tensors`` {name: array}, ``raw``
    {name: (uint8 bytes [.., nbytes], ggml type)} and metadata ``extra``."""
    keys = _KEYS + tuple((k, v[0], v[1]) for k, v in (extra or {}).items())
    return write_gguf(path, tensors, arch=arch, keys=keys, raw=raw)


def _llama_tensors(rng, layers=1, d=64, f=128, kv=32):
    t = {"token_embd.weight": rng.normal(size=(32, d)), "output_norm.weight": np.ones(d),
         "output.weight": rng.normal(size=(32, d))}
    for i in range(layers):
        t.update({f"blk.{i}.attn_norm.weight": np.ones(d),
                  f"blk.{i}.attn_q.weight": rng.normal(size=(d, d)),
                  f"blk.{i}.attn_k.weight": rng.normal(size=(kv, d)),
                  f"blk.{i}.ffn_down.weight": rng.normal(size=(d, f)),
                  f"blk.{i}.ffn_up.weight": rng.normal(size=(f, d)),
                  f"blk.{i}.ffn_gate_inp.weight": rng.normal(size=(4, d))})
    return {k: v.astype(np.float32) for k, v in t.items()}


def _raw(path):
    r = gguf.GGUFReader(str(path))
    return r, {t.name: (int(t.tensor_type), np.asarray(t.data).tobytes()) for t in r.tensors}


def _fields(reader):
    return {k: (f.types, f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


# -- requantizing a GGUF ------------------------------------------------------------------


def test_quantize_is_llama_cpp_mxfp4_and_keeps_everything_else(tmp_path):
    rng = np.random.default_rng(0)
    x = _llama_tensors(rng)
    x["blk.0.ffn_down_exps.weight"] = rng.normal(size=(3, 64, 96)).astype(np.float32)  # MoE, 3-D
    x["blk.0.attn_v.weight"] = rng.normal(size=(64, 48)).astype(np.float32)  # ne[0] % 32 != 0
    src = _write(tmp_path / "m.gguf", x)
    before = hashlib.sha256(src.read_bytes()).hexdigest()
    rep = G.quantize_gguf(src, tmp_path / "q.gguf", "mxfp4")
    assert hashlib.sha256(src.read_bytes()).hexdigest() == before  # input untouched
    r0, a = _raw(src)
    r1, b = _raw(tmp_path / "q.gguf")
    assert _fields(r0) == _fields(r1)  # every key, type and value, in order
    assert list(_fields(r0)) == list(_fields(r1))
    assert list(a) == list(b)
    quantized = {n for n, (t, _) in b.items() if t == T.MXFP4}
    assert quantized == {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight",
                         "blk.0.ffn_up.weight", "blk.0.ffn_down_exps.weight"}
    for n in a:
        if n in quantized:  # ggml's own quantizer (gguf-py's copy of it), byte for byte
            want = gguf.quants.quantize(x[n], T.MXFP4)
            assert b[n][1] == want.tobytes(), n
        else:
            assert b[n] == a[n], n
    assert {t.name for t in rep.quantized} == quantized
    assert all(t.sqnr_db > 15 for t in rep.quantized)


@pytest.mark.parametrize("rule, rounding", [("floor", "nearest_even"), ("rceil", None),
                                            ("even_e2m1", "nearest_even")])
def test_quantize_with_lowprec_rules(tmp_path, rule, rounding):
    """Another rule gives lowprec's quantize_mx bytes under that rule, nibbles in ggml's order,
    and decodes (through gguf's dequantize) to lowprec's dequantized values."""
    x = np.random.default_rng(1).normal(size=(4, 8, 64)).astype(np.float32)
    src = _write(tmp_path / "m.gguf", {"blk.0.ffn_up.weight": x})
    G.quantize_gguf(src, tmp_path / "q.gguf", "mxfp4", scale_rule=rule, rounding=rounding)
    _, b = _raw(tmp_path / "q.gguf")
    blocks = np.frombuffer(b["blk.0.ffn_up.weight"][1], np.uint8)
    kw = {} if rounding is None else {"rounding": rounding}
    want = np.asarray(lowprec.dequantize(lowprec.quantize_mx(jnp.asarray(x), "mxfp4",
                                                             scale_rule=rule, **kw)))
    got = gguf.quants.dequantize(blocks.reshape(4, 8, -1), T.MXFP4).reshape(x.shape)
    np.testing.assert_array_equal(got, want + 0.0)  # +0.0: ggml has no -0


def test_nvfp4_output_is_gguf_nvfp4_with_its_scale_tensor(tmp_path):
    x = np.random.default_rng(2).normal(size=(16, 128)).astype(np.float32) * 3
    src = _write(tmp_path / "m.gguf", {"blk.0.ffn_up.weight": x})
    G.quantize_gguf(src, tmp_path / "q.gguf", "nvfp4")
    r, b = _raw(tmp_path / "q.gguf")
    assert b["blk.0.ffn_up.weight"][0] == T.NVFP4 and b["blk.0.ffn_up.scale"][0] == T.F32
    ts = np.frombuffer(b["blk.0.ffn_up.scale"][1], np.float32)
    mx = lowprec.quantize_mx(jnp.asarray(x), "nvfp4")
    assert ts.tolist() == [float(mx.tensor_scale)]
    # gguf's decoder of the blocks, times the tensor scale, is lowprec's NVFP4 value: equal up
    # to the order of the two float32 products (e2m1 · (ts · s) here, (e2m1 · s) · ts there)
    blocks = np.frombuffer(b["blk.0.ffn_up.weight"][1], np.uint8).reshape(16, -1)
    got = gguf.quants.dequantize(blocks, T.NVFP4) * ts[0]
    np.testing.assert_allclose(got, np.asarray(lowprec.dequantize(mx)), rtol=2**-23, atol=0)
    # and the codes themselves are lowprec's (without the tensor scale both decode exactly)
    unit = lowprec.MXArray(mx.elements, mx.scales, "nvfp4", 1, x.shape,
                           tensor_scale=jnp.float32(1))
    np.testing.assert_array_equal(gguf.quants.dequantize(blocks, T.NVFP4),
                                  np.asarray(lowprec.dequantize(unit)) + 0.0)


def test_gguf_output_leaves_the_page_cache_tensor_by_tensor(tmp_path, monkeypatch):
    """As a safetensors output does, a GGUF output's bytes are released one tensor late:
    each release is exactly the prefix of the file that was final at the tensor before
    (the aligned header, then each tensor with its padding, ends read by gguf's own
    reader), never a byte past it; the output is byte for byte a run's without it."""
    from lowprec.checkpoint import _atomic

    released = []
    real = _atomic._release_range

    def release(fd, start, end):
        released.append((start, end))
        real(fd, start, end)

    rng = np.random.default_rng(6)
    src = _write(tmp_path / "m.gguf", _llama_tensors(rng))
    monkeypatch.setattr(_atomic, "_release_range", release)
    G.quantize_gguf(src, tmp_path / "q.gguf", "mxfp4")
    r = gguf.GGUFReader(str(tmp_path / "q.gguf"))
    align = int(r.alignment)
    finals = [-(-(int(t.data_offset) + int(t.n_bytes)) // align) * align for t in r.tensors]
    assert finals == sorted(finals) and finals[-1] == (tmp_path / "q.gguf").stat().st_size
    lagged = [0, 0, *finals[:-1]]
    assert released == [(lagged[k], lagged[k + 1]) for k in range(len(finals))]
    monkeypatch.setattr(_atomic, "_release_range", lambda fd, start, end: None)
    G.quantize_gguf(src, tmp_path / "plain.gguf", "mxfp4")
    assert (tmp_path / "q.gguf").read_bytes() == (tmp_path / "plain.gguf").read_bytes()


# -- reading: every type against gguf's decoder; what a reader refuses ---------------------


def test_decode_matches_gguf_dequantize(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 128)).astype(np.float32)
    nv = rng.integers(0, 256, size=(2, 2, 36), dtype=np.uint8)
    nv[..., :4] = rng.integers(0, 0x7F, size=(2, 2, 4))  # valid UE4M3 scales
    raw = {"q8": (gguf.quants.quantize(x, T.Q8_0), T.Q8_0),
           "bf": (gguf.quants.quantize(x, T.BF16), T.BF16),
           "mx": (gguf.quants.quantize(x, T.MXFP4), T.MXFP4),
           "nv": (nv.reshape(2, 72), T.NVFP4)}
    src = _write(tmp_path / "m.gguf", {"f32": x}, raw=raw)
    f = G.GGUFFile(src)
    np.testing.assert_array_equal(f.values("f32"), x)
    for n, (b, t) in raw.items():
        want = gguf.quants.dequantize(b, t).reshape(2, 128)
        np.testing.assert_array_equal(f.values(n), want + 0.0, err_msg=n)


def _patched(tmp_path, name, t, mutate):
    x = np.random.default_rng(4).normal(size=(2, 64)).astype(np.float32)
    if t in (T.MXFP4, T.Q8_0):
        b = gguf.quants.quantize(x, t)
    else:
        b = np.full((2, 36), 0x38, np.uint8)
    mutate(b)
    return _write(tmp_path / f"{name}.gguf", {}, raw={"blk.0.w.weight": (b, t)})


@pytest.mark.parametrize("case", ["e8m0_nan", "ue4m3_nan", "ue4m3_sign", "q8_inf"])
def test_reader_refuses_scales_without_a_value(tmp_path, case):
    t, mutate = {"e8m0_nan": (T.MXFP4, lambda b: b.__setitem__((1, 17), 0xFF)),
                 "ue4m3_nan": (T.NVFP4, lambda b: b.__setitem__((0, 2), 0x7F)),
                 "ue4m3_sign": (T.NVFP4, lambda b: b.__setitem__((1, 0), 0xB8)),
                 "q8_inf": (T.Q8_0, lambda b: b.__setitem__((1, slice(0, 2)), [0, 0x7C]))}[case]
    src = _patched(tmp_path, case, t, mutate)
    with pytest.raises(CheckpointError, match=r"blk\.0\.w\.weight.*(0xFF|0x7F|non-finite)"):
        G.GGUFFile(src).values("blk.0.w.weight")
    with pytest.raises(CheckpointError, match=r"blk\.0\.w\.weight"):
        G.dequantize_gguf(src, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_reader_refuses_unknown_types_and_bad_scales(tmp_path):
    q4k = np.zeros((1, 144), np.uint8)  # one Q4_K block of 256
    src = _write(tmp_path / "m.gguf", {"blk.0.s.scale": np.array([np.nan])},
                 raw={"blk.0.k.weight": (q4k, T.Q4_K),
                      "blk.0.s.weight": (np.full((1, 36), 0x38, np.uint8), T.NVFP4)})
    f = G.GGUFFile(src)
    with pytest.raises(CheckpointError, match=r"blk\.0\.k\.weight.*Q4_K"):
        f.values("blk.0.k.weight")
    with pytest.raises(CheckpointError, match=r"blk\.0\.s\.scale.*not a finite positive"):
        f.values("blk.0.s.weight")
    # requantizing copies what it does not decode; dequantizing refuses it, naming it
    G.quantize_gguf(src, tmp_path / "q.gguf", "mxfp4", exclude="blk.0.s")
    assert _raw(tmp_path / "q.gguf")[1]["blk.0.k.weight"] == _raw(src)[1]["blk.0.k.weight"]
    with pytest.raises(CheckpointError, match=r"blk\.0\.k\.weight.*Q4_K"):
        G.dequantize_gguf(src, tmp_path / "d.gguf")
    with pytest.raises(CheckpointError, match="not a GGUF"):
        G.GGUFFile(_write_bytes(tmp_path / "x.gguf", b"GGUF" + b"\x03\0\0\0" + b"\xff" * 8))


def _write_bytes(path, data):
    path.write_bytes(data)
    return path


def test_quantize_refuses_nan_inputs(tmp_path):
    x = np.ones((2, 64), np.float32)
    x[1, 3] = np.nan
    src = _write(tmp_path / "m.gguf", {"blk.0.ffn_up.weight": x})
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight.*NaN"):
        G.quantize_gguf(src, tmp_path / "q.gguf", "mxfp4")
    assert not (tmp_path / "q.gguf").exists()


# -- dequantize, inspect, the command line -------------------------------------------------


def test_cli_quantize_inspect_dequantize(tmp_path, capsys):
    x = _llama_tensors(np.random.default_rng(5))
    src = _write(tmp_path / "m.gguf", x)
    assert main(["quantize", str(src), str(tmp_path / "q.gguf"), "-f", "mxfp4", "-q"]) == 0
    assert main(["inspect", str(tmp_path / "q.gguf"), "--json"]) == 0
    inspected = json.loads(capsys.readouterr().out)
    fmts = {t["name"]: t["format"] for t in inspected["tensors"]}
    assert fmts["blk.0.attn_q.weight"] == "mxfp4" and fmts["token_embd.weight"] == "kept"
    assert main(["dequantize", str(tmp_path / "q.gguf"), str(tmp_path / "d.gguf"), "-q"]) == 0
    q, d = G.GGUFFile(tmp_path / "q.gguf"), G.GGUFFile(tmp_path / "d.gguf")
    assert d.tensors["blk.0.attn_q.weight"].type == T.F32
    for n in x:
        np.testing.assert_array_equal(d.values(n), q.values(n))
    assert _fields(q.reader) == _fields(d.reader)
    assert main(["dequantize", str(tmp_path / "q.gguf"), str(tmp_path / "d.safetensors"), "-q"]) == 0
    got = load_checkpoint(tmp_path / "d.safetensors")
    np.testing.assert_array_equal(got["blk.0.ffn_up.weight"], q.values("blk.0.ffn_up.weight"))
    # never the input; --rounding is for GGUF output
    assert main(["quantize", str(src), str(src), "-f", "mxfp4", "--force", "-q"]) == 1
    assert main(["quantize", str(tmp_path / "d.safetensors"), str(tmp_path / "x.safetensors"),
                 "-f", "mxfp4", "--rounding", "nearest_even", "-q"]) == 1
    assert "GGUF output only" in capsys.readouterr().err
    for opt in (["--axis", "0"], ["--block-size", "16"], ["--layout", "compressed-tensors"]):
        assert main(["quantize", str(src), str(tmp_path / "o.gguf"), "-f", "mxfp4", *opt]) == 1
        assert f"{opt[0]}: not for GGUF files" in capsys.readouterr().err
    assert not (tmp_path / "o.gguf").exists()


# -- convert: safetensors (every layout) <-> GGUF, losslessly -----------------------------


def _hf_folder(path, rng):
    """A Llama-shaped Hugging Face folder (4 heads of 16, 2 KV heads)."""
    os.makedirs(path)
    names = {"model.embed_tokens.weight": (32, 64), "lm_head.weight": (32, 64),
             "model.norm.weight": (64,), "model.layers.0.input_layernorm.weight": (64,),
             "model.layers.0.self_attn.q_proj.weight": (64, 64),
             "model.layers.0.self_attn.k_proj.weight": (32, 64),
             "model.layers.0.mlp.up_proj.weight": (128, 64),
             "model.layers.0.mlp.down_proj.weight": (64, 128)}
    t = {n: (rng.standard_normal(s) * 0.05).astype(np.float32) for n, s in names.items()}
    with SafetensorsWriter(f"{path}/model.safetensors", [(n, "F32", a.shape) for n, a in t.items()]) as f:
        for n, a in t.items():
            f.write(n, a)
    with open(f"{path}/config.json", "w") as f:
        json.dump({"model_type": "llama"}, f)
    return t


def _template(path, hf):
    """What convert_hf_to_gguf.py writes for ``hf`` (names by its table; Q/K permuted)."""
    return llama_template(path, hf, keys=_KEYS)


@pytest.mark.parametrize("fmt, layout", [("mxfp4", "compressed-tensors"), ("mxfp4", "lowprec"),
                                         ("mxfp4", "gpt-oss"), ("nvfp4", "modelopt")])
def test_convert_safetensors_to_gguf_is_lossless(tmp_path, fmt, layout):
    hf = _hf_folder(tmp_path / "hf", np.random.default_rng(6))
    tmpl, gname = _template(tmp_path / "t.gguf", hf)
    if layout == "modelopt":
        # ModelOpt's weight-only NVFP4 as lowprec writes it (a fused layer's q/k/v share one
        # tensor scale, as vLLM needs; a lowprec-layout file converted would be refused there).
        quantize_checkpoint(tmp_path / "hf", tmp_path / "q", "NVFP4A16", layout="modelopt")
    else:
        quantize_checkpoint(tmp_path / "hf", tmp_path / "q", fmt, layout=layout)
    want = load_checkpoint(tmp_path / "q")
    rep = G.convert_gguf(tmp_path / "q", tmp_path / "out.gguf", template=tmpl)
    out = G.GGUFFile(tmp_path / "out.gguf")
    t = G.GGUFFile(tmpl)
    assert _fields(out.reader) == _fields(t.reader)
    perm = {"blk.0.attn_q.weight": rope_rows(64, 4), "blk.0.attn_k.weight": rope_rows(32, 2)}
    replaced = set()
    for n, g in gname.items():
        if out.tensors[g].type in (T.MXFP4, T.NVFP4):
            replaced.add(n)
            w = want[n][perm[g]] if g in perm else want[n]
            np.testing.assert_array_equal(out.values(g), w + 0.0, err_msg=n)
        else:
            assert out.tensors[g].raw.tobytes() == t.tensors[g].raw.tobytes()
    assert replaced == {n for n in hf if ".layers." in n and hf[n].ndim == 2}
    if fmt == "nvfp4":  # ModelOpt's weight_scale_2 is ggml's .scale, moved as is
        from lowprec.checkpoint import SafetensorsReader
        with SafetensorsReader(tmp_path / "q/model.safetensors") as r:
            s2 = r.read("model.layers.0.mlp.up_proj.weight_scale_2")
        assert out.tensor_scale("blk.0.ffn_up.weight") == np.float32(s2.reshape(()))
    assert all(r.exact for r in rep.quantized)


def test_convert_refuses_what_cannot_be_exact(tmp_path):
    hf = _hf_folder(tmp_path / "hf", np.random.default_rng(7))
    tmpl, _ = _template(tmp_path / "t.gguf", hf)
    quantize_checkpoint(tmp_path / "hf", tmp_path / "q8", "mxfp8")
    with pytest.raises(CheckpointError, match="mxfp8.*mxfp4 and nvfp4"):
        G.convert_gguf(tmp_path / "q8", tmp_path / "o.gguf", template=tmpl)
    quantize_checkpoint(tmp_path / "hf", tmp_path / "q4", "mxfp4")
    with pytest.raises(CheckpointError, match="--template"):
        G.convert_gguf(tmp_path / "q4", tmp_path / "o.gguf")
    other = _write(tmp_path / "other.gguf", {"blk.0.attn_q.weight": np.zeros((64, 32))})
    with pytest.raises(CheckpointError, match="shape|no tensor"):
        G.convert_gguf(tmp_path / "q4", tmp_path / "o.gguf", template=other)
    # a template of another model (same names and shapes): its values disagree, refused
    fake, _ = _template(tmp_path / "fake.gguf", {n: np.random.default_rng(1).permutation(a)
                                                 for n, a in hf.items()})
    with pytest.raises(CheckpointError, match="does not match the template"):
        G.convert_gguf(tmp_path / "q4", tmp_path / "o.gguf", template=fake)
    assert not (tmp_path / "o.gguf").exists()


def test_convert_gguf_to_safetensors_and_back(tmp_path):
    x = _llama_tensors(np.random.default_rng(8))
    src = _write(tmp_path / "m.gguf", x)
    G.quantize_gguf(src, tmp_path / "q.gguf", "mxfp4")
    q = G.GGUFFile(tmp_path / "q.gguf")
    for layout in ("lowprec", "compressed-tensors"):
        dst = tmp_path / f"{layout}.safetensors"
        assert main(["convert", str(tmp_path / "q.gguf"), str(dst), "--layout", layout, "-q"]) == 0
        got = load_checkpoint(dst)
        for n, t in q.tensors.items():
            np.testing.assert_array_equal(got[n], q.values(n), err_msg=f"{layout} {n}")


# -- MXFP4 -> NVFP4, exact where E4M3 holds the scale ---------------------------------------


def _random_mxfp4(rng, shape, exponents):
    codes = rng.integers(0, 16, size=shape, dtype=np.uint8)
    scales = rng.choice(np.asarray(exponents) + 127, size=shape[:-1] + (shape[-1] // 32,)).astype(np.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return lowprec.MXArray(jnp.asarray(packed), jnp.asarray(scales), "mxfp4", len(shape) - 1,
                           shape), codes, scales


@pytest.mark.parametrize("exponents", [range(-20, -2), range(-30, 10), [-127, 0, 127]])
def test_mxfp4_to_nvfp4_exact_blocks_and_count(exponents):
    rng = np.random.default_rng(9)
    mx, codes, scales = _random_mxfp4(rng, (3, 4, 256), list(exponents))
    codes[0, 0, :32] = rng.choice([0, 8], size=32)  # a block of zeros: exact under any scale
    mx = lowprec.MXArray(jnp.asarray((codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)),
                         mx.scales, "mxfp4", 2, mx.shape)
    nv, rep = lowprec.mxfp4_to_nvfp4(mx)
    # the reference's decoders, before and after
    before = ref_mx.dequantize_mx(codes, scales, "mxfp4")
    after_codes = np.asarray(nv.elements)
    after_codes = np.stack([after_codes & 0xF, after_codes >> 4], -1).reshape(codes.shape)
    after = ref_mx.dequantize_mx(after_codes, np.asarray(nv.scales), "nvfp4",
                                 tensor_scale=np.float32(nv.tensor_scale))
    same = (before == after).reshape(-1, 32).all(axis=1)
    # brute force: the power-of-two tensor scale keeping the most non-zero blocks exact
    k = scales.reshape(-1).astype(int) - 127
    zero = ((codes.reshape(-1, 32) & 7) == 0).all(axis=1)
    t = np.arange(-126, 128)[:, None]
    best = ((t - 9 <= k[~zero]) & (k[~zero] <= t + 8)).sum(axis=1).max()
    assert rep.exact == best + zero.sum() and rep.blocks == k.size
    assert rep.requantized == k.size - rep.exact
    assert same.sum() >= rep.exact  # every block called exact decodes to itself
    inside = zero | ((k - rep.tensor_exponent >= -9) & (k - rep.tensor_exponent <= 8))
    assert same[inside].all() and inside.sum() == rep.exact
    assert (after_codes.reshape(-1, 32)[inside] == codes.reshape(-1, 32)[inside]).all()


def test_mxfp4_to_nvfp4_through_convert(tmp_path):
    x = _llama_tensors(np.random.default_rng(10))
    x["blk.0.ffn_up.weight"][0, :32] *= 2.0**-40  # one block far below the rest
    src = _write(tmp_path / "m.gguf", x)
    G.quantize_gguf(src, tmp_path / "q.gguf", "mxfp4")
    assert main(["convert", str(tmp_path / "q.gguf"), str(tmp_path / "n.gguf"), "--to", "nvfp4",
                 "-q", "--report", str(tmp_path / "r.json")]) == 0
    rep = json.load(open(tmp_path / "r.json"))
    casts = rep["options"]["casts"]
    assert casts["blk.0.ffn_up.weight"]["requantized"] == 1
    assert all(c["requantized"] == 0 for n, c in casts.items() if n != "blk.0.ffn_up.weight")
    q, n = G.GGUFFile(tmp_path / "q.gguf"), G.GGUFFile(tmp_path / "n.gguf")
    for name, t in n.tensors.items():
        if t.type == T.NVFP4:
            a, b = q.values(name), n.values(name)
            diff = (a != b).reshape(-1, 32).any(axis=1)
            assert diff.sum() <= casts[name]["requantized"], name


# -- llama.cpp itself loads what lowprec writes --------------------------------------------

V, D, F, H, HKV, L = 64, 64, 128, 4, 2, 2


def _tiny_llama(path, rng):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(D // H)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(V - 3)])
    w.add_token_scores([0.0] * V)
    w.add_token_types([2, 3, 3] + [1] * (V - 3))
    t = {"token_embd.weight": (V, D), "output_norm.weight": (D,), "output.weight": (V, D)}
    for i in range(L):
        t.update({f"blk.{i}.attn_norm.weight": (D,), f"blk.{i}.attn_q.weight": (D, D),
                  f"blk.{i}.attn_k.weight": (HKV * D // H, D),
                  f"blk.{i}.attn_v.weight": (HKV * D // H, D),
                  f"blk.{i}.attn_output.weight": (D, D), f"blk.{i}.ffn_norm.weight": (D,),
                  f"blk.{i}.ffn_gate.weight": (F, D), f"blk.{i}.ffn_up.weight": (F, D),
                  f"blk.{i}.ffn_down.weight": (D, F)})
    for n, s in t.items():
        a = 1 + 0.1 * rng.normal(size=s) if "norm" in n else rng.normal(size=s) / np.sqrt(s[-1])
        w.add_tensor(n, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _q8_simd(x):
    """ggml's x86/ARM SIMD ``quantize_row_q8_0`` round trip: d = fp16(amax / 127),
    q = rint(x · (127 / amax)) (ties to even)."""
    b = np.asarray(x, np.float32).reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, 0).astype(np.float32)
    return (np.rint(b * inv) * d).reshape(np.shape(x))


def _q8_scalar(x):
    """ggml's scalar ``quantize_row_q8_0_ref``: q = roundf(x / d) (ties away), as gguf-py."""
    x = np.asarray(x, np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(x, T.Q8_0), T.Q8_0).reshape(x.shape)


def _llama_forward(W, toks, q8, quantized):
    """Llama in NumPy float64 on GGUF-layout weights (Q/K rows already in llama.cpp's RoPE
    order: adjacent pairs rotate), with llama.cpp's one deliberate rounding of the CPU
    backend: inputs of matmuls with quantized weights go through Q8_0 (``q8``)."""
    def mm(x, n):
        return (q8(x) if n in quantized else x).astype(np.float64) @ W[n].T.astype(np.float64)

    def rms(x, w):
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * w

    hd, n = D // H, len(toks)
    ang = np.arange(n)[:, None] * 10000.0 ** (-np.arange(0, hd, 2) / hd)
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]

    def rope(x):
        out = np.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
        out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
        return out

    x = W["token_embd.weight"][toks].astype(np.float64)
    mask = np.tril(np.ones((n, n), bool))
    for i in range(L):
        h = rms(x, W[f"blk.{i}.attn_norm.weight"])
        q = rope(mm(h, f"blk.{i}.attn_q.weight").reshape(n, H, hd))
        k = np.repeat(rope(mm(h, f"blk.{i}.attn_k.weight").reshape(n, HKV, hd)), H // HKV, 1)
        v = np.repeat(mm(h, f"blk.{i}.attn_v.weight").reshape(n, HKV, hd), H // HKV, 1)
        sc = np.where(mask, np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd), -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + mm(np.einsum("hqk,khd->qhd", p, v).reshape(n, D), f"blk.{i}.attn_output.weight")
        h = rms(x, W[f"blk.{i}.ffn_norm.weight"])
        g, u = mm(h, f"blk.{i}.ffn_gate.weight"), mm(h, f"blk.{i}.ffn_up.weight")
        x = x + mm(g / (1 + np.exp(-g)) * u, f"blk.{i}.ffn_down.weight")
    return mm(rms(x, W["output_norm.weight"]), "output.weight")


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_llama_cpp_runs_a_lowprec_gguf(tmp_path, fmt):
    """llama.cpp (llama-cpp-python) loads a tiny random Llama requantized by lowprec to MXFP4
    (NVFP4: with its ``.scale`` tensors, which llama.cpp multiplies into the matmul outputs)
    and its logits are the NumPy forward pass of the weights gguf's own decoder reads from the
    file. Tolerance: llama.cpp's CPU backend rounds each quantized matmul's input to Q8_0
    (blocks of 32, d = fp16(amax/127)); the reference does the same (the SIMD or the scalar
    routine: one of them is the machine's), and what is left is float32 against float64
    arithmetic: ~2^-24 relative per operation over a few hundred operations in two layers,
    far below 1e-4 of the logits' scale. One Q8_0 step flipped, a nibble or a scale misread,
    moves logits by ~1e-2 to 1."""
    llama_cpp = pytest.importorskip("llama_cpp")
    rng = np.random.default_rng(11)
    _tiny_llama(tmp_path / "f32.gguf", rng)
    out = tmp_path / f"{fmt}.gguf"
    rep = G.quantize_gguf(tmp_path / "f32.gguf", out, fmt)
    assert len(rep.quantized) == 7 * L
    r = gguf.GGUFReader(str(out))
    W, quantized = {}, set()
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        W[t.name] = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        if t.tensor_type in (T.MXFP4, T.NVFP4):
            quantized.add(t.name)
    for name in quantized:  # NVFP4: the weight times its tensor scale
        if name[:-len("weight")] + "scale" in W:
            W[name] = W[name].astype(np.float64) * W.pop(name[:-len("weight")] + "scale")[0]
    toks = [1, 5, 9, 33, 60, 7, 2, 40]
    model = llama_cpp.Llama(str(out), n_ctx=64, logits_all=True,
                            verbose=False, n_threads=1, type_k=0, type_v=0, flash_attn=False)
    try:
        model.eval(toks)
        got = np.array(model.scores[:len(toks)], np.float64)
    finally:
        model.close()
    scale = np.abs(got).max()
    errs = [np.abs(got - _llama_forward(W, toks, q8, quantized)).max() for q8 in (_q8_simd, _q8_scalar)]
    assert min(errs) <= 1e-4 * scale, (errs, scale)
    # the check discriminates: the unquantized model's logits are far off
    W0 = {t.name: np.asarray(t.data).reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
          for t in gguf.GGUFReader(str(tmp_path / "f32.gguf")).tensors}
    assert np.abs(got - _llama_forward(W0, toks, _q8_simd, set())).max() > 100 * min(errs) + 1e-3


@pytest.mark.parametrize("layout", ["gpt-oss", "compressed-tensors"])
def test_mxfp4_to_nvfp4_cast_of_a_safetensors_file(tmp_path, layout):
    """``lowprec convert IN OUT --to nvfp4 --layout ...`` on a safetensors file in any layout:
    every value kept but those of the counted requantized blocks; other tensors copied."""
    rng = np.random.default_rng(12)
    w = rng.normal(size=(64, 128)).astype(np.float32)
    w[3, 64:96] *= 2.0**-40  # one block 40 binades below the rest: outside E4M3's 18
    norm = np.linspace(0.5, 1.5, 64, dtype=np.float32)
    with SafetensorsWriter(tmp_path / "m.safetensors", [("mlp.up.weight", "F32", w.shape),
                                                        ("norm.weight", "F32", norm.shape)]) as f:
        f.write("mlp.up.weight", w)
        f.write("norm.weight", norm)
    quantize_checkpoint(tmp_path / "m.safetensors", tmp_path / "q.safetensors", "mxfp4",
                        layout=layout)
    out = tmp_path / "nv.safetensors"
    assert main(["convert", str(tmp_path / "q.safetensors"), str(out), "--to", "nvfp4",
                 "--layout", "modelopt", "-q", "--report", str(tmp_path / "r.json")]) == 0
    cast = json.load(open(tmp_path / "r.json"))["options"]["casts"]["mlp.up.weight"]
    assert (cast["blocks"], cast["requantized"]) == (256, 1)
    a, b = load_checkpoint(tmp_path / "q.safetensors"), load_checkpoint(out)
    np.testing.assert_array_equal(b["norm.weight"], norm)
    differ = (a["mlp.up.weight"] != b["mlp.up.weight"]).reshape(-1, 32).any(axis=1)
    assert np.flatnonzero(differ).tolist() in ([], [3 * 4 + 2])  # only the far block may move


@pytest.mark.parametrize("layout", ["lowprec", "compressed-tensors"])
def test_mxfp4_to_nvfp4_cast_refuses_a_nan_block_naming_tensor_and_fix(tmp_path, capsys, layout):
    """An MXFP4 block whose E8M0 scale is the NaN code (0xFF: a NaN in the quantized input)
    has no exact NVFP4 counterpart (the cast keeps each code; NVFP4 has no per-block NaN
    scale that decodes those codes as the E8M0 one does): ``convert --to nvfp4`` refuses
    the file, naming the tensor, the block count and the fix, and writes nothing. (A GGUF
    MXFP4 tensor holds no NaN block: ggml's E8M0 has no NaN code.)"""
    w = np.random.default_rng(14).normal(size=(8, 64)).astype(np.float32)
    w[1, 40] = np.nan  # row 1's second block of 32: flat block 3
    with SafetensorsWriter(tmp_path / "m.safetensors", [("mlp.up.weight", "F32", w.shape)]) as f:
        f.write("mlp.up.weight", w)
    quantize_checkpoint(tmp_path / "m.safetensors", tmp_path / "q.safetensors", "mxfp4",
                        layout=layout)
    for out_layout in ("lowprec", "modelopt"):
        out = tmp_path / f"nv-{out_layout}.safetensors"
        assert main(["convert", str(tmp_path / "q.safetensors"), str(out), "--to", "nvfp4",
                     "--layout", out_layout, "-q"]) == 1, out_layout
        err = capsys.readouterr().err
        assert "'mlp.up.weight'" in err and "1 of its 16 MXFP4 blocks" in err, err
        assert "NaN" in err and "lowprec dequantize" in err and "-f nvfp4" in err, err
        assert "Traceback" not in err
        assert not out.exists()


def test_outputs_are_never_an_input_or_a_file_of_its_checkpoint(tmp_path, capsys):
    """A shard's checkpoint is its model folder: none of its files is an output, even with
    --force, for the GGUF verbs and the cast as for every other; a GGUF input likewise."""
    os.makedirs(tmp_path / "m")
    (tmp_path / "m/config.json").write_text('{"model_type": "llama"}')
    w = np.random.default_rng(13).normal(size=(64, 64)).astype(np.float32)
    with SafetensorsWriter(tmp_path / "src.safetensors", [("a.weight", "F32", w.shape)]) as f:
        f.write("a.weight", w)
    quantize_checkpoint(tmp_path / "src.safetensors", tmp_path / "m/model.safetensors", "mxfp4")
    shard, config = str(tmp_path / "m/model.safetensors"), str(tmp_path / "m/config.json")
    g = _write(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": w})
    for args in (["convert", shard, config, "--to", "nvfp4", "--layout", "lowprec"],
                 ["convert", str(g), str(g), "--to", "nvfp4"],
                 ["quantize", str(g), str(g), "-f", "mxfp4"],
                 ["quantize", str(g), str(tmp_path / "o.gguf"), "-f", "mxfp4", "--report",
                  str(g)]):
        assert main([*args, "--force", "-q"]) == 1, args
        err = capsys.readouterr().err
        assert "never" in err and "input" in err, err
    assert (tmp_path / "m/config.json").read_text() == '{"model_type": "llama"}'
    assert not (tmp_path / "o.gguf").exists()
