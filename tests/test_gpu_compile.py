"""Compiled for an H100 without one: every path's kernels, bytes and the cast-elision pitfall.

With the JAX CUDA plugin installed (``pip install -e '.[gpu-compile]'``) XLA compiles for a
compile-only H100 on a CPU-only machine (benchmarks/gpu_hlo_report.py: a
``GpuTargetConfigProto`` and ``jax.experimental.topologies``), so these run in CI without a
GPU; they are skipped when the plugin is absent. Run them with JAX on the CPU:
``JAX_PLATFORMS=cpu pytest -m gpu_compile tests/test_gpu_compile.py``.

Claims checked on XLA's optimized H100 module (not on timings):

* every Pallas kernel (the MX quantizer, the MX fake quantizer, the MXFP4 decode-time
  product for 1, 4 and 16 tokens) compiles to PTX for sm_90a, without register spills;
* NVFP4 quantize_mx is one Pallas kernel given the tensor scale (1.0x the ideal bytes), two
  computing it (the largest magnitude first);
* the decode-time product of a prepared FP4 weight (``weight_only_matmul``, Mosaic GPU)
  spends at most 4 PTX instructions per weight element in its steady-state loop, at 1 and
  16 tokens alike, with no shuffles, no ``bar.sync`` and 16-byte fragment loads
  (``benchmarks/gpu_decode_ptx.py``);
* quantize_mx (every E8M0 MX format, every scale rule, ggml's MXFP4 rule, along the last axis, and along
  axis 0 of a 2-D array for all but FP6; zero padding included), fake_quantize_mx (every E8M0 format) and dequantize (every E8M0 format,
  float32 and bfloat16, either axis) are one pass: one kernel streams the data (XLA sometimes adds a second over the per-block
  scales, 1/32 of the elements) and all move at most 1.1x the ideal bytes (the entry's
  parameters and result);
* MXFP8 dot_general (pre-quantized or quantized in the call) decodes in the GEMM's operand
  load: its bfloat16 branch is one Pallas kernel (no decoded operand in memory);
* the naive fake-quant ``x.astype(float8).astype(float32)`` is elided by this compile
  (openxla/xla#41605) while lowprec's fake quantization keeps its arithmetic;
* every low-precision product's GEMMs (the GEMM view: a second compile with Triton's GEMM off,
  so that XLA lowers each dot to the cuBLAS call a device would weigh): every per-tensor FP8
  product is cuBLASLt's FP8 GEMM of float8 operands made from lowprec's codes (E4M3 x E4M3
  forward, E5M2 x E4M3 gradients, precision HIGHEST), no FP8/MX/NVFP4 product has a float32
  GEMM or a conditional, and the MXFP8 product is three kernels: two one-pass decodes and the
  GEMM.
"""

from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
import pytest

import lowprec
from helpers.kernels import fused_mxdot  # noqa: F401  (a fixture)
from lowprec._options import MXCast

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))
import gpu_hlo_report as report  # noqa: E402

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(not report.cuda_plugin_available(),
                       reason="needs the JAX CUDA plugin: pip install -e '.[gpu-compile]'"),
    # With the plugin but no GPU, JAX started without JAX_PLATFORMS=cpu has tried and dropped
    # the CUDA backend, and the compile-only topology is then unavailable in this process.
    pytest.mark.skipif(report.cuda_plugin_available()
                       and os.environ.get("JAX_PLATFORMS", "") != "cpu",
                       reason="the CUDA plugin is installed: run these with JAX_PLATFORMS=cpu "
                              "(JAX_PLATFORMS=cpu pytest -n 0 -m gpu_compile "
                              "tests/test_gpu_compile.py)"),
]

SHAPE = (1024, 4096)
X = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
# E8M0 formats whose quantization the one-pass kernel serves along both axes (FP6: the
# last axis; along axis 0 it keeps XLA's passes).
ONE_PASS_QUANTIZE = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "mxint8")
E8M0 = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8")
MAX_TRAFFIC = 1.1


