"""The engines' own MX quantizer rules, against the engines' code run here.

* compressed-tensors / llm-compressor (MXFP4, MXFP8; MXFP6 from compressed-tensors 0.20):
  ``ScaleRule.EVEN_E2M1`` (``EVEN`` for E2M3), elements rounded to nearest even. Checked
  against compressed-tensors' own ``calculate_qparams`` and compressors (imported when
  installed) and against what llm-compressor's ``oneshot`` wrote (tests/data/llmc_mx.npz,
  made by scripts/make_llmc_fixture.py; regenerated here when LOWPREC_LLMC_PYTHON names an
  interpreter with llm-compressor).
* ggml (llama.cpp, gguf-py): ``ScaleRule.FLOOR_LOG2F`` with
  ``Rounding.NEAREST_TOWARD_ZERO``, against ``gguf.quants``' own MXFP4 quantize and
  dequantize; its NVFP4 scale encoder (``fp32_to_ue4m3``) and decoder against the
  reference's statement of llama.cpp's NVFP4 quantizer (``lowprec_reference.ggml``).

Where the engines differ from lowprec, the tests pin the difference exactly (the sign of a
zero, undefined casts of tiny or non-finite blocks) rather than skipping the inputs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lowprec
import lowprec_reference as ref
from lowprec._scale_rules import log2f_exponent

DATA = Path(__file__).parent / "data"
MODES = ("eager", "jit")


def _quantize(x, fmt, mode, **kw):
    f = lambda v: lowprec.quantize_mx(v, fmt, **kw)  # noqa: E731
    return (jax.jit(f) if mode == "jit" else f)(jnp.asarray(x))


def _unpacked(codes, fmt: str) -> np.ndarray:
    bits = lowprec.mx_format(fmt).element.code_bits
    return ref.unpack_codes(np.asarray(codes), bits) if bits < 8 else np.asarray(codes)


def _neg_zero_code(fmt: str) -> int:
    el = lowprec.mx_format(fmt).element
    return 1 << el.magnitude_bits  # the sign bit alone


def tie_heavy(rng, shape) -> np.ndarray:
    """float32 blocks of 32 along the last axis whose maxima sit on the thresholds of every
    scale rule (significands 1, 1.25, ..., 1.96875) and whose elements are multiples of
    amax / 64 (every E2M1, E2M3 and E4M3 rounding boundary under these scales), with signs,
    -0.0 included."""
    blocks = (*shape[:-1], shape[-1] // 32)
    sig = rng.choice([1.0, 1.25, 1.5, 1.625, 1.75, 1.875, 1.9375, 1.96875], blocks)
    amax = sig * 2.0 ** rng.integers(-9, 3, blocks)
    x = rng.integers(0, 65, (*blocks, 32)) / 64.0 * amax[..., None]
    x = x * rng.choice([-1.0, 1.0], x.shape)
    x[..., 0] = amax
    return x.reshape(shape).astype(np.float32)


def near_powers_of_two(rng, shape) -> np.ndarray:
    """float32 blocks whose maxima lie 0 to 49 float32 ulps below 2^k (k in [-100, 100]),
    where float32's log2 rounds up to k for the first 1 to 44 of them."""
    blocks = (*shape[:-1], shape[-1] // 32)
    top = (2.0 ** rng.integers(-100, 100, blocks)).astype(np.float32)
    amax = (top.view(np.uint32) - rng.integers(0, 50, blocks).astype(np.uint32)).view(np.float32)
    x = (rng.uniform(-1, 1, (*blocks, 32)) * amax[..., None]).astype(np.float32)
    x[..., 5] = -amax
    return x.reshape(shape)


# -- floor(log2f): the float32 logarithm's rounding, exactly -------------------------------


def _near_powers_of_two_f32() -> np.ndarray:
    """Every positive float32 within 96 ulps below and 2 above 2^k, k = -149 ... 127."""
    tops = np.float32(2.0) ** np.arange(-149, 128, dtype=np.float32)
    offsets = np.arange(-2, 97, dtype=np.int64)
    bits = tops.view(np.uint32).astype(np.int64)[:, None] - offsets[None, :]
    return bits[(bits > 0) & (bits < 0x7F80_0000)].astype(np.uint32).view(np.float32)


def test_log2f_exponent_is_numpys_and_cs_floor_of_log2f():
    """log2f_exponent (integer thresholds) = floor(float32 log2), as NumPy computes it for
    gguf-py and glibc's log2f for llama.cpp, on every float32 near a power of two (where the
    rounding of the logarithm matters) and on random float32 of every binade."""
    rng = np.random.default_rng(0)
    v = np.concatenate([_near_powers_of_two_f32(),
                        rng.integers(1, 0x7F80_0000, 1 << 16).astype(np.uint32).view(np.float32)])
    exponent = jax.jit(log2f_exponent)
    got = np.asarray(exponent(jnp.asarray(v.view(np.uint32))))
    want = np.floor(np.log2(v)).astype(np.int64)  # float32 in, float32 out
    np.testing.assert_array_equal(got, want)
    # It is not floor(log2) computed exactly: 1 to 44 float32 below 2^k round up.
    assert (got != np.floor(np.log2(v.astype(np.float64)))).sum() > 5000
    libm = ctypes.util.find_library("m")
    if libm:
        log2f = ctypes.CDLL(libm).log2f
        log2f.restype, log2f.argtypes = ctypes.c_float, [ctypes.c_float]
        near = _near_powers_of_two_f32()[::7]
        c = np.array([np.floor(log2f(float(a))) for a in near])
        np.testing.assert_array_equal(np.asarray(exponent(jnp.asarray(near.view(np.uint32)))), c)


# -- ggml: gguf-py's MXFP4 ---------------------------------------------------------------------


def ggml_mxfp4_blocks(mx) -> np.ndarray:
    """ggml's ``block_mxfp4`` bytes ``[..., n / 32, 17]`` of an MXFP4 MXArray blocked along
    its last axis (ggml-common.h: byte 0 the E8M0 scale; byte 1 + j holds element j in its
    low nibble and element j + 16 in its high one). ggml's E2M1 table has no -0 (kvalues[8]
    is 0) and its quantizer writes every zero as code 0, so lowprec's -0 code 0x8 is written
    as 0x0: the same value."""
    codes = _unpacked(mx.elements, "mxfp4")
    codes = np.where(codes == 0x8, 0, codes).reshape(*codes.shape[:-1], -1, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([np.asarray(mx.scales)[..., None], qs], axis=-1).astype(np.uint8)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["gaussian", "ties", "near_powers_of_two"])
def test_ggml_rule_is_gguf_mxfp4_quantize_and_dequantize(kind, mode):
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(["gaussian", "ties", "near_powers_of_two"].index(kind))
    shape = (2, 24, 128)  # [batch, seq, d]
    x = {"gaussian": lambda: (rng.standard_normal(shape) * 0.02).astype(np.float32),
         "ties": lambda: tie_heavy(rng, shape),
         "near_powers_of_two": lambda: near_powers_of_two(rng, shape)}[kind]()
    want = gguf.quants.quantize(x, T.MXFP4).reshape(*shape[:-1], -1, 17)
    mx = _quantize(x, "mxfp4", mode, scale_rule="floor_log2f", rounding="nearest_toward_zero")
    got = ggml_mxfp4_blocks(mx)
    np.testing.assert_array_equal(got[..., 0], want[..., 0], err_msg="E8M0 scales")
    np.testing.assert_array_equal(got, want)
    # Values: lowprec's dequantize is gguf's, up to the sign of zeros (+0 in ggml).
    back = gguf.quants.dequantize(want.reshape(*shape[:-1], -1), T.MXFP4)
    np.testing.assert_array_equal(np.asarray(lowprec.dequantize(mx)) + np.float32(0), back)
    # The data discriminates: the OCP rule or ties to even would not give ggml's bytes.
    for other in ({"scale_rule": "floor", "rounding": "nearest_toward_zero"},
                  {"scale_rule": "floor_log2f", "rounding": "nearest_even"}):
        if kind == "gaussian" or (kind == "ties") != (other["rounding"] == "nearest_even"):
            continue
        assert (ggml_mxfp4_blocks(_quantize(x, "mxfp4", mode, **other)) != want).any(), other


def test_ggml_tiny_and_non_finite_blocks_are_where_lowprec_differs():
    """ggml writes floor(log2f(amax)) - 2 + 127 as uint8 without a clamp: for block maxima
    below 2^-125 the value is negative, a cast C leaves undefined (gguf-py's NumPy wraps it
    to 255, 254, ..., decoding the block to zeros); lowprec clamps to code 0 (2^-127) as
    every rule does. A block holding NaN or inf gets gguf-py's (undefined) cast of NaN
    (scale 0 here) and zero codes; lowprec's NaN scale 0xFF."""
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as T

    x = np.zeros((4, 32), np.float32)
    x[0, :2] = [2.0**-125, -(2.0**-126)]  # the smallest maximum ggml encodes: code 0
    x[1, :2] = [1.5 * 2.0**-127, 2.0**-128]  # below: ggml's scale wraps
    x[2, :2] = [1.0, np.nan]
    x[3, :2] = [np.inf, 1.0]
    with np.errstate(invalid="ignore", over="ignore"):
        want = gguf.quants.quantize(x, T.MXFP4).reshape(4, 17)
        back = gguf.quants.dequantize(want.reshape(4, 17), T.MXFP4)
    got = ggml_mxfp4_blocks(lowprec.quantize_mx(jnp.asarray(x), "mxfp4", scale_rule="floor_log2f",
                                                rounding="nearest_toward_zero")).reshape(4, 17)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1, 0] == 0 and want[1, 0] > 127 and (back[1] == 0).all()  # wrapped: zeros
    assert (got[2:, 0] == 0xFF).all() and (want[2:, 1:] == 0).all()


