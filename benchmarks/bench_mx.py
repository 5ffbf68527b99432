"""MX block quantize/dequantize throughput: lowprec vs JAX's own MXFP8 quantizer and NumPy.

Run: ``python benchmarks/bench_mx.py`` (CPU: a (4096, 4096) float32 array, about a minute
on a 2-core CPU; GPU: (16384, 16384)), ``--quick`` ((1024, 1024), fewer rounds),
``--shape 2048 8192``, ``--reps R``, ``--formats mxfp8_e4m3``, ``--json PATH``.

For each MX format (mxfp8_e4m3, mxfp8_e5m2, mxfp4) one interleaved timing group (see
``_timing.py``) holds:

* ``lowprec``: ``jax.jit(lambda x: lowprec.quantize_mx(x, fmt, scale_rule=rule))`` for every
  scale rule (floor, ceil, even, rceil), blocks along the last axis, and
  ``jax.jit(lowprec.dequantize)`` (→ float32) of the rceil codes; ``dequantize (axis 0)``
  dequantizes the codes of the transposed array blocked along axis 0, the layout of a
  weight [K, N] (lowprec splits blocks in place, without a transpose).
* ``JAX``: ``jax._src.cudnn.scaled_matmul_stablehlo.quantize(x, BlockScaleConfig(mode=
  "mxfp8", block_size=32, data_type=<element dtype>, scale_type=float8_e8m0fnu,
  global_scale=None, infer_only=False))``, jitted: amax / max_elem rounded up to a power of
  two (the ``rceil`` rule), a float division, clip, ``astype``. For mxfp4 the same function
  with ``data_type=float4_e2m1fn`` (JAX has no MXFP4 quantizer; its output is one float4 per
  byte, unpacked, while lowprec packs two per byte). Its dequantize peer is JAX's own
  ``q.astype(f32) * scale.astype(f32)`` per block (the element and scale dtypes' converts,
  one per byte), jitted, in the same layout as lowprec's row (for axis 0 the blocks are
  reshaped along axis 0 likewise). For a format without ml_dtypes element or scale types
  the JAX peers are n/a.
* ``NumPy``: a vectorized NumPy + ml_dtypes baseline written here (blocks → amax →
  exponent via ``np.frexp`` → multiply by the block's power of two → clip → ``astype``; FP4
  packed two per byte like lowprec), one implementation per scale rule, and its dequantize.
  Finite inputs only (no NaN/Inf block handling), E8M0 scales only. Skipped on GPU runs.
* The other block formats: MXFP6 (E2M3, E3M2; codes packed four per three bytes),
  MXINT8 (elements ``clip(rint(v * 64), -127, 127)`` as int8 in the NumPy baseline), MXFP4
  with blocks of 16 (``mxfp4_b16``) and NVFP4, whose only "rule" is its own recipe
  (``nvfp4``: torchao's float32 steps, vectorized in the NumPy baseline). NVFP4's JAX peer is
  ``quantize`` in ``mode="nvfp4"`` (E4M3 scales, ``global_scale`` = amax / 2688 computed in
  the call); JAX divides x by the global scale first, another rounding order than torchao's,
  so its code mismatches are informative. XLA has no FP6 type: no JAX peers for MXFP6, nor
  for MXINT8.
* ``stream``: ``x ^ c`` over a uint32 array of the input's size, the memory-bandwidth peer
  of the ``roof`` column (lowprec's bytes moved per second over the stream's).

Columns: elements/s (input elements / median seconds) and effective bandwidth = (bytes read
+ bytes written) / seconds, counted from each method's own inputs and outputs (float32 in;
uint8 or float8 codes, packed FP4 bytes for lowprec and NumPy, one byte per FP4 for JAX,
and one scale byte per block). Ratios divide throughputs measured in the same rounds
(median over rounds of the per-round ratio). The ceil/even rows have no JAX peer (JAX only
implements rceil); their JAX ratio is against JAX's rceil quantizer, marked ``*``.
``faults`` is lowprec's median minor page faults per call (see ``_timing.py``).

Targets (issue 23): on CPU, quantize of every OCP MX format (E8M0 scales, 32-element
blocks) under every rule ≥ 2x JAX's rceil quantizer (where JAX has one) and ≥ 50% of the
streaming roof; NVFP4 quantize ≥ 25% of roof; MXFP6 dequantize ≥ 60% of roof; dequantize ≥
1.0x JAX's ``astype·scale``. On a GPU (H100) ≥ 2.0 TB/s effective bandwidth for lowprec's
quantize. Rows that miss are flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    Timing,
    environment,
    fmt_faults,
    fmt_num,
    fmt_ratio,
    header_line,
    json_safe,
    render_table,
    speed_ratio,
    stream_case,
    time_interleaved,
    write_atomic,
)

import lowprec  # noqa: E402

FORMATS = tuple(lowprec.MX_FORMAT_NAMES) + ("mxfp4_b16",)  # and one other block size
RULES = ("floor", "ceil", "even", "rceil")
# CPU targets (issue 23): every OCP MX format (E8M0 scales, 32-element blocks) and rule
# quantizes at >= 2x JAX's rceil quantizer where JAX has one and >= 50% of the streaming roof;
# NVFP4 quantizes at >= 25% of roof; MXFP6 dequantizes at >= 60% of roof; every dequantize
# at >= 1x JAX's astype·scale.
CPU_TARGET_VS_JAX = 2.0  # lowprec quantize (any rule) / JAX's rceil quantize
CPU_QUANT_ROOF = 0.50  # OCP MX quantize, fraction of the streaming roof
CPU_NVFP4_QUANT_ROOF = 0.25
CPU_FP6_DEQUANT_ROOF = 0.60
CPU_DEQUANT_TARGET = 1.0  # lowprec dequantize / JAX astype·scale, CPU
GPU_TARGET_TBPS = 2.0  # lowprec quantize effective bandwidth, H100


def element_dtype(fmt_name: str):
    return lowprec.mx_format(fmt_name).element.storage_dtype


def block_of(fmt_name: str) -> int:
    return lowprec.mx_format(fmt_name).block_size


def _e8m0_scales(fmt_name: str) -> bool:
    return lowprec.mx_format(fmt_name).scale.name == "e8m0"


def rules_of(fmt_name: str) -> tuple:
    """The scale rules timed for a format: NVFP4 has its own recipe ("nvfp4"), no rule."""
    return ("nvfp4",) if lowprec.mx_format(fmt_name).tensor_scale else RULES


def _rule_arg(rule: str):
    return None if rule == "nvfp4" else rule


# --------------------------------------------------------------------------- JAX's quantizer
def jax_quantizer(fmt_name: str):
    """JAX's MXFP8 quantizer configured for ``fmt``, jitted, or None where it does not apply."""
    try:
        from jax._src.cudnn import scaled_matmul_stablehlo as sm
    except Exception:  # noqa: BLE001
        return None
    fmt = lowprec.mx_format(fmt_name)
    if fmt.tensor_scale:
        block = fmt.block_size

        def quantize(x):
            amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
            config = sm.BlockScaleConfig(
                mode="nvfp4", block_size=block, data_type=jnp.float4_e2m1fn,
                scale_type=jnp.float8_e4m3fn, global_scale=amax / 2688.0, infer_only=False)
            return sm.quantize(x, config)

        return jax.jit(quantize)
    if (element_dtype(fmt_name) is None or not _e8m0_scales(fmt_name)
            or fmt.element.code_bits == 6):
        return None
    config = sm.BlockScaleConfig(
        mode="mxfp8",
        block_size=block_of(fmt_name),
        data_type=jnp.dtype(element_dtype(fmt_name)),
        scale_type=jnp.float8_e8m0fnu,
        global_scale=None,
        infer_only=False,
    )
    return jax.jit(lambda x: sm.quantize(x, config))