def _compile(fn, *specs, dump_dir=None):
    return report.compile_hlo(fn, specs, "h100", dump_dir)


def _assert_one_pass(hlo: str, what: str):
    """One kernel streams the data (XLA may add one over per-block values: 1/32 of the
    elements) and all kernels together move at most 1.1x the ideal bytes."""
    s = report.summarize(hlo)
    assert s["passes"] == 1, f"{what}: {s['passes']} passes ({s['kinds']}; {s['notes']})"
    assert s["traffic_over_ideal"] <= MAX_TRAFFIC, (
        f"{what}: {s['traffic_over_ideal']:.2f}x the ideal bytes ({s['kinds']})")


def test_the_compile_is_for_an_h100():
    dev = report.compile_only_device("h100")
    assert dev.platform == "gpu" and dev.device_kind == "NVIDIA H100 80GB HBM3"
    hlo = _compile(lambda v: v * 2.0, X)
    assert "fusion" in hlo or "multiply" in hlo


@pytest.mark.parametrize("fmt", E8M0)
@pytest.mark.parametrize("rule", [r.value for r in lowprec.ScaleRule])
def test_quantize_mx_is_one_pass(fmt, rule):
    hlo = _compile(lambda v: lowprec.quantize_mx(v, fmt, scale_rule=rule), X)
    _assert_one_pass(hlo, f"quantize_mx {fmt} {rule}")
    assert "lowprec_quantize_mx" in hlo  # the Pallas kernel, chosen on CUDA


@pytest.mark.parametrize("axis", [-1, 0])
def test_ggml_mxfp4_quantize_is_one_pass(axis):
    """ggml's rule (floor_log2f scales, ties toward zero) runs in the same Pallas kernel."""
    kw = dict(scale_rule="floor_log2f", rounding="nearest_toward_zero", axis=axis)
    for f, kernel in ((lambda v: lowprec.quantize_mx(v, "mxfp4", **kw), "lowprec_quantize_mx"),
                      (lambda v: lowprec.fake_quantize_mx(v, "mxfp4", **kw),
                       "lowprec_fake_quantize_mx")):
        hlo = _compile(f, X)
        _assert_one_pass(hlo, f"ggml mxfp4 axis {axis}")
        assert kernel in hlo


@pytest.mark.parametrize("fmt", ONE_PASS_QUANTIZE)
def test_padded_and_axis_0_quantize_mx_is_one_pass(fmt):
    x = jax.ShapeDtypeStruct((SHAPE[0], SHAPE[1] - 16), jnp.float32)
    for f in (lambda v: lowprec.quantize_mx(v, fmt, pad=True),
              lambda v: lowprec.fake_quantize_mx(v, fmt, pad=True),
              lambda v: lowprec.quantize_mx(v, fmt, axis=0, pad=True),
              lambda v: lowprec.fake_quantize_mx(v, fmt, axis=0, pad=True)):
        _assert_one_pass(_compile(f, x), f"{fmt} pad=True")