# -- ggml: NVFP4 (gguf-py decodes it and has llama.cpp's scale encoder; no quantizer) ---------


def test_ggml_nvfp4_scale_encoder_is_gguf_fp32_to_ue4m3():
    """The reference's statement of ggml's UE4M3 scale encoder (ggml_fp32_to_ue4m3) against
    gguf-py's vectorized copy of it, on every multiple of 2^-10 from 0 to 512 (every rounding
    boundary of the normal and the subnormal codes), the
    float32 neighbours of every code's value and midpoint, and random float32."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(3)
    values = np.array([float(ref.decode("e4m3", np.array([c], np.uint8))[0]) for c in range(0x7F)])
    mids = (values[1:] + values[:-1]) / 2
    around = np.concatenate([values, mids, mids * 512 + 0.5, [0.5 / 512 - 2.0**-35]]).astype(
        np.float32)
    around = np.concatenate([np.nextafter(around, np.float32(0)), around,
                             np.nextafter(around, np.float32(np.inf))])
    x = np.concatenate([np.arange(0, 512, 2.0**-10).astype(np.float32), around,
                        rng.uniform(0, 600, 1 << 16).astype(np.float32), [np.float32(1e30)]])
    x = x[x >= 0]
    want = gguf.quants.NVFP4.fp32_to_ue4m3(x)
    got = ref.ggml_ue4m3(x)
    np.testing.assert_array_equal(got, want)
    assert set(np.unique(got).tolist()) <= set(range(0x78)) | {0x7E}  # never 256 ... 416


def test_ggml_nvfp4_decode_is_gguf_dequantize():
    """ggml_nvfp4_decode (reference) of every scale code with every element code, in ggml's
    block layout, is gguf-py's NVFP4 dequantize."""
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(4)
    scales = np.arange(256, dtype=np.uint8).reshape(-1, 4)  # 64 blocks of 4 sub-blocks
    codes = rng.integers(0, 16, (64, 64)).astype(np.uint8)
    blocks = ref.ggml_nvfp4_blocks(codes, scales)
    want = gguf.quants.dequantize(blocks.reshape(-1), T.NVFP4).reshape(64, 64)
    np.testing.assert_array_equal(ref.ggml_nvfp4_decode(codes, scales), want)