def jax_dequantizer(fmt_name: str, axis: int):
    """JAX's own dequantize: element and scale codes converted by XLA (``astype``) and
    multiplied per block along ``axis`` of a 2-D array; None without ml_dtypes types."""
    fmt = lowprec.mx_format(fmt_name)
    el_dt, sc_dt, block = fmt.element.storage_dtype, fmt.scale.storage_dtype, fmt.block_size
    if el_dt is None or sc_dt is None or fmt.tensor_scale or fmt.element.code_bits == 6:
        return None

    @jax.jit
    def dequantize(q, s):
        v = q.astype(jnp.float32)
        scale = s.astype(jnp.float32)
        if axis == 1:
            vb = v.reshape(v.shape[0], v.shape[1] // block, block) * scale[..., None]
        else:
            vb = v.reshape(v.shape[0] // block, block, v.shape[1]) * scale[:, None, :]
        return vb.reshape(v.shape)

    return dequantize


# --------------------------------------------------------------------------- NumPy baseline
def _pow2_floor_exp(v: np.ndarray) -> np.ndarray:
    """floor(log2 v) for v > 0 via frexp (v = m·2^e, m ∈ [0.5, 1))."""
    _, e = np.frexp(v)
    return e.astype(np.int32) - 1


def _pow2_ceil_exp(v: np.ndarray) -> np.ndarray:
    m, e = np.frexp(v)
    return np.where(m == 0.5, e - 1, e).astype(np.int32)


def _numpy_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Sub-byte codes packed along the last axis as lowprec stores them (low bits first)."""
    if bits == 4:
        return (codes[..., 0::2] & 0xF) | (codes[..., 1::2] << 4)
    if bits == 6:
        c = codes.astype(np.uint32).reshape(*codes.shape[:-1], -1, 4)
        w = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
        out = np.stack([w & 0xFF, (w >> 8) & 0xFF, w >> 16], axis=-1).astype(np.uint8)
        return out.reshape(*codes.shape[:-1], -1)
    return codes


def _numpy_unpack(elements: np.ndarray, bits: int) -> np.ndarray:
    if bits == 4:
        return np.stack((elements & 0xF, elements >> 4), axis=-1).reshape(*elements.shape[:-1], -1)
    if bits == 6:
        b = elements.astype(np.uint32).reshape(*elements.shape[:-1], -1, 3)
        w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        out = np.stack([(w >> s) & 0x3F for s in (0, 6, 12, 18)], axis=-1).astype(np.uint8)
        return out.reshape(*elements.shape[:-1], -1)
    return elements


def _element_codes_np(scaled: np.ndarray, fmt) -> np.ndarray:
    """Saturating RNE element codes (uint8) of float32 values already divided by the scale."""
    dt = fmt.element.storage_dtype
    max_elem = np.float32(fmt.element.max_finite)
    if dt is None:  # MX INT8: k = rint(v * 64), symmetric saturation
        k = np.clip(np.rint(scaled * np.float32(64)), -127, 127)
        return k.astype(np.int8).view(np.uint8)
    return np.clip(scaled, -max_elem, max_elem).astype(dt).view(np.uint8)


def numpy_quantize(x: np.ndarray, fmt_name: str, rule: str):
    """Vectorized NumPy block quantize (finite input), same layout as lowprec's MXArray;
    NVFP4 returns its float32 tensor scale too."""
    fmt = lowprec.mx_format(fmt_name)
    block = fmt.block_size
    max_elem = np.float32(fmt.element.max_finite)
    emax = fmt.emax_elem
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.abs(xb).max(axis=-1)
    if rule == "nvfp4":  # torchao's two-level recipe, float32 throughout
        f32 = np.float32
        ts = f32(np.abs(x).max() / f32(2688.0))
        s = np.clip((amax / f32(6.0)) / ts, f32(2.0**-6), f32(448.0)).astype(ml_dtypes.float8_e4m3fn)
        codes = _element_codes_np(xb / (ts * s.astype(f32))[..., None], fmt)
        elements = _numpy_pack(codes.reshape(*x.shape[:-1], -1), fmt.element.code_bits)
        return elements, s.view(np.uint8), ts
    if rule == "floor":
        shared = _pow2_floor_exp(amax) - emax
    elif rule == "ceil":
        shared = _pow2_ceil_exp(amax) - emax
    elif rule == "even":  # round amax to the element's precision in its top binade, half up
        drop = 23 - (fmt.element.emax - fmt.element.top_quantum_exponent)
        bits = (amax.view(np.uint32) + np.uint32(1 << (drop - 1))) & np.uint32(~((1 << drop) - 1) & 0xFFFFFFFF)
        shared = _pow2_floor_exp(bits.view(np.float32)) - emax
    elif rule == "rceil":  # NVIDIA: amax / max_elem in float32, rounded up to a power of two
        shared = _pow2_ceil_exp(amax / max_elem)
    else:
        raise ValueError(rule)
    shared = np.where(amax == 0, -127, np.clip(shared, -127, 127)).astype(np.int32)
    # Multiplying by 2^-shared (a float32 power of two per block) is exact here: the scaled
    # values are at most a few times max_elem and far above float32's subnormal range.
    scaled = xb * np.ldexp(np.float32(1), -shared)[..., None]
    codes = _element_codes_np(scaled, fmt).reshape(*x.shape[:-1], -1)
    elements = _numpy_pack(codes, fmt.element.code_bits)
    return elements, (shared + 127).astype(np.uint8)


def numpy_dequantize(elements: np.ndarray, scales: np.ndarray, fmt_name: str,
                     tensor_scale=None) -> np.ndarray:
    fmt = lowprec.mx_format(fmt_name)
    codes = _numpy_unpack(elements, fmt.element.code_bits)
    dt = element_dtype(fmt_name)
    if dt is None:
        v = codes.view(np.int8).astype(np.float32) / np.float32(64)
    else:
        v = codes.view(dt).astype(np.float32)
    vb = v.reshape(*v.shape[:-1], v.shape[-1] // fmt.block_size, fmt.block_size)
    if fmt.tensor_scale:
        scale = np.float32(tensor_scale) * scales.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
        scale = np.ldexp(np.float32(1), scales.astype(np.int32) - 127)
    return (vb * scale[..., None]).reshape(v.shape)


# --------------------------------------------------------------------------- benchmark
def _nbytes(tree) -> int:
    return sum(int(a.size) * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree))


def bench_format(fmt_name: str, x_np: np.ndarray, reps: int, on_gpu: bool):
    x = jax.device_put(x_np)
    xt = jax.device_put(np.ascontiguousarray(x_np.T))
    n = x_np.size
    in_bytes = x_np.nbytes
    cases, io_bytes = {}, {}
    rules = rules_of(fmt_name)
    ref_rule = rules[-1]  # rceil (JAX's rule), or NVFP4's recipe

    lp_q = {r: jax.jit(lambda x, r=r: lowprec.quantize_mx(x, fmt_name, scale_rule=_rule_arg(r)))
            for r in rules}
    for r in rules:
        cases[f"lowprec q {r}"] = lambda f=lp_q[r]: f(x)
    mx_rceil = jax.block_until_ready(lp_q[ref_rule](x))
    mx_axis0 = jax.block_until_ready(jax.jit(
        lambda v: lowprec.quantize_mx(v, fmt_name, axis=0, scale_rule=_rule_arg(ref_rule)))(xt))
    for r in rules:
        io_bytes[f"lowprec q {r}"] = in_bytes + _nbytes(mx_rceil)
    lp_dq = jax.jit(lowprec.dequantize)
    cases["lowprec dq"] = lambda: lp_dq(mx_rceil)
    io_bytes["lowprec dq"] = _nbytes(mx_rceil) + n * 4
    cases["lowprec dq0"] = lambda: lp_dq(mx_axis0)
    io_bytes["lowprec dq0"] = io_bytes["lowprec dq"]

    checks = {}
    jq = jax_quantizer(fmt_name)
    if jq is not None:
        try:
            jout = jax.block_until_ready(jq(x))
            cases["jax q rceil"] = lambda: jq(x)
            io_bytes["jax q rceil"] = in_bytes + _nbytes(jout)
            checks.update(_compare_jax(fmt_name, mx_rceil, jout))
        except Exception as e:  # noqa: BLE001 - e.g. a dtype XLA cannot convert to here
            checks["jax"] = f"n/a: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    for label, mx, axis in (("jax dq", mx_rceil, 1), ("jax dq0", mx_axis0, 0)):
        jdq = jax_dequantizer(fmt_name, axis)
        if jdq is None:
            continue
        q, s = _typed_codes(fmt_name, mx)
        cases[label] = lambda jdq=jdq, q=q, s=s: jdq(q, s)
        io_bytes[label] = q.size * q.dtype.itemsize + s.size + n * 4
        if label == "jax dq":
            got = np.asarray(jdq(q, s)).view(np.uint32)
            want = np.asarray(lp_dq(mx)).view(np.uint32)
            checks["jax_dq_vs_lowprec_dequantize_mismatches"] = int((got != want).sum())

    if not on_gpu:
        for r in rules:
            cases[f"numpy q {r}"] = lambda r=r: numpy_quantize(x_np, fmt_name, r)
            io_bytes[f"numpy q {r}"] = io_bytes[f"lowprec q {r}"]
        el_np, sc_np = np.asarray(mx_rceil.elements), np.asarray(mx_rceil.scales)
        ts_np = None if mx_rceil.tensor_scale is None else np.asarray(mx_rceil.tensor_scale)
        cases["numpy dq"] = lambda: numpy_dequantize(el_np, sc_np, fmt_name, ts_np)
        io_bytes["numpy dq"] = io_bytes["lowprec dq"]
        checks.update(_compare_numpy(fmt_name, x_np, x, lp_q, mx_rceil))
    stream, stream_bytes = stream_case(in_bytes)
    cases["stream"] = stream

    timings = time_interleaved(cases, reps=reps)
    stream_t = timings["stream"]

    def thr(name):
        t = timings.get(name)
        if not isinstance(t, Timing):
            return float("nan"), float("nan")
        return n / t.median, io_bytes[name] / t.median

    rows = []
    for r in rules + ("dequantize", "dequantize (axis 0)"):
        op = "quantize" if r in rules else r
        suffix = "0" if r == "dequantize (axis 0)" else ""
        lp = f"lowprec dq{suffix}" if op != "quantize" else f"lowprec q {r}"
        jx = f"jax dq{suffix}" if op != "quantize" else "jax q rceil"
        npn = "numpy dq" if op == "dequantize" else f"numpy q {r}"
        lp_e, lp_b = thr(lp)
        jx_e, jx_b = thr(jx)
        np_e, _ = thr(npn)
        r_jax = speed_ratio(timings.get(lp), timings.get(jx))
        r_np = speed_ratio(timings.get(lp), timings.get(npn))
        roof = (speed_ratio(timings.get(lp), stream_t) * io_bytes[lp] / stream_bytes
                if isinstance(stream_t, Timing) else float("nan"))
        flags = []
        if on_gpu:
            if op == "quantize" and lp_b == lp_b and lp_b / 1e12 < GPU_TARGET_TBPS:
                flags.append(f"MISS <{GPU_TARGET_TBPS} TB/s")
        else:
            f = lowprec.mx_format(fmt_name)
            ocp_mx = f.scheme.name == "e8m0" and f.block_size == 32
            if op == "quantize":
                if ocp_mx and r_jax == r_jax and r_jax < CPU_TARGET_VS_JAX:
                    flags.append(f"MISS <{CPU_TARGET_VS_JAX:g}x JAX")
                want = (CPU_QUANT_ROOF if ocp_mx else
                        CPU_NVFP4_QUANT_ROOF if f.scheme.name == "nvfp4" else None)
                if want is not None and roof == roof and roof < want:
                    flags.append(f"MISS <{want:.0%} roof")
            else:
                if r_jax == r_jax and r_jax < CPU_DEQUANT_TARGET:
                    flags.append(f"MISS <{CPU_DEQUANT_TARGET:g}x JAX")
                if f.element.code_bits == 6 and roof == roof and roof < CPU_FP6_DEQUANT_ROOF:
                    flags.append(f"MISS <{CPU_FP6_DEQUANT_ROOF:.0%} roof")
        rows.append({
            "format": fmt_name,
            "op": op,
            "rule": "-" if op != "quantize" else r,
            "lowprec_melem_s": lp_e / 1e6,
            "lowprec_gb_s": lp_b / 1e9,
            "jax_melem_s": jx_e / 1e6,
            "jax_gb_s": jx_b / 1e9,
            "numpy_melem_s": np_e / 1e6,
            "ratio_lowprec_jax": r_jax,
            "ratio_vs_jax_rceil_only": op == "quantize" and r not in ("rceil", "nvfp4"),
            "ratio_lowprec_numpy": r_np,
            "roofline_fraction": roof,
            "faults_cell": fmt_faults(timings.get(lp)),
            "flags": flags,
        })
    raw = {k: (t.as_dict() if isinstance(t, Timing) else t) for k, t in timings.items()}
    return rows, {"timings": raw, "io_bytes": io_bytes, "checks": checks}


def _typed_codes(fmt_name: str, mx):
    """An MXArray's codes as JAX's dequantize takes them: one element dtype value per byte
    (FP4 unpacked) and the scale dtype."""
    fmt = lowprec.mx_format(fmt_name)
    codes = mx.elements
    if fmt.packed:  # FP4 only: JAX's peers skip FP6, which XLA cannot hold
        codes = lowprec.unpack_fp4(codes, axis=mx.axis)
    q = jax.device_put(np.asarray(codes).view(fmt.element.storage_dtype))
    s = jax.device_put(np.asarray(mx.scales).view(fmt.scale.storage_dtype))
    return q, s


def _compare_jax(fmt_name, mx, jout) -> dict:
    """lowprec rceil vs JAX's quantizer, bit for bit (JAX's FP4 is unpacked). For NVFP4 JAX
    rounds in another order (x / global scale first): informative counts."""
    q, s = (np.asarray(a) for a in jout)
    jcodes = q.view(np.uint8)
    fmt = lowprec.mx_format(fmt_name)
    codes = _numpy_unpack(np.asarray(mx.elements), fmt.element.code_bits).reshape(jcodes.shape)
    tag = "nvfp4" if fmt.tensor_scale else "rceil"
    return {
        f"jax_vs_lowprec_{tag}_element_mismatches": int((jcodes != codes).sum()),
        f"jax_vs_lowprec_{tag}_scale_mismatches": int((s.view(np.uint8) != np.asarray(mx.scales)).sum()),
    }


def _compare_numpy(fmt_name, x_np, x, lp_q, mx_rceil) -> dict:
    out = {}
    for r in rules_of(fmt_name):
        mx = mx_rceil if r in ("rceil", "nvfp4") else lp_q[r](x)
        e, s = numpy_quantize(x_np, fmt_name, r)[:2]
        out[f"numpy_vs_lowprec_{r}_mismatches"] = int((e != np.asarray(mx.elements)).sum()
                                                      + (s != np.asarray(mx.scales)).sum())
    ts = None if mx_rceil.tensor_scale is None else np.asarray(mx_rceil.tensor_scale)
    d_np = numpy_dequantize(np.asarray(mx_rceil.elements), np.asarray(mx_rceil.scales), fmt_name, ts)
    d_lp = np.asarray(lowprec.dequantize(mx_rceil))
    out["numpy_vs_lowprec_dequantize_mismatches"] = int((d_np.view(np.uint32) != d_lp.view(np.uint32)).sum())
    return out


HEADERS = ["format", "op", "rule", "lowprec Melem/s", "lowprec GB/s", "JAX Melem/s", "JAX GB/s",
           "NumPy Melem/s", "lowprec/JAX", "lowprec/NumPy", "roof", "faults", "flag"]


def table(rows, on_gpu: bool) -> str:
    unit, div = ("TB/s", 1e3) if on_gpu else ("GB/s", 1.0)
    headers = [h.replace("GB/s", unit) for h in HEADERS]
    body = [
        [
            r["format"], r["op"], r["rule"],
            fmt_num(r["lowprec_melem_s"], 0), fmt_num(r["lowprec_gb_s"] / div, 2 if on_gpu else 1),
            fmt_num(r["jax_melem_s"], 0), fmt_num(r["jax_gb_s"] / div, 2 if on_gpu else 1),
            fmt_num(r["numpy_melem_s"], 0),
            fmt_ratio(r["ratio_lowprec_jax"]) + ("*" if r["ratio_vs_jax_rceil_only"] else ""),
            fmt_ratio(r["ratio_lowprec_numpy"]),
            fmt_num(100 * r["roofline_fraction"], 0) + "%",
            r["faults_cell"],
            "; ".join(r["flags"]) or "ok",
        ]
        for r in rows
    ]
    return render_table(headers, body, right=tuple(range(3, 12)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs=2, default=None,
                   help="2-D input shape; both axes multiples of the block size (default 4096 "
                        "4096 on CPU, 16384 16384 on GPU; 1024 1024 / 4096 4096 with --quick)")
    p.add_argument("--quick", action="store_true", help="smaller shape, 5 rounds")
    p.add_argument("--reps", type=int, default=None, help="interleaved rounds (default 7; 5 with --quick)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--json", metavar="PATH", help="write every timing and the table rows here")
    p.add_argument("--markdown", metavar="PATH", help="write the table (Markdown) here")
    args = p.parse_args(argv)
    on_gpu = jax.devices()[0].platform == "gpu"
    if args.shape:
        shape = tuple(args.shape)
    elif on_gpu:
        shape = (4096, 4096) if args.quick else (16384, 16384)
    else:
        shape = (1024, 1024) if args.quick else (4096, 4096)
    for fmt_name in args.formats:
        if shape[0] % block_of(fmt_name) or shape[1] % block_of(fmt_name):
            p.error(f"both axes of {shape} must be multiples of {fmt_name}'s block size "
                    f"{block_of(fmt_name)}")
    reps = args.reps or (5 if args.quick else 7)
    env = environment()
    title = (f"`python benchmarks/bench_mx.py` (float32 {shape}, standard normal, blocks along the "
             f"last axis; {reps} interleaved rounds, medians"
             + ("; NumPy baseline skipped on GPU)" if on_gpu else ")"))
    print(title + "\n" + header_line(env), flush=True)
    x_np = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    rows, details = [], {}
    for fmt_name in args.formats:
        r, d = bench_format(fmt_name, x_np, reps, on_gpu)
        rows += r
        details[fmt_name] = d
        bad = {k: v for k, v in d["checks"].items() if v}
        print(f"  {fmt_name}: done; agreement checks: "
              + ("all bit-identical" if not bad else ", ".join(f"{k}={v}" for k, v in bad.items())),
              flush=True)
    misses = [r for r in rows if r["flags"]]
    note = ("Ratios: median over rounds of per-round throughput ratios. * = vs JAX's rceil "
            "quantizer (JAX has no floor/ceil/even rule). roof: lowprec's bytes moved per second "
            "over a streaming kernel's (uint32 x ^ c over the input's bytes). faults: minor page "
            "faults per call (median). " + (
                f"Target: lowprec quantize ≥ {GPU_TARGET_TBPS} TB/s effective." if on_gpu else
                f"Targets: OCP MX quantize (every rule) ≥ {CPU_TARGET_VS_JAX:g}x JAX's rceil "
                f"quantizer and ≥ {CPU_QUANT_ROOF:.0%} of roof, NVFP4 quantize ≥ "
                f"{CPU_NVFP4_QUANT_ROOF:.0%} of roof, MXFP6 dequantize ≥ "
                f"{CPU_FP6_DEQUANT_ROOF:.0%} of roof, dequantize ≥ {CPU_DEQUANT_TARGET:g}x "
                f"JAX's astype·scale."))
    text = "\n".join([table(rows, on_gpu), "", note,
                      f"{len(misses)} of {len(rows)} rows miss a target."])
    print()
    print(text)
    if args.markdown:
        write_atomic(args.markdown, f"{title}\n\n{header_line(env)}\n\n{text}\n")
    if args.json:
        payload = {"benchmark": "mx", "shape": shape, "reps": reps, "env": env,
                   "rows": rows, "details": details}
        write_atomic(args.json, json.dumps(json_safe(payload), indent=1))
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