@pytest.mark.parametrize("fmt", E8M0)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_dequantize_is_one_pass(fmt, dtype, axis):
    mx = jax.eval_shape(lambda v: lowprec.quantize_mx(v, fmt, axis=axis), X)
    hlo = _compile(lambda m: lowprec.dequantize(m, dtype), mx)
    _assert_one_pass(hlo, f"dequantize {fmt}")
    assert "conditional" not in hlo
    # The pass is compute-bound on a GPU. Measured on an H200: 73 operations per element
    # (MXFP8 to float32: two decodes and a per-block select) ran at 1.2 TB/s, 0.47x JAX's
    # astype * scale; one bit-built decode (43, 65 to bfloat16) at 1.54, 0.62x. Element
    # values read from a table and the scale applied on the output's own bits take 33-35
    # (FP6, decoded arithmetically: 48-49).
    ops = sum(report.fused_op_counts(hlo).values())
    bound = 52 if lowprec.mx_format(fmt).element.code_bits == 6 else 38
    assert ops <= bound, f"dequantize {fmt}: {ops} fused operations"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_nvfp4_dequantize_is_one_pass(dtype, axis):
    """NVFP4 dequantize streams the codes once: before, XLA turned the whole-array choice of
    product (a ``lax.cond``) into a select of both branches over materialized operands and
    unpacked codes (11 kernels, 4.6x the ideal bytes; 0.57 TB/s on an H200). Per-block
    values (the float32 factor and its flags: 7 bytes per 16-element block, written and
    read once) are the only other traffic."""
    mx = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "nvfp4", axis=axis, tensor_scale=1.0), X)
    hlo = _compile(lambda m: lowprec.dequantize(m, dtype), mx)
    s = report.summarize(hlo)
    assert s["passes"] == 1, f"nvfp4: {s['passes']} passes ({s['kinds']}; {s['notes']})"
    assert s["traffic_over_ideal"] <= 1.25, f"nvfp4: {s['traffic_over_ideal']:.2f}x ({s['kinds']})"
    assert "conditional" not in hlo


@pytest.mark.parametrize("step", ["divide", "reciprocal"])
def test_nvfp4_quantize_is_one_kernel_given_its_tensor_scale_and_two_computing_it(step, tmp_path):
    """NVFP4 quantize_mx on CUDA (issue 32 item 5; before: 6 kernels, 3.3x the ideal bytes):
    given the tensor scale, one Pallas kernel reading x once (1.0x the ideal bytes); computing
    it, a first kernel for the largest magnitude (x read twice: 8 + 0.56 bytes per element
    where one pass moves 4.56, 1.9x), no XLA fusion between. No register spills."""
    for ts, kernels, traffic in ((1.0, 1, MAX_TRAFFIC), (None, 2, 1.9)):
        dump = tmp_path / f"ts{ts}"
        hlo = _compile(lambda v: lowprec.quantize_mx(v, "nvfp4", tensor_scale=ts,
                                                     nvfp4_step=step), X, dump_dir=str(dump))
        s = report.summarize(hlo)
        assert s["kernels"] == kernels and s["passes"] == kernels, (ts, s["kinds"], s["notes"])
        assert s["traffic_over_ideal"] <= traffic, (ts, s["traffic_over_ideal"], s["kinds"])
        stats = report.ptx_kernel_stats(sorted(map(str, dump.glob("*.ptx"))), "sm_90a")
        mine = {n: v for n, v in stats.items() if "lowprec_" in n}
        assert len(mine) == kernels, sorted(stats)
        for name, (regs, spill_st, spill_ld) in mine.items():
            assert spill_st == spill_ld == 0, f"{name}: {regs} registers, spills {spill_st}/{spill_ld} B"


@pytest.mark.parametrize("fmt", E8M0)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_fake_quantize_mx_is_one_pass(fmt, dtype):
    hlo = _compile(lambda v: lowprec.fake_quantize_mx(v, fmt),
                   jax.ShapeDtypeStruct(SHAPE, dtype))
    _assert_one_pass(hlo, f"fake_quantize_mx {fmt}")
    assert "lowprec_fake_quantize_mx" in hlo


@pytest.mark.parametrize("m", [1, 4, 16])
def test_mxfp4_decode_product_compiles_without_spills(m, tmp_path):
    n, k = 2880, 2880
    w = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "mxfp4", axis=1),
                       jax.ShapeDtypeStruct((n, k), jnp.float32))
    t = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    hlo = _compile(lambda a, b: lowprec.dot_general(a, b, (((1,), (1,)), ((), ()))), t, w,
                   dump_dir=str(tmp_path))
    assert "lowprec_mxfp4_matmul" in hlo
    stats = report.ptx_kernel_stats(sorted(map(str, tmp_path.glob("*.ptx"))), "sm_90a")
    kernels = {name: v for name, v in stats.items() if "lowprec_mxfp4_matmul" in name}
    assert kernels, f"no PTX for the kernel among {sorted(stats)}"
    for name, (regs, spill_st, spill_ld) in kernels.items():
        assert spill_st == spill_ld == 0, f"{name}: {regs} registers, spills {spill_st}/{spill_ld} B"
    if m == 16:  # the tensor-core path loads each step's packed tile in wide vectors
        ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx") if "lowprec_mxfp4" in p.read_text())
        assert "ld.global.b8" not in ptx and "ld.global.u8" not in ptx, "byte loads of weights"