# -- compressed-tensors and llm-compressor -----------------------------------------------------

# preset -> (lowprec format, compressed-tensors compression format, rule, fraction bits the
# rule keeps of a block maximum, whether compressed-tensors writes an input -0.0 as +0: its
# FP4 cast multiplies by torch.sign(x), its FP8 quantize adds the zero point 0, and
# -0 + 0 = +0; its FP6 cast copies the sign)
CT_PRESETS = {
    "MXFP4A16": ("mxfp4", "mxfp4-pack-quantized", "even_e2m1", 1, True),
    "MXFP8A16": ("mxfp8_e4m3", "mxfp8-quantized", "even_e2m1", 1, True),
    "MXFP6A16": ("mxfp6_e2m3", "mxfp6-pack-quantized", "even", 3, False),  # >= 0.20
}


def _ct_scheme(preset):
    ct = pytest.importorskip("compressed_tensors.quantization")
    if preset not in ct.quant_scheme.PRESET_SCHEMES:
        pytest.skip(f"compressed-tensors {_ct_version()} has no {preset}")
    return ct.preset_name_to_scheme(preset, ["Linear"])


def _ct_version():
    import compressed_tensors

    return compressed_tensors.__version__


def _ct_scale_codes(amax, preset):
    """E8M0 codes compressed-tensors stores for blocks whose largest magnitudes are ``amax``
    (a torch tensor in the weight's dtype): its qparams (what llm-compressor's min-max
    observer hands it), then its MX scale compression."""
    from compressed_tensors.compressors.mx_utils import compress_mx_scale
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    import torch

    scale, _ = calculate_qparams(torch.zeros_like(amax), amax, _ct_scheme(preset).weights)
    return compress_mx_scale(scale, torch.uint8).numpy()


