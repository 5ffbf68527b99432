"""Compiled for an H100 without one: every path's kernels, bytes and the cast-elision pitfall.

With the JAX CUDA plugin installed (``pip install -e '.[gpu-compile]'``) XLA compiles for a
compile-only H100 on a CPU-only machine (benchmarks/gpu_hlo_report.py: a
``GpuTargetConfigProto`` and ``jax.experimental.topologies``), so these run in CI without a
GPU; they are skipped when the plugin is absent. Run them with JAX on the CPU:
``JAX_PLATFORMS=cpu pytest -m gpu_compile tests/test_gpu_compile.py``.

Claims checked on XLA's optimized H100 module (not on timings):

* every Pallas kernel (the MX quantizer, the MX fake quantizer, the MXFP4 decode-time
  product for 1, 4 and 16 tokens) compiles to PTX for sm_90a, without register spills;
* quantize_mx (every E8M0 MX format, every scale rule, ggml's MXFP4 rule, along the last axis, and along
  axis 0 of a 2-D array for all but FP6; zero padding included), fake_quantize_mx (every E8M0 format) and dequantize (every E8M0 format,
  float32 and bfloat16, either axis) are one pass: one kernel streams the data (XLA sometimes adds a second over the per-block
  scales, 1/32 of the elements) and all move at most 1.1x the ideal bytes (the entry's
  parameters and result);
* MXFP8 dot_general (pre-quantized or quantized in the call) decodes in the GEMM's operand
  load: its bfloat16 branch is one Pallas kernel (no decoded operand in memory);
* the naive fake-quant ``x.astype(float8).astype(float32)`` is elided by this compile
  (openxla/xla#41605) while lowprec's fake quantization keeps its arithmetic.
"""

from __future__ import annotations

import os
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
@pytest.mark.parametrize("rule", lowprec.SCALE_RULES)
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
    """dot_general of MXFP8 operands: the branch taken when bfloat16 holds every value (a
    run-time check on the scales and codes) is one kernel, the Pallas GEMM that decodes
    codes and scales in its operand load; no decoded operand is written to memory. (The kernel
    is off by default, kernels/_dispatch.FUSED_MXDOT; this checks it where it is turned on.)"""
    a = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)
    dn = (((1,), (1,)), ((), ()))
    if operands == "pre-quantized":
        q = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "mxfp8", axis=1), a)
        hlo = _compile(lambda p, r: lowprec.dot_general(p, r, dn), q, q, dump_dir=str(tmp_path))
    else:
        hlo = _compile(lambda p, r: lowprec.dot_general(p, r, dn, lhs_format="mxfp8",
                                                        rhs_format="mxfp8"), a, a,
                       dump_dir=str(tmp_path))
    notes = [report.branch_note(hlo, b) for b in report.conditional_branches(hlo)]
    fused = [n for n in notes if "lowprec_mxdot" in n]
    assert len(fused) == 1, notes
    assert fused[0].endswith(": custom-call:__gpu$xla.gpu.triton (lowprec_mxdot)"), fused
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