@pytest.mark.parametrize("operands", ["pre-quantized", "quantized in the call"])
def test_mxfp8_matmul_decodes_in_the_dot_operand_load(operands, tmp_path, fused_mxdot):
    """dot_general of MXFP8 operands with the fused kernel turned on: the product (no
    branch: the GPU route has no run-time check) is one kernel, the Pallas GEMM that decodes
    codes and scales in its operand load; no decoded operand is written to memory. (The kernel
    is off by default, the policy's fused_mxdot; this checks it where it is turned on.)"""
    a = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)
    dn = (((1,), (1,)), ((), ()))
    if operands == "pre-quantized":
        q = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "mxfp8", axis=1), a)
        hlo = _compile(lambda p, r: lowprec.dot_general(p, r, dn), q, q, dump_dir=str(tmp_path))
    else:
        hlo = _compile(lambda p, r: lowprec.dot_general(p, r, dn, lhs_format="mxfp8",
                                                        rhs_format="mxfp8"), a, a,
                       dump_dir=str(tmp_path))
    assert not report.conditional_branches(hlo)
    assert "lowprec_mxdot" in hlo and hlo.count('custom_call_target="__gpu$xla.gpu.triton"') == 1
    assert " dot(" not in hlo and "__cublas" not in hlo  # no other GEMM
    stats = report.ptx_kernel_stats(sorted(map(str, tmp_path.glob("*.ptx"))), "sm_90a")
    kernels = {name: v for name, v in stats.items() if "lowprec_mxdot" in name}
    assert kernels and all(st == ld == 0 for _, st, ld in kernels.values()), kernels


@pytest.mark.parametrize("kernel", ["quantize", "fake_quantize"])
@pytest.mark.parametrize("fmt", E8M0)
def test_pallas_quantize_kernels_compile_without_spills(kernel, fmt, tmp_path):
    from lowprec.kernels import _quantize_pallas as qp

    cast = MXCast(lowprec.mx_format(fmt), "rceil", "nearest_even")
    fn = getattr(qp, f"{kernel}_mx_pallas")
    hlo = _compile(lambda v: fn(v, cast), X, dump_dir=str(tmp_path))
    _assert_one_pass(hlo, f"Pallas {kernel} {fmt}")
    stats = report.ptx_kernel_stats(sorted(map(str, tmp_path.glob("*.ptx"))), "sm_90a")
    kernels = {name: v for name, v in stats.items() if f"lowprec_{kernel}_mx" in name}
    assert kernels, f"no PTX for the kernel among {sorted(stats)}"
    for name, (regs, spill_st, spill_ld) in kernels.items():
        assert spill_st == spill_ld == 0, f"{name}: {regs} registers, spills {spill_st}/{spill_ld} B"