@pytest.mark.parametrize("preset", list(CT_PRESETS))
def test_compressed_tensors_scales_of_every_bfloat16_maximum(preset):
    """Every positive finite bfloat16 block maximum: compressed-tensors' code is lowprec's
    rule's, except where compressed-tensors' rounding of the maximum reaches 2^128 = inf
    (from (2 - 2^-(m+1)) x 2^127, m the fraction bits kept): its scale is inf, its stored
    code 127, and the block quantizes to zeros."""
    torch = pytest.importorskip("torch")
    _ct_scheme(preset)
    fmt, _, rule, m, _ = CT_PRESETS[preset]
    bits = np.arange(1, 0x7F80, dtype=np.uint16)
    amax = bits.view(ml_dtypes.bfloat16)
    want = _ct_scale_codes(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16), preset)
    x = jnp.asarray(amax.astype(np.float32))[:, None]
    got = np.asarray(lowprec.shared_exponents(x, fmt, scale_rule=rule, pad=True))[:, 0] + 127
    overflow = amax.astype(np.float64) >= (2 - 2.0 ** -(m + 1)) * 2.0**127
    np.testing.assert_array_equal(got[~overflow], want[~overflow])
    assert (want[overflow] == 127).all() and overflow.sum() == 2 ** (6 - m)  # of 2^7 per binade
    # FLOOR and RCEIL are not compressed-tensors' rule: they differ in every binade (for
    # E4M3, RCEIL only at the significand 1.75, which compressed-tensors rounds up).
    for other in ("floor", "rceil"):
        alt = np.asarray(lowprec.shared_exponents(x, fmt, scale_rule=other, pad=True))[:, 0] + 127
        assert (alt[~overflow] != want[~overflow]).sum() >= 200  # 246 binades unclamped


def _ct_compress(w, preset):
    """compressed-tensors' own weight compression of ``w`` (torch, [out, in]) under preset:
    ``(codes, scales)`` as uint8 arrays, codes as stored (packed for FP4/FP6)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = _ct_scheme(preset)
    groups = w.reshape(w.shape[0], -1, 32)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    compressor = BaseCompressor.get_value_from_registry(CT_PRESETS[preset][1])
    out = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp},
                              scheme)
    codes = out.get("weight_packed", out.get("weight"))
    return codes.contiguous().view(torch.uint8).numpy(), out["weight_scale"].numpy()


def assert_engine_codes(x, fmt, mx, codes, scales, what, plus_zero=True):
    """lowprec's MXArray ``mx`` of ``x`` holds the engine's scale codes exactly and its
    element codes everywhere, but where ``plus_zero``: at -0.0 inputs, which
    compressed-tensors' FP4 and FP8 casts write as +0 (code 0)."""
    np.testing.assert_array_equal(np.asarray(mx.scales), scales.reshape(mx.scales.shape),
                                  err_msg=f"{what}: scales")
    got = _unpacked(mx.elements, fmt)
    want = _unpacked(codes.reshape(np.asarray(mx.elements).shape), fmt)
    x = np.asarray(x, np.float32)
    neg_zero = (x == 0) & np.signbit(x)
    if not plus_zero:
        neg_zero[...] = False
    np.testing.assert_array_equal(got[~neg_zero], want[~neg_zero], err_msg=f"{what}: elements")
    assert (got[neg_zero] == _neg_zero_code(fmt)).all() and (want[neg_zero] == 0).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["gaussian", "ties"])