def test_cast_pair_elision_reproduces_and_lowprec_is_immune():
    """openxla/xla#41605 in this compile: the naive fake-quant compiles to a copy of its
    input (no convert left), while lowprec's encode and MX fake quantization keep their
    arithmetic and hold no float8/float4 type to elide."""
    v = jax.ShapeDtypeStruct((4096,), jnp.float32)
    naive = _compile(lambda x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32), v)
    entry = naive[naive.index("\nENTRY"):]
    if "convert" in entry or "fusion" in entry:
        pytest.skip(f"this XLA (jax {jax.__version__}) no longer elides the cast pair")
    assert "copy(" in entry or "bitcast(" in entry
    for name, fn in (("quantize e4m3", lambda x: lowprec.quantize(x, "e4m3")),
                     ("fake_quantize_mx mxfp8", lambda x: lowprec.fake_quantize_mx(
                         x.reshape(128, 32), "mxfp8").reshape(-1))):
        hlo = _compile(fn, v)
        s = report.summarize(hlo)
        # Its arithmetic is there: in XLA fusions, or in the Pallas kernel's Triton module
        # (carried in the custom call: integer shifts of the bit-level encode and decode).
        kept = s["fused_ops"] > 10 or ("__gpu$xla.gpu.triton" in hlo and "shrui" in hlo)
        assert s["kernels"] >= 1 and kept, f"{name} compiled to nothing: {s}"
        assert "f8e4m3" not in hlo.lower() and "f4e2m1" not in hlo.lower(), name


# -- the decode-time product of a prepared FP4 weight (Mosaic GPU, issue 32 item 4) --------------

import gpu_decode_ptx as decode_ptx  # noqa: E402

DECODE_SHAPE = (4096, 4096)