@pytest.mark.parametrize("preset", list(CT_PRESETS))
@pytest.mark.quick_cases(mode=("jit",))
def test_compressed_tensors_compressors_write_lowprec_codes(preset, kind, dtype, mode):
    torch = pytest.importorskip("torch")
    _ct_scheme(preset)
    fmt, _, rule, _, plus_zero = CT_PRESETS[preset]
    rng = np.random.default_rng(["gaussian", "ties"].index(kind) * 8 + len(preset) + len(dtype))
    x = (rng.standard_normal((64, 256)) * 0.03).astype(np.float32) if kind == "gaussian" \
        else tie_heavy(rng, (64, 256))
    w = torch.from_numpy(x).to(getattr(torch, dtype))
    codes, scales = _ct_compress(w, preset)
    xl = jnp.asarray(w.float().numpy()).astype(dtype)  # the same bfloat16 values
    mx = _quantize(xl, fmt, mode, scale_rule=rule)
    assert_engine_codes(w.float().numpy(), fmt, mx, codes, scales, f"{preset} {kind} {dtype}",
                        plus_zero)


LLMC_PRESETS = {"MXFP4A16": "mxfp4", "MXFP8A16": "mxfp8_e4m3"}


def _check_llmc_archive(z):
    for dtype in ("bfloat16", "float32"):
        for preset, fmt in LLMC_PRESETS.items():
            for name in ("q_proj", "k_proj", "gate_proj"):
                bits = z[f"{dtype}/{name}/input_bits"]
                x = (bits.view(np.uint16).view(ml_dtypes.bfloat16) if dtype == "bfloat16"
                     else bits.view(np.float32))
                codes = z[f"{dtype}/{preset}/{name}/codes"]
                scales = z[f"{dtype}/{preset}/{name}/scales"]
                mx = lowprec.quantize_mx(jnp.asarray(x), fmt, scale_rule="even_e2m1")
                assert_engine_codes(x.astype(np.float32), fmt, mx, codes, scales,
                                    f"llm-compressor {preset} {dtype} {name}")
                # The weights tell the rules apart: the OCP rule and NVIDIA's do not match.
                for other in ("floor", "rceil"):
                    alt = lowprec.quantize_mx(jnp.asarray(x), fmt, scale_rule=other)
                    if name != "q_proj":  # Gaussian blocks rarely reach rceil's difference
                        assert (np.asarray(alt.scales) != scales.reshape(alt.scales.shape)).any()


def test_llm_compressor_output_is_lowprecs_even_e2m1():
    """What llm-compressor 0.14's oneshot wrote for MXFP4A16 and MXFP8A16 (its MXFP4 and
    MXFP8 presets quantize weights alike) in bfloat16 and float32 models, Gaussian,
    tie-heavy and near-threshold weights: lowprec's ``even_e2m1`` codes."""
    z = np.load(DATA / "llmc_mx.npz")
    versions = json.loads(str(z["versions"]))
    assert versions["llmcompressor"].startswith("0.14")
    for dtype in ("bfloat16", "float32"):
        assert str(z[f"{dtype}/MXFP4A16/format"]) == "mxfp4-pack-quantized"
        assert str(z[f"{dtype}/MXFP8A16/format"]) == "mxfp8-quantized"
    _check_llmc_archive(z)


@pytest.mark.slow
def test_llm_compressor_run_here_matches_the_archive(tmp_path):
    """Reruns llm-compressor (LOWPREC_LLMC_PYTHON: an interpreter with llm-compressor, which
    needs its own environment) and checks its output as the archive's, and equal to it."""
    python = os.environ.get("LOWPREC_LLMC_PYTHON")
    if not python:
        try:
            import llmcompressor  # noqa: F401
            python = sys.executable
        except ImportError:
            pytest.skip("set LOWPREC_LLMC_PYTHON to an interpreter with llm-compressor")
    out = tmp_path / "llmc_mx.npz"
    script = Path(__file__).parents[1] / "scripts" / "make_llmc_fixture.py"
    subprocess.run([python, str(script), str(out)], check=True, capture_output=True,
                   timeout=900)
    fresh, archived = np.load(out), np.load(DATA / "llmc_mx.npz")
    _check_llmc_archive(fresh)
    for key in archived.files:
        if key != "versions":
            np.testing.assert_array_equal(fresh[key], archived[key], err_msg=key)