@pytest.fixture(scope="module")
def decode_kernels():
    """The Mosaic GPU kernel compiled for an H100 per format, scale arithmetic and tokens."""
    from lowprec.kernels import _weight_only_mgpu

    if not _weight_only_mgpu.mosaic_gpu_available():
        pytest.skip("this JAX has no Pallas Mosaic GPU backend")
    return {(fmt, one, m): decode_ptx.mgpu_kernel(fmt, one, m, DECODE_SHAPE)
            for fmt in ("mxfp4", "nvfp4") for one in (True, False) for m in (1, 16)}


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("one", [True, False], ids=["one-multiply", "two-multiply"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_decode_kernel_loop_is_within_four_ptx_instructions_per_weight_element(
        fmt, one, m, decode_kernels):
    """The steady-state loop of the compute warpgroups: at most 4 PTX instructions per weight
    element (benchmarks/gpu_decode_ptx.py counts them), no register spills, no warp shuffle
    and no bar.sync (stages are handed over by mbarriers), one 16-byte shared-memory load of
    weight words per 64×64 tile and thread, and four wgmma per tile (one per k16 slice)."""
    r = decode_kernels[(fmt, one, m)]
    loop, tiles = r["loop"], r["config"]["tiles_per_step"]
    assert r["per_element"] <= decode_ptx.BUDGET, (r["per_element"], loop.summary)
    assert r["spilled_bytes"] == 0 and 0 < r["registers"] <= 255, r["registers"]
    assert loop.shuffles == 0 and loop.barriers == 0, loop.summary
    assert loop.loads_16b == tiles, loop.summary
    assert loop.tensor_core == 4 * tiles, loop.summary
    assert not re.search(r"\bld\.shared\.(u|b|s)8\b", r["ptx"]), "byte loads from shared memory"


@pytest.mark.parametrize("one", [True, False], ids=["one-multiply", "two-multiply"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_decode_kernel_costs_the_same_for_1_and_16_tokens(fmt, one, decode_kernels):
    a, b = decode_kernels[(fmt, one, 1)], decode_kernels[(fmt, one, 16)]
    assert a["loop"].instructions == b["loop"].instructions, (a["loop"].summary, b["loop"].summary)


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_weight_only_matmul_streams_the_prepared_weight_once(fmt, m):
    """weight_only_matmul compiles to the kernel and one small XLA fusion (the K splits' sum,
    the tensor scale, NaN rows); at one token every kernel together moves at most 1.1x the
    ideal bytes (weight, tokens, result), at 16 at most 1.5x (the splits' float32 partial
    sums, M × N each, written and read once)."""
    from lowprec.kernels import _weight_only_mgpu

    if not _weight_only_mgpu.mosaic_gpu_available():
        pytest.skip("this JAX has no Pallas Mosaic GPU backend")
    pw = decode_ptx._spec(fmt, DECODE_SHAPE, True)
    x = jax.ShapeDtypeStruct((m, DECODE_SHAPE[1]), jnp.bfloat16)
    hlo = _compile(lambda a, w: lowprec.weight_only_matmul(a, w), x, pw)
    assert "mosaic_gpu_v2" in hlo
    s = report.summarize(hlo)
    assert s["kernels"] <= 2, s["kinds"]
    assert s["traffic_over_ideal"] <= (1.1 if m == 1 else 1.5), (s["traffic_over_ideal"], s["kinds"])
@pytest.mark.quick_cases(mk=[(8, 96)])
@pytest.mark.parametrize("mk", [(8, 96), (12, 96), (16, 200), (3, 40), (1, 96)],
                         ids=lambda v: f"m{v[0]}-k{v[1]}")
def test_weight_only_kernel_lowers_for_any_tokens_and_k(mk):
    """The prepared-weight kernel lowers for token counts and K that are not whole TMA tiles
    of x ((8, 64): a dimension is whole tiles or below one). Before x was padded, K = 96 at
    8 tokens ([2, 4, 96] activations) failed to lower on an H200 ("dimension 1 must have size
    smaller or a multiple of its tiling 64, but got 96"); the lowering runs here too."""
    from lowprec.kernels import _weight_only_mgpu

    if not _weight_only_mgpu.mosaic_gpu_available():
        pytest.skip("this JAX has no Pallas Mosaic GPU backend")
    m, k = mk
    pw = decode_ptx._spec("mxfp4", (200, k), True)
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    hlo = _compile(lambda a, w: lowprec.weight_only_matmul(a, w), x, pw)
    assert "mosaic_gpu_v2" in hlo


# -- the GEMM view ---------------------------------------------------------------------------------

PRODUCT_N = 512
#: Every per-tensor FP8 product of report.product_cases: its GEMMs must be cuBLASLt's FP8 GEMM.
FP8_PRODUCTS = (
    "dot_general e4m3 x e4m3", "dot_general e4m3 x e5m2",
    "dot_general e4m3 x e4m3, quantized backward (grad e5m2)", "fp8_hybrid fwd + bwd",
    "delayed_dot_general fwd + bwd", "flax linen Dense, DelayedDotGeneral, fwd + bwd",
    "flax linen Dense, quantize_model FP8_HYBRID, fwd + bwd",
    "flax nnx Linear, DelayedDotGeneralNnx, fwd + bwd",
)
#: The other low-precision products: bfloat16 GEMMs (block formats), no float32 one.
BLOCK_PRODUCTS = (
    "dot_general mxfp8_e4m3 x mxfp8_e4m3", "dot_general mxfp8_e5m2 x mxfp8_e4m3",
    "dot_general mxfp6_e2m3 x mxfp6_e2m3", "dot_general mxfp4 x mxfp4",
    "dot_general mxint8 x mxint8", "dot_general nvfp4 x nvfp4",
    "dot_general mxfp8 pre-quantized", "nvidia_mxfp8 fwd + bwd", "ocp_mxfp8 fwd + bwd",
    "nvidia_nvfp4 fwd + bwd",
    # Ragged dots: MXFP8's blocks as bfloat16; FP8_HYBRID's scales are per group and per
    # expert (not per tensor), so its codes stay bfloat16 values (exact) for XLA's ragged dot.
    "nvidia_mxfp8 ragged_dot (4 experts)", "fp8_hybrid ragged_dot (4 experts)",
)
QUICK_PRODUCTS = ("dot_general e4m3 x e5m2", "delayed_dot_general fwd + bwd",
                  "fp8_hybrid fwd + bwd", "dot_general nvfp4 x nvfp4", "nvidia_mxfp8 fwd + bwd")
# Float8 values made by a float -> float8 convert (XLA's own rounding, and the cast pair it
# may fold away), or by a bitcast of integer codes (lowprec's encoder's: XLA lowers the
# same-width bitcast_convert_type to a bitcast).
_F8_CONVERT = re.compile(r"= f8e\w+\[[\d,]*\]\{[\d,]*\} convert\(")
_F8_BITCAST = re.compile(r"= f8e\w+\[[\d,]*\]\{[\d,]*\} bitcast\(")


@pytest.fixture(scope="module")
def products():
    return report.product_cases(PRODUCT_N)


def test_the_product_lists_cover_every_product():
    """Every lowprec product of the report is held below (and the peers are left out)."""
    names = set(report.product_cases(64))
    ours = {n for n in names if not n.startswith("peer:")}
    listed = set(FP8_PRODUCTS) | set(BLOCK_PRODUCTS)
    assert ours == listed, ours ^ listed


@pytest.mark.quick_cases(name=QUICK_PRODUCTS)
@pytest.mark.parametrize("name", FP8_PRODUCTS + BLOCK_PRODUCTS)
def test_low_precision_products_take_low_precision_gemms(name, products):
    fn, *specs = products[name]
    hlo = report.compile_gemm_hlo(fn, specs, "h100")
    gemms = report.gemm_view(hlo)
    labels = [report.gemm_label(g) for g in gemms]
    three = "fwd + bwd" in name or "backward" in name
    assert len(gemms) == (3 if three else 1), labels  # a ragged dot: one GEMM in its loop
    assert not any("f32" in g["operands"] for g in gemms), labels  # no float32 GEMM
    assert "conditional" not in hlo  # no run-time branch
    if name in FP8_PRODUCTS:
        assert all(g["target"] == "__cublas$lt$matmul$f8" for g in gemms), labels
        assert all(g["precision"].upper() == "HIGHEST" for g in gemms), labels  # fast acc. off
        pairs = sorted(tuple(sorted(g["operands"])) for g in gemms)
        if name == "dot_general e4m3 x e5m2":
            assert pairs == [("f8e4m3fn", "f8e5m2")]
        elif three:  # forward E4M3 x E4M3, both gradients E5M2 cotangent x E4M3 operand
            assert pairs == [("f8e4m3fn", "f8e4m3fn")] + [("f8e4m3fn", "f8e5m2")] * 2, labels
        else:
            assert pairs == [("f8e4m3fn", "f8e4m3fn")]
        assert _F8_BITCAST.search(hlo) and not _F8_CONVERT.search(hlo)
    else:
        assert all(g["operands"] == ("bf16", "bf16") for g in gemms), labels


_GEMM_FUSION = re.compile(r"^%(gemm_fusion\S*) \((.*?)\) -> ", re.M)


@pytest.mark.quick_cases(name=["delayed_dot_general fwd + bwd", "nvidia_mxfp8 fwd + bwd"])
@pytest.mark.parametrize("name", FP8_PRODUCTS + BLOCK_PRODUCTS)
def test_products_keep_low_precision_operands_in_the_triton_gemm_fusions(name, products):
    """The default compile (XLA's Triton GEMM on, as on a device, where the autotuner then
    weighs each fusion against cuBLAS): every GEMM fusion takes its two operands as float8
    (FP8 products) or bfloat16 (block products), never float32. Scales folded into an FP8
    operand (``convert(a) * sa``) stayed outside the fusion, so XLA wrote the operand out as
    float32 and, on an H200, autotuned it to a float32 GEMM: the delayed-scaling training
    step ran 52 ms against bfloat16's 5.9 (2026-11-28). The GEMM view compiles with Triton
    off and showed cuBLASLt's FP8 GEMM all the same."""
    fn, *specs = products[name]
    hlo = report.compile_hlo(fn, specs, "h100")
    fusions = [(n, params) for n, params in _GEMM_FUSION.findall(hlo)]
    three = "bwd" in name or "backward" in name
    assert len(fusions) == (3 if three else 1), fusions  # a ragged dot: one in its loop
    for fusion, params in fusions:
        operand_types = re.findall(r": (\w+)\[[\d,]+\]", params)  # arrays, not scalars
        if name in FP8_PRODUCTS:
            assert sum(t.startswith("f8e") for t in operand_types) == 2, (fusion, params)
        else:
            assert operand_types[:2] == ["bf16", "bf16"], (fusion, params)


def _scaling_passes(hlo: str) -> list:
    """The fused computations that only multiply an array by a broadcast scalar: a pass over
    memory doing what a GEMM's epilogue could (their names)."""
    passes = []
    for name, body in re.findall(r"^%(fused_\S*) \(.*?\{\n(.*?)\n\}", hlo, re.M | re.S):
        # The array instructions (scalar ones compute the factor).
        ops = re.findall(r"= \w+\[\d[\d,]*\](?:\{[\d,]*\})? (\w[\w-]*)\(", body)
        work = {o for o in ops if o not in ("parameter", "broadcast", "bitcast")}
        if work == {"multiply"}:
            passes.append(name)
    return passes


@pytest.mark.quick_cases(name=["fp8_hybrid fwd + bwd"])
@pytest.mark.parametrize("name", [n for n in FP8_PRODUCTS if "bwd" in n or "backward" in n])
def test_fp8_scales_fold_into_the_gemms(name, products):
    """The FP8 products' per-tensor scales all reach cuBLASLt's FP8 GEMMs: no
    pass over a product's output is left that only multiplies it by a scalar. The forward
    output and each float32 gradient were multiplied by two powers of two in turn; XLA
    folded one into the GEMM and left the other as a pass (three here; in a d = 4096
    transformer block's step, 1.6 of its 8.6 GB of non-GEMM traffic)."""
    fn, *specs = products[name]
    hlo = report.compile_gemm_hlo(fn, specs, "h100")
    assert report.gemm_view(hlo), "no GEMM"
    assert _scaling_passes(hlo) == []


def test_peers_take_the_fp8_gemm_too(products):
    """The comparison the GEMM view rests on: XLA's own float8 dot and Flax's
    Fp8DotGeneralOp form cuBLASLt's FP8 GEMM in this compile (the target names its CUDA
    runtime; without one XLA never forms it)."""
    for name in ("peer: XLA float8 dot (x.astype(float8_e4m3fn))",
                 "peer: flax linen Fp8DotGeneralOp Dense, fwd + bwd"):
        fn, *specs = products[name]
        gemms = report.gemm_view(report.compile_gemm_hlo(fn, specs, "h100"))
        assert gemms and all(g["target"] == "__cublas$lt$matmul$f8" for g in gemms), gemms


@pytest.mark.parametrize("operands", ["pre-quantized", "quantized in the call"])
def test_mxfp8_product_is_two_decodes_and_a_gemm(operands):
    """MXFP8 dot_general in the default compile (XLA's Triton GEMM): each operand decoded to
    bfloat16 in one pass, then the GEMM; no conditional, no reduction over the codes. Before:
    10 kernels, 1.86x the ideal bytes, 8 reductions and a conditional per call (the run-time
    bfloat16 check). Pre-quantized the traffic is the decodes' (1 + 1/32 bytes read, 2
    written per element of each operand) and the GEMM's (2 + 2 read, 4 written): 14.06 / 6.06
    = 2.32x the ideal (codes, scales and the float32 result)."""
    a = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)
    dn = (((1,), (1,)), ((), ()))
    if operands == "pre-quantized":
        q = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "mxfp8", axis=1), a)
        fn, specs = (lambda p, r: lowprec.dot_general(p, r, dn)), (q, q)
    else:
        fn = lambda p, r: lowprec.dot_general(p, r, dn, lhs_format="mxfp8",  # noqa: E731
                                              rhs_format="mxfp8")
        specs = (a, a)
    s = report.summarize(_compile(fn, *specs))
    assert "conditional" not in s["notes"], s
    if operands == "pre-quantized":
        assert s["kernels"] == 3 and "reduction" not in s["notes"], s
        assert s["traffic_over_ideal"] <= 2.33, s
