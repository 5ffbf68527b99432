"""Every GPU measurement with a target in one run, side by side with its peers, with a roofline.

Run on a GPU: ``python benchmarks/bench_gpu.py`` (every section at 9 rounds: more than
10 minutes), or ``scripts/gpu_check.sh``, which runs the GPU-relevant tests first and then
each section in a process of its own, at 3 rounds, with a time limit (about 5 minutes on an
H200). ``--quick`` uses small sizes and few rounds (a smoke test; it also runs on CPU, where
the numbers mean nothing). ``--only quantize dequantize nvfp4 weight_only mxfp8 encode``
picks sections, ``--matmul-sizes`` the mxfp8 section's n, ``--reps`` the rounds, ``--json
PATH`` keeps every timing, ``--pytest-log`` puts a pytest summary on top, ``--tune`` sweeps
tile configurations of the MXFP4 kernel instead (prints the best per decode shape;
``--tune-space full`` for every configuration, not the lease-sized default).

Sections and peers (all measured in this process, interleaved rounds, medians; see
``_timing.py``):

* **roofline**: copy bandwidth (``jit(lambda x: -x)`` on 16384² float32: 4 bytes read +
  4 written per element) and bfloat16 peak (the datasheet figure for known devices, else
  a measured 8192³ bf16 dot). "% roof" of a memory-bound row = its effective bandwidth /
  copy bandwidth; of a matmul = (2·M·N·K / bf16 peak) / time, or the memory time if that
  is larger.
* **quantize**: ``quantize_mx`` (16384² float32, blocks along the last axis) per format and
  scale rule — as XLA compiles it ("xla") and as the one-pass Pallas kernel of
  ``lowprec/kernels/_quantize_pallas.py`` ("pallas", same bits; what ``quantize_mx`` runs on CUDA) — vs JAX's own quantizer (``jax._src.cudnn.scaled_matmul_stablehlo.quantize``,
  the rceil rule), XLA's float32 → float8/float4 ``astype`` and the copy. Effective bytes:
  4 read + 1 written (½ for packed FP4) + 1/32 scale byte per element.
* **dequantize**: ``dequantize`` (→ float32) vs JAX's ``q.astype(f32) * e8m0_to_dtype(s)``.
* **nvfp4**: NVFP4 ``quantize_mx`` (the divide and reciprocal element steps) and
  ``dequantize`` vs XLA's float32 → float4 cast and the copy; the codes of a slice are
  compared with the same call on the machine's CPU (flag ``codes = CPU's``).
* **weight_only**: x [M, K] bfloat16 times an MXFP4 weight [N, K] (gpt-oss layout), M ∈
  {1, 4, 16}, N×K ∈ {2880², 4096², 8192², 16384×8192}: the Pallas kernel
  (``mxfp4_gemv``), the XLA route (decode to bfloat16 fused into the dot), ``dot_general``
  as a user calls it (its automatic choice), the generic quantized dot it used before, and
  the bfloat16 ``jnp.dot`` with a bfloat16 weight (the baseline of "x bf16"). A product
  takes a few microseconds on a GPU, less than the dispatch of one call, so each route is
  compiled twice, into programs of R/4 and R products (R = 32, ``--inner``) on distinct
  activations and distinct weight buffers, and the time per product is the difference of
  the two programs' times (same rounds) over the extra products: dispatch cancels, and
  every weight comes from HBM as in a real decode step. "agree" checks every route
  against the generic path within twice the float32 summation bound. Up to 16 tokens, two
  more rows per shape: ``weight_only_matmul`` of the same weight prepared once
  (``lowprec.prepare_weight``: the Mosaic GPU kernel on Hopper) in MXFP4 and in NVFP4,
  against the bfloat16 product, checked against the exact product of their values.
  ``--tune-prepared`` sweeps that kernel's launch parameters instead.
* **mxfp8**: ``benchmarks/bench_matmul.py``'s cases at n = 4096, 8192, 16384: MXFP8 and
  MXFP4 pre-quantized operands and MXFP8 in-call quantization, in both weight layouts
  (K-major and [K, N]), each against the bfloat16 dot of its layout, with
  ``jax.nn.scaled_dot_general`` (else ``jax.lax.scaled_dot``) as the peer.
* **encode**: element ``encode`` (default and the other deterministic modes) vs XLA's
  convert, per format, 2^26 elements.
* **train_step**: one transformer block (pre-norm attention and a 4x MLP, d = 4096, 2048
  tokens, 32 heads; ``--train-d``, ``--train-tokens``) forward and backward, its four linear
  layers in each recipe: bf16 (the baseline: bfloat16 operands, float32 accumulation), FP8
  delayed (``lowprec.delayed_dot_general``, Transformer Engine's ``DelayedScaling``), FP8
  current (``FP8_HYBRID``), MXFP8 (``NVIDIA_MXFP8``) and NVFP4 (``NVIDIA_NVFP4``);
  activations bfloat16, attention's score and value products bfloat16 in every recipe.
  ``--predict TARGET`` (h100, h200, b200) instead compiles each step for that GPU without
  one (the CUDA plugin, ``JAX_PLATFORMS=cpu``) and predicts the step time from the compile:
  every GEMM's kind and FLOPs (Triton GEMM off, as ``gpu_hlo_report.py``'s GEMM view) at a
  stated fraction of the datasheet peak of its kind, plus the other kernels' bytes at the
  copy bandwidth. ``--profile RECIPE...`` also lists those recipes' GPU kernels per step
  (``jax.profiler``: time and launches per kernel name, to stderr).

Flags mark the rows that miss their targets: quantize ≥ 2.0 TB/s (mxfp8) / 1.8 (mxfp4); dequantize ≥
2.0 TB/s and ≥ 0.95x JAX; weight-only ≥ 3x bf16 (prepared: 3x at one token, 2.5x at 16);
MXFP8 pre-quantized ≥ 0.95x bf16, in-call quantization ≥ 0.85x; training step ≥ 1.3x the bf16
step for per-tensor FP8 (Transformer Engine's published Hopper range), ≥ 0.9x for MXFP8 and
NVFP4.
"""

from __future__ import annotations

import argparse
import dataclasses
import concurrent.futures
import functools
import itertools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import Timing, environment, json_safe, render_table, speed_ratio  # noqa: E402
from _timing import time_interleaved  # noqa: E402

import lowprec  # noqa: E402
from lowprec import _gemv, _options, _qdot  # noqa: E402
from lowprec.kernels._gemv_pallas import KernelConfig, default_config  # noqa: E402
from lowprec.kernels._weight_only_mgpu import default_config as weight_only_config  # noqa: E402
from lowprec._options import MXCast  # noqa: E402
from lowprec.kernels._quantize_pallas import quantize_mx_pallas  # noqa: E402

SECTIONS = ("quantize", "dequantize", "nvfp4", "weight_only", "mxfp8", "encode", "train_step")
RULES = ("floor", "ceil", "even", "rceil")
DN = (((1,), (1,)), ((), ()))
# Dense bfloat16 tensor-core peak (TFLOP/s) from the datasheets, by jax device_kind.
BF16_PEAK_TFLOPS = {"NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 PCIe": 756.0,
                    "NVIDIA H100 NVL": 835.0, "NVIDIA H200": 989.4, "NVIDIA A100-SXM4-80GB": 312.0,
                    "NVIDIA A100-SXM4-40GB": 312.0}
TARGET = {"quantize mxfp8": 2.0, "quantize mxfp4": 1.8, "dequantize": 2.0, "dequantize_vs_jax": 0.95,
          "weight_only": 3.0, "mxfp8 pre-q": 0.95, "mxfp8 +quant": 0.85,
          "prepared 1 token": 3.0, "prepared": 2.5,
          "train fp8_delayed": 1.3, "train fp8_current": 1.3, "train mxfp8": 0.9,
          "train nvfp4": 0.9}
#: Most tokens the prepared-weight kernel serves (weight_only_matmul takes the generic dot above).
PREPARED_MAX_TOKENS = 16
# --tune sweeps block_n x block_groups x num_warps x num_stages (x both inner products):
# "small" (34 configurations at one token: about 3 minutes per shape on an H200, what a
# lease allows) or "full" (--tune-space full: several hundred).
TUNE_SPACES = {"small": ((32, 64, 128), (2, 4, 8), (4, 8), (3,)),
               "full": ((16, 32, 64, 128), (1, 2, 4, 8), (2, 4, 8), (2, 3, 4))}


@dataclasses.dataclass
class Row:
    what: str
    value: str  # lowprec's figure
    peers: str  # the peers' figures, same units
    ratio: str  # lowprec / peer
    roof: str  # % of roofline
    flag: str = ""


@dataclasses.dataclass
class Roofline:
    copy_bps: float  # bytes/s
    bf16_flops: float  # FLOP/s
    bf16_source: str

    def pct_memory(self, nbytes, seconds):
        return 100.0 * nbytes / seconds / self.copy_bps

    def pct_matmul(self, flops, nbytes, seconds):
        ideal = max(flops / self.bf16_flops, nbytes / self.copy_bps)
        return 100.0 * ideal / seconds


def _t(result):
    return result.median if isinstance(result, Timing) else float("nan")


def _tbps(nbytes, result):
    return nbytes / _t(result) / 1e12


def _f(v, digits=2):
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


# -- roofline -------------------------------------------------------------------------------------

#: The copy every section measures beside its rows: 4 bytes read and 4 written per element.
_copy = jax.jit(lambda v: -v)


def measure_roofline(n: int, reps: int) -> Roofline:
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    a = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16) if n >= 8192 else x[:512, :512].astype(jnp.bfloat16)
    dot = jax.jit(lambda u: jnp.dot(u, u, preferred_element_type=jnp.float32))
    r = time_interleaved({"copy": lambda: _copy(x), "dot": lambda: dot(a)}, reps=reps)
    copy_bps = 8.0 * x.size / _t(r["copy"])
    kind = jax.devices()[0].device_kind
    measured = 2.0 * a.shape[0] ** 3 / _t(r["dot"])
    if kind in BF16_PEAK_TFLOPS:
        return Roofline(copy_bps, BF16_PEAK_TFLOPS[kind] * 1e12,
                        f"datasheet for {kind} (measured bf16 dot: {measured / 1e12:.0f} TFLOP/s)")
    return Roofline(copy_bps, measured, f"measured {a.shape[0]}³ bf16 dot ({kind})")


# -- quantize / dequantize -----------------------------------------------------------------------


def _xla_cast(dtype):
    return jax.jit(lambda v: v.astype(dtype))


def jax_peer(fmt: str):
    """JAX's own quantizer (jitted) and its astype·scale dequantize along the last axis,
    from bench_mx.py; (None, None) where JAX has no peer for ``fmt``."""
    from bench_mx import jax_dequantizer, jax_quantizer

    return jax_quantizer(fmt), jax_dequantizer(fmt, 1)


def _xla_quantize(v, cast):
    """quantize_mx's XLA formulation (what it runs off CUDA; on CUDA it runs the kernel)."""
    from lowprec._mx_encode import padded_bits, quantize_mxarray

    axis = v.ndim - 1
    return quantize_mxarray(padded_bits(v, axis, v.shape[axis]), cast, axis, tuple(v.shape))


def bench_quantize(x, roof: Roofline, reps: int, formats) -> list:
    n = x.size
    rows = []
    interpret = jax.default_backend() != "gpu"
    for fmt in formats:
        f = lowprec.mx_format(fmt)
        out_bytes = n // 2 if f.packed else n
        nbytes = 4 * n + out_bytes + n // 32
        el_dtype = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
                    "e2m1": ml_dtypes.float4_e2m1fn}[f.element.name]
        cases = {}
        for r in RULES:
            cast = MXCast(f, r, "nearest_even")
            cases[f"xla {r}"] = functools.partial(jax.jit(functools.partial(
                _xla_quantize, cast=cast)), x)
            cases[f"pallas {r}"] = functools.partial(jax.jit(functools.partial(
                lambda v, c: quantize_mx_pallas(v, c, interpret=interpret), c=cast)), x)
        jq, _ = jax_peer(fmt)
        if jq is not None:
            cases["JAX quantizer"] = functools.partial(jq, x)
        cases["XLA cast"] = functools.partial(_xla_cast(el_dtype), x)
        cases["XLA copy"] = functools.partial(_copy, x)
        t = time_interleaved(cases, reps=reps)
        peer_bytes = {"JAX quantizer": 5 * n + n // 32, "XLA cast": 5 * n, "XLA copy": 8 * n}
        peers = ", ".join(f"{k} {_f(_tbps(b, t.get(k)))}" for k, b in peer_bytes.items() if k in t)
        target = TARGET["quantize mxfp4" if f.packed else "quantize mxfp8"]
        for r in RULES:
            best = min((f"xla {r}", f"pallas {r}"), key=lambda c: _t(t[c]) if isinstance(t[c], Timing) else math.inf)
            tb = _tbps(nbytes, t[best])
            rows.append(Row(
                f"quantize_mx {fmt} {r} (TB/s)",
                f"xla {_f(_tbps(nbytes, t[f'xla {r}']))} / pallas {_f(_tbps(nbytes, t[f'pallas {r}']))}",
                peers,
                f"{_f(speed_ratio(t[best], t.get('JAX quantizer')))}x JAX ({best.split()[0]})",
                _f(roof.pct_memory(nbytes, _t(t[best])), 0),
                "ok" if tb >= target else f"MISS <{target} TB/s",
            ))
        # The kernel must give quantize_mx's bits (the tests check it too; this is the GPU data).
        mx = lowprec.quantize_mx(x, fmt, scale_rule="rceil")
        e, sc = quantize_mx_pallas(x, MXCast(f, "rceil", "nearest_even"), interpret=interpret)
        if not (bool((e == mx.elements).all()) and bool((sc == mx.scales).all())):
            rows[-1].flag += "; PALLAS BITS DIFFER"
    return rows


def bench_dequantize(x, roof: Roofline, reps: int, formats) -> list:
    n = x.size
    rows = []
    for fmt in formats:
        f = lowprec.mx_format(fmt)
        mx = lowprec.quantize_mx(x, fmt, scale_rule="rceil")
        nbytes = (n // 2 if f.packed else n) + n // 32 + 4 * n
        deq = jax.jit(lowprec.dequantize)
        deq16 = jax.jit(lambda m: lowprec.dequantize(m, jnp.bfloat16))
        cases = {"lowprec f32": functools.partial(deq, mx), "lowprec bf16": functools.partial(deq16, mx)}
        jq, jdq = jax_peer(fmt)
        if jq is not None:
            q, s = jq(x)
            cases["JAX astype*scale"] = functools.partial(jdq, q, s)
        t = time_interleaved(cases, reps=reps)
        tb = _tbps(nbytes, t["lowprec f32"])
        vs = speed_ratio(t["lowprec f32"], t.get("JAX astype*scale"))
        jax_bytes = 5 * n + n // 32
        ok = tb >= TARGET["dequantize"] and not vs < TARGET["dequantize_vs_jax"]
        rows.append(Row(
            f"dequantize {fmt} (TB/s)", _f(tb),
            f"JAX astype*scale {_f(_tbps(jax_bytes, t.get('JAX astype*scale')))}; "
            f"lowprec → bf16 {_f(_tbps(nbytes - 2 * n, t['lowprec bf16']))}",
            f"{_f(vs)}x JAX", _f(roof.pct_memory(nbytes, _t(t['lowprec f32'])), 0),
            "ok" if ok else "MISS <2.0 TB/s or <0.95x JAX",
        ))
    return rows


def bench_nvfp4(x, roof: Roofline, reps: int) -> list:
    """NVFP4 quantize (both element steps) and dequantize, vs XLA's float32 -> float4 cast and
    the copy; the codes are also checked against the same call on this machine's CPU."""
    n = x.size
    nbytes = 4 * n + n // 2 + n // 16  # x read; codes, an E4M3 scale per 16 written
    cases = {step: functools.partial(jax.jit(functools.partial(
        lambda v, st: lowprec.quantize_mx(v, "nvfp4", nvfp4_step=st), st=step)), x)
        for step in ("divide", "reciprocal")}
    mx = lowprec.quantize_mx(x, "nvfp4")
    cases["dequantize"] = functools.partial(jax.jit(lowprec.dequantize), mx)
    cases["XLA cast"] = functools.partial(_xla_cast(ml_dtypes.float4_e2m1fn), x)
    cases["XLA copy"] = functools.partial(_copy, x)
    t = time_interleaved(cases, reps=reps)
    peers = (f"XLA cast {_f(_tbps(4 * n + n // 2, t['XLA cast']))}, "
             f"XLA copy {_f(_tbps(8 * n, t['XLA copy']))}")
    rows = []
    for step in ("divide", "reciprocal"):
        rows.append(Row(f"quantize_mx nvfp4 {step} (TB/s)", _f(_tbps(nbytes, t[step])), peers,
                        f"{_f(speed_ratio(t[step], t['XLA cast']))}x XLA cast",
                        _f(roof.pct_memory(nbytes, _t(t[step])), 0)))
    dbytes = n // 2 + n // 16 + 4 * n
    rows.append(Row("dequantize nvfp4 (TB/s)", _f(_tbps(dbytes, t["dequantize"])), peers, "",
                    _f(roof.pct_memory(dbytes, _t(t["dequantize"])), 0)))
    try:  # the same bits on the CPU (a slice: the CPU is slower)
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        return rows
    part = x[:1024]
    same = []
    for step in ("divide", "reciprocal"):
        here = lowprec.quantize_mx(part, "nvfp4", nvfp4_step=step)
        there = jax.jit(functools.partial(lowprec.quantize_mx, fmt="nvfp4", nvfp4_step=step))(
            jax.device_put(part, cpu))
        same.append(bool(np.array_equal(np.asarray(here.elements), np.asarray(there.elements))
                         and np.array_equal(np.asarray(here.scales), np.asarray(there.scales))))
    rows[0].flag = "codes = CPU's" if all(same) else "CODES DIFFER FROM CPU'S"
    return rows


# -- MXFP4 weight-only products for decode shapes ----------------------------------------------------


def _repeated(fn, count: int):
    """A jitted program computing fn(xs[i], ws[i]) for the first ``count`` products.

    Every product has its own weight buffer: XLA merges dots that share an operand into one
    (its dot merger turned eight bf16 products with one weight into a single M=8 product,
    which read the weight once and "ran" above HBM bandwidth), and a reused weight could be
    served from L2. Programs of different counts take the same arguments (``keep_unused``),
    so their dispatch costs the same, and return one array (the products stacked: a few KiB),
    since every output buffer costs the host microseconds (with a list of outputs, a bf16
    product measured 25 us more than its bytes explain, on an H200)."""
    def run(xs, ws):
        return jnp.stack([fn(xs[i], ws[i]) for i in range(count)])

    return jax.jit(run, keep_unused=True)


def _counts(inner: int) -> tuple:
    """Product counts of the two programs whose time difference is timed (see _marginal)."""
    lo = max(1, inner // 4)
    return lo, max(lo + 1, inner)


def _marginal(hi, lo, extra: int):
    """Device time per product: per round, (time of the program with more products − time
    of the one with fewer) / the extra products. A blocking call of a jitted program costs
    tens of microseconds of dispatch and synchronization, more than a decode-shape product
    itself takes on a GPU (a 4096 x 4096 MXFP4 weight is 9 MB: about 3 us at 3 TB/s), so
    the time of one program over its product count mostly measured dispatch. The difference
    cancels it; both programs run in the same rounds."""
    if not isinstance(hi, Timing):
        return hi
    if not isinstance(lo, Timing):
        return lo
    per = Timing([(h - l) / extra for h, l in zip(hi.samples, lo.samples)], hi.number)
    if per.median <= 0:  # noise larger than the extra products' time: no figure
        return f"n/a: {extra} more products took no measurable time"
    return per


def _copies(tree, count: int) -> list:
    """``count`` distinct buffers holding ``tree``'s arrays (one per product: see _repeated)."""
    return [jax.tree.map(lambda a: a if a is None else a + jnp.zeros_like(a), tree)
            for _ in range(count)]


def _operands(m, n, k, count, prepared: bool = False):
    """``count`` activations [m, k] and ``count`` MXFP4 weight buffers [n, k] (distinct
    buffers with the same codes, one per product: see _repeated), and the bfloat16 weight;
    with ``prepared``, also ``count`` copies of that weight and of its NVFP4 quantization
    prepared for ``weight_only_matmul`` (lowprec.prepare_weight, once each)."""
    key = jax.random.key(n + k + m)
    w = jax.random.normal(key, (n, k), jnp.float32)
    mx = lowprec.quantize_mx(w, "mxfp4", axis=1, scale_rule="rceil")
    mxs = _copies(mx, count)
    xs = [jax.random.normal(jax.random.fold_in(key, i), (m, k), jnp.bfloat16)
          for i in range(count)]
    extra = {}
    if prepared:
        extra["prepared mxfp4"] = _copies(lowprec.prepare_weight(mx), count)
        nv = lowprec.quantize_mx(w, "nvfp4", axis=1)
        extra["prepared nvfp4"] = _copies(lowprec.prepare_weight(nv), count)
    return xs, mxs, w.astype(jnp.bfloat16), extra


def weight_only_cases(m, n, k, inner: int, interpret: bool, cfg=None):
    """name -> (fn(x, w), operand kind 'mx' or 'bf16') for one decode shape."""
    def pallas(x, w):
        c = cfg or default_config(m, n, k)
        return _gemv.mxfp4_matmul(x, w, "pallas", cfg=c, interpret=interpret)

    def generic(x, w):
        spec = _options.DotSpec.create(None, None, None, "floor", "nearest_even", "ieee", False,
                                       "ste", jnp.float32).with_mx_operand("rhs", w.fmt)
        w3 = lowprec.MXArray(w.elements[None], w.scales[None], w.fmt, 2, (1,) + w.shape)
        return _qdot._qdot_canonical(x[None], w3, spec.lhs, spec.rhs)[0]

    prepared = (lambda x, w: lowprec.weight_only_matmul(x, w)) if m <= PREPARED_MAX_TOKENS else None
    cases = {
        "bf16 dot": (lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32), "bf16"),
        "pallas": (pallas, "mx"),
        "xla route": (lambda x, w: _gemv.mxfp4_matmul(x, w, "xla"), "mx"),
        "dot_general": (lambda x, w: lowprec.dot_general(x, w, DN), "mx"),
        "generic": (generic, "mx"),
    }
    if prepared is not None:  # the Mosaic GPU kernel on Hopper (weight_only_matmul)
        cases["prepared mxfp4"] = (prepared, "prepared mxfp4")
        cases["prepared nvfp4"] = (prepared, "prepared nvfp4")
    return cases


def bench_weight_only(shapes, tokens, roof: Roofline, reps: int, inner: int, quick: bool) -> tuple:
    rows, records = [], []
    interpret = jax.default_backend() != "gpu"
    lo, hi = _counts(inner)
    for (n, k), m in itertools.product(shapes, tokens):
        mx_bytes = n * k // 2 + n * k // 32
        xs, mxs, w16, extra = _operands(m, n, k, hi, prepared=m <= PREPARED_MAX_TOKENS)
        w16s = [w16 + jnp.zeros_like(w16) for _ in range(hi)]
        cases, progs = {}, {}
        for name, (fn, kind) in weight_only_cases(m, n, k, inner, interpret).items():
            ws = {"mx": mxs, "bf16": w16s}.get(kind) or extra[kind]
            progs[name] = (fn, ws)
            for count in (lo, hi):
                cases[(name, count)] = functools.partial(_repeated(fn, count), xs, ws)
        timed = time_interleaved(cases, reps=reps, min_sample_s=0.0 if quick else 0.02)
        t = {name: _marginal(timed[(name, hi)], timed[(name, lo)], hi - lo) for name in progs}
        per = {name: _t(v) for name, v in t.items()}
        # Agreement: each MXFP4 route vs the generic path, within twice the float32 sum bound.
        x0, w0 = xs[0], mxs[0]
        ref = np.asarray(progs["generic"][0](x0, w0), np.float64)
        wv = np.abs(np.asarray(lowprec.dequantize(w0), np.float64))
        bound = 2 * k * 2.0**-23 * (np.abs(np.asarray(x0, np.float64)) @ wv.T)
        agree = []
        for name in ("pallas", "xla route", "dot_general"):
            if isinstance(t[name], Timing):
                y = np.asarray(jax.jit(progs[name][0])(x0, w0), np.float64)
                agree.append(bool(np.all(np.abs(y - ref) <= bound)))
        nbytes = mx_bytes + 2 * m * k + 4 * m * n
        best = min(("pallas", "xla route"), key=lambda s: per[s] if not math.isnan(per[s]) else math.inf)
        ratio = speed_ratio(t[best], t["bf16 dot"])
        rows.append(Row(
            f"MXFP4 weight x bf16, M={m}, {n}x{k} (us)",
            f"pallas {_f(per['pallas'] * 1e6, 1)} / xla {_f(per['xla route'] * 1e6, 1)} / "
            f"dot_general {_f(per['dot_general'] * 1e6, 1)}",
            f"bf16 dot {_f(per['bf16 dot'] * 1e6, 1)}; generic {_f(per['generic'] * 1e6, 1)}",
            f"{_f(ratio)}x bf16 ({best})",
            _f(roof.pct_memory(nbytes, per[best]), 0),
            ("ok" if ratio >= TARGET["weight_only"] else "MISS <3x bf16")
            + ("" if all(agree) else "; DISAGREE"),
        ))
        rows += _prepared_rows(m, n, k, t, per, progs, xs[0], roof)
        records.append({"m": m, "n": n, "k": k, "per_product_s": per, "agree": agree,
                        "programs": [lo, hi],
                        "timings": {a: (b.as_dict() if isinstance(b, Timing) else b)
                                    for a, b in t.items()}})
    return rows, records


def _prepared_rows(m, n, k, t, per, progs, x0, roof: Roofline) -> list:
    """Rows of the prepared-weight kernel (MXFP4, NVFP4) against the bfloat16 product, with
    their targets (3x at one token, 2.5x at 16) and agreement with the exact product."""
    rows = []
    for name in ("prepared mxfp4", "prepared nvfp4"):
        if name not in progs:
            continue
        fn, ws = progs[name]
        w = ws[0]
        y = np.asarray(jax.jit(fn)(x0, w), np.float64)
        values = np.asarray(lowprec.dequantize(w.to_mxarray()), np.float64)
        xf = np.asarray(x0.astype(jnp.float32), np.float64)
        exact = xf @ values.T
        # The summation bound (twice, as above), and NVFP4's tensor scale rounding once more.
        bound = 2 * k * 2.0**-23 * (np.abs(xf) @ np.abs(values).T) + 2.0**-22 * np.abs(exact)
        agree = bool(np.all(np.abs(y - exact) <= bound))
        fmt = name.split()[1]
        nbytes = w.nbytes + 2 * m * k + 4 * m * n
        ratio = speed_ratio(t[name], t["bf16 dot"])
        target = TARGET["prepared 1 token"] if m == 1 else TARGET["prepared"]
        cfg = weight_only_config(m, (n, k))
        rows.append(Row(
            f"{fmt.upper()} prepared x bf16, M={m}, {n}x{k} (us)",
            f"{_f(per[name] * 1e6, 1)} ({'one' if w.one_multiply else 'two'} multiply)",
            f"bf16 dot {_f(per['bf16 dot'] * 1e6, 1)}; triton {_f(per['pallas'] * 1e6, 1)}; "
            f"splits {cfg.splits}",
            f"{_f(ratio)}x bf16",
            _f(roof.pct_memory(nbytes, per[name]), 0),
            ("ok" if ratio >= target else f"MISS <{target}x bf16") + ("" if agree else "; DISAGREE"),
        ))
    return rows


def tune_prepared(shapes, tokens, reps: int, inner: int) -> None:
    """Sweeps the prepared-weight kernel's launch parameters (WeightOnlyConfig) per decode
    shape; prints the five best and the default."""
    from lowprec.kernels._weight_only_mgpu import WeightOnlyConfig

    for (n, k), m in itertools.product(shapes, tokens):
        if m > PREPARED_MAX_TOKENS:
            continue
        base = weight_only_config(m, (n, k))
        configs = {base}
        for groups, tiles, stages, splits in itertools.product(
                (1, 2), (2, 4), (3, 4, 6), sorted({1, 2, 4, base.splits, 2 * base.splits})):
            configs.add(WeightOnlyConfig(base.tokens, groups, tiles, stages, splits))
        lo, hi = _counts(inner)
        xs, _, _, extra = _operands(m, n, k, hi, prepared=True)
        ws = extra["prepared mxfp4"]
        results = []
        print(f"tuning the prepared MXFP4 kernel, M={m} {n}x{k}: {len(configs)} configurations",
              flush=True)
        for cfg in sorted(configs, key=repr):
            fn = functools.partial(lambda x, w, c: lowprec.weight_only_matmul(x, w, config=c),
                                   c=cfg)
            try:
                progs = {c: functools.partial(_repeated(fn, c), xs, ws) for c in (lo, hi)}
                r = time_interleaved(progs, reps=reps)
            except Exception as e:  # noqa: BLE001 - a configuration that does not fit
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:100]}")
                continue
            r = _marginal(r[hi], r[lo], hi - lo)
            if isinstance(r, Timing):
                results.append((r.median, cfg))
        results.sort(key=lambda p: p[0])
        default_t = next((s for s, c in results if c == base), float("nan"))
        for s_, cfg in results[:5]:
            print(f"  {s_ * 1e6:8.1f} us  {cfg}")
        print(f"  {default_t * 1e6:8.1f} us  default {base}\n", flush=True)


def tune(shapes, tokens, reps: int, inner: int, space: str = "small") -> None:
    """Sweeps kernel configurations per decode shape; prints the five best and the default."""
    interpret = jax.default_backend() != "gpu"
    for (n, k), m in itertools.product(shapes, tokens):
        base = default_config(m, n, k)
        configs = {base}
        for bn, gb, warps, stages in itertools.product(*TUNE_SPACES[space]):
            for inner_kind in ("fma", "dot"):
                if inner_kind == "dot" and bn < 16:
                    continue
                bm = 16 if inner_kind == "dot" else min(16, 1 << max(0, (m - 1).bit_length()))
                if inner_kind == "fma" and bm * bn * gb * 32 > 16384:
                    continue
                tiles = -(-n // bn) * -(-m // bm)
                steps = -(-(-(-k // 32)) // gb)
                splits = max(1, min(steps, -(-512 // tiles)))
                configs.add(KernelConfig(bn, gb, splits, inner_kind, bm, warps, stages))
        lo, hi = _counts(inner)
        xs, mxs, _, _ = _operands(m, n, k, hi)
        results = []
        print(f"tuning M={m} {n}x{k}: {len(configs)} configurations", flush=True)
        for cfg in sorted(configs, key=repr):
            fn = functools.partial(lambda x, w, c: _gemv.mxfp4_matmul(
                x, w, "pallas", cfg=c, interpret=interpret), c=cfg)
            progs = {c: functools.partial(_repeated(fn, c), xs, mxs) for c in (lo, hi)}
            r = time_interleaved(progs, reps=reps)
            r = _marginal(r[hi], r[lo], hi - lo)
            if isinstance(r, Timing):
                results.append((r.median, cfg))
        results.sort(key=lambda p: p[0])
        default_t = next((s for s, c in results if c == base), float("nan"))
        for s, cfg in results[:5]:
            print(f"  {s * 1e6:8.1f} us  {cfg}")
        print(f"  {default_t * 1e6:8.1f} us  default {base}\n", flush=True)


# -- MXFP8 matmul and element encode ------------------------------------------------------------------


def bench_mxfp8(sizes, roof: Roofline, reps: int) -> list:
    from bench_matmul import _cases

    rows = []
    for n in sizes:
        ka, kb = jax.random.split(jax.random.key(n))
        a = jax.random.normal(ka, (n, n), jnp.float32)
        b = jax.random.normal(kb, (n, n), jnp.float32)
        spec = _cases(a, b)  # name -> (jitted function, args, layout, bf16 peer name)
        cases = {name: functools.partial(fn, *fargs) for name, (fn, fargs, _, _) in spec.items()}
        t = time_interleaved(cases, reps=reps)
        peer = "jax.nn.scaled_dot_general"
        if not isinstance(t.get(peer), Timing):
            peer = "jax.lax.scaled_dot pre-q"
        flops = 2.0 * n**3
        for name, (_, _, layout, bf16_name) in spec.items():
            if not name.startswith("lowprec mx"):
                continue
            pre_q = "pre-q" in name
            # Bytes: pre-quantized operands (1 byte per element + a scale byte per 32; ½ for
            # FP4) and a float32 result, or float32 operands quantized in the call.
            elem = 0.5 if "mxfp4" in name else 1.0
            nbytes = 2 * n * n * (elem + 1 / 32) + 4 * n * n if pre_q else 12 * n * n
            vs = speed_ratio(t[name], t[bf16_name])
            target = TARGET["mxfp8 pre-q" if pre_q else "mxfp8 +quant"] if "mxfp8" in name else None
            flag = "" if target is None else ("ok" if vs >= target else f"MISS <{target}x bf16")
            rows.append(Row(
                f"{name.replace('lowprec ', 'matmul ')}, n={n} (x bf16)", f"{_f(vs)}x",
                f"{bf16_name} {_f(flops / _t(t[bf16_name]) / 1e12, 0)} TFLOP/s; {peer} "
                f"{_f(speed_ratio(t.get(peer), t['bf16 dot K-major']))}x bf16",
                f"{_f(speed_ratio(t[name], t.get(peer)))}x {peer.split('.')[-1].split()[0]}",
                _f(roof.pct_matmul(flops, nbytes, _t(t[name])), 0), flag,
            ))
    return rows


ENCODE_DTYPES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "e4m3": ml_dtypes.float8_e4m3fn,
                 "e5m2": ml_dtypes.float8_e5m2, "e2m1": ml_dtypes.float4_e2m1fn,
                 "e8m0": ml_dtypes.float8_e8m0fnu}


def bench_encode(size: int, roof: Roofline, reps: int) -> list:
    rows = []
    x = jax.random.normal(jax.random.key(7), (size,), jnp.float32)
    for fmt in ("fp16", "bf16", "tf32", "e4m3", "e5m2", "e2m1", "e8m0"):
        xin = jnp.abs(x) if fmt == "e8m0" else x
        modes = [r.value for r in lowprec.Rounding if r.value not in ("stochastic", "floor", "ceil")]
        if fmt == "e8m0":
            modes += ["floor", "ceil"]
        cases = {m: functools.partial(jax.jit(functools.partial(
            lambda v, m: lowprec.encode(v, fmt, rounding=m), m=m)), xin) for m in modes}
        if fmt == "tf32":
            native = jax.jit(lambda v: lax.bitcast_convert_type(lax.reduce_precision(v, 8, 10), jnp.uint32))
        else:
            native = _xla_cast(ENCODE_DTYPES[fmt])
        cases["XLA"] = functools.partial(native, xin)
        t = time_interleaved(cases, reps=reps)
        out_bytes = {"fp16": 2, "bf16": 2, "tf32": 4}.get(fmt, 1)
        nbytes = (4 + out_bytes) * size
        ratios = [speed_ratio(t[m], t["XLA"]) for m in cases if m != "XLA"]
        rows.append(Row(
            f"encode {fmt}, nearest_even (TB/s)", _f(_tbps(nbytes, t["nearest_even"])),
            f"XLA convert {_f(_tbps(nbytes, t['XLA']))}",
            f"{_f(speed_ratio(t['nearest_even'], t['XLA']))}x XLA; other modes "
            f"{_f(min(ratios))}–{_f(max(ratios))}x",
            _f(roof.pct_memory(nbytes, _t(t["nearest_even"])), 0),
        ))
    return rows


# -- one transformer block's training step, per recipe -----------------------------------------------

#: The recipes of the training-step section: name -> a lowprec Recipe, "delayed" or None (bf16).
TRAIN_RECIPES = {"bf16": None, "fp8_delayed": "delayed", "fp8_current": lowprec.FP8_HYBRID,
                 "mxfp8": lowprec.NVIDIA_MXFP8, "nvfp4": lowprec.NVIDIA_NVFP4}
LINEARS = ("qkv", "out", "up", "down")  # the block's four linear layers
HEAD_DIM = 128


def block_params(key, d: int) -> dict:
    """float32 master weights of one block: [d, 3d], [d, d], [d, 4d], [4d, d], two norms."""
    shapes = {"qkv": (d, 3 * d), "out": (d, d), "up": (d, 4 * d), "down": (4 * d, d)}
    keys = jax.random.split(key, len(shapes))
    params = {n: jax.random.normal(k, s, jnp.float32) / math.sqrt(s[0])
              for k, (n, s) in zip(keys, shapes.items())}
    params["norm1"] = jnp.ones((d,), jnp.float32)
    params["norm2"] = jnp.ones((d,), jnp.float32)
    return params


def _linear(recipe, x, w, state=None):
    """x [T, K] bfloat16 times w [K, N] (float32 master, bfloat16 operand) in ``recipe``."""
    dn = (((1,), (0,)), ((), ()))
    w = w.astype(jnp.bfloat16)
    if recipe is None:  # bfloat16 out (float32 accumulation), so its cotangents are bfloat16
        return lax.dot_general(x, w, dn)
    if recipe == "delayed":
        cfg = lowprec.DelayedScaling(amax_history_len=16)
        return lowprec.delayed_dot_general(x, w, state, dn, cfg).astype(jnp.bfloat16)
    return recipe.dot_general(x, w, dn)


def _rms(x, scale):
    v = x.astype(jnp.float32)
    v = v * lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + 1e-6) * scale
    return v.astype(jnp.bfloat16)


def block_loss(recipe, params, states, x, c):
    """sum(block(x) * c): pre-norm causal attention and a GELU MLP, residuals; the linear
    layers in ``recipe``, the rest bfloat16 (softmax and norms in float32)."""
    t, d = x.shape
    heads = d // HEAD_DIM
    lin = lambda name, v: _linear(recipe, v, params[name], states.get(name))  # noqa: E731
    q, k, v = jnp.split(lin("qkv", _rms(x, params["norm1"])).reshape(t, 3 * heads, HEAD_DIM),
                        3, axis=1)
    # bfloat16 products (float32 accumulation) with bfloat16 results, so that their
    # cotangents, and the backward GEMMs, are bfloat16 too; the softmax in float32.
    scores = jnp.einsum("qhd,khd->hqk", q, k).astype(jnp.float32)
    causal = jnp.tril(jnp.ones((t, t), bool))
    p = jax.nn.softmax(jnp.where(causal, scores / math.sqrt(HEAD_DIM), -jnp.inf), axis=-1)
    att = jnp.einsum("hqk,khd->qhd", p.astype(jnp.bfloat16), v)
    h = x + lin("out", att.reshape(t, d))
    y = h + lin("down", jax.nn.gelu(lin("up", _rms(h, params["norm2"]))))
    return jnp.sum(y.astype(jnp.float32) * c)


def train_step(name: str):
    """The jitted step of recipe ``name``: (params, states, x, c) -> (loss, param grads,
    next states). Delayed scaling's states (one per linear layer) get their gradient, the
    next step's state; the other recipes have none."""
    recipe = TRAIN_RECIPES[name]
    grad = jax.value_and_grad(functools.partial(block_loss, recipe), argnums=(0, 1))

    @jax.jit
    def step(params, states, x, c):
        loss, (g, next_states) = grad(params, states, x, c)
        return loss, g, next_states

    return step


def train_inputs(d: int, tokens: int, name: str, key=None):
    """(params, states, x, c) of a step: bfloat16 activations and cotangent weights."""
    key = jax.random.key(21) if key is None else key
    kp, kx, kc = jax.random.split(key, 3)
    states = {}
    if TRAIN_RECIPES[name] == "delayed":
        states = {n: lowprec.DelayedScaling(amax_history_len=16).init() for n in LINEARS}
    x = jax.random.normal(kx, (tokens, d), jnp.bfloat16)
    c = jax.random.normal(kc, (tokens, d), jnp.float32) / tokens
    return block_params(kp, d), states, x, c


def kernel_profile(fn, steps: int = 3, top: int = 20) -> str:
    """The GPU kernels of ``steps`` calls of ``fn`` (``jax.profiler``): per kernel name, its
    time per call and launches per call, the largest ``top`` first, and the total. The view
    that showed FP8 delayed scaling's step running float32 GEMMs (fourth H200 session)."""
    import collections
    import glob
    import tempfile

    with tempfile.TemporaryDirectory() as where:
        jax.profiler.start_trace(where)
        for _ in range(steps):
            jax.block_until_ready(fn())
        jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(where, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return "  (no profile written)"
        data = jax.profiler.ProfileData.from_file(paths[0])
    total, calls = collections.Counter(), collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():  # kernels are on the stream lines
                continue
            for ev in line.events:
                total[ev.name] += ev.duration_ns
                calls[ev.name] += 1
    if not total:
        return "  (no GPU kernels in the profile)"
    out = [f"  {sum(total.values()) / steps / 1e6:.2f} ms of kernels per call, {len(total)} names"]
    for name, ns in total.most_common(top):
        out.append(f"  {ns / steps / 1e6:8.3f} ms  x{calls[name] // steps:<3} {name[:140]}")
    return "\n".join(out)


def bench_train_step(d: int, tokens: int, roof: Roofline, reps: int,
                     profile: tuple = ()) -> tuple:
    """Each recipe's step time against the bf16 step (interleaved rounds), and the agreement
    of every recipe's loss and gradients with the bf16 step's (a smoke test of the wiring:
    relative differences, which low precision makes nonzero). ``profile``: recipes whose
    kernels are also listed (:func:`kernel_profile`, printed to stderr)."""
    cases, outs = {}, {}
    inputs = {name: train_inputs(d, tokens, name) for name in TRAIN_RECIPES}
    start = time.perf_counter()

    def compile_one(name):
        compiled = train_step(name).lower(*inputs[name]).compile()
        # Compiling (autotuning every GEMM on a GPU) dominates: a run cut at its time limit
        # still says how far it got (an H200 lease's 120 s did not see the five compiled).
        print(f"[train_step: {name} compiled at {time.perf_counter() - start:.1f} s]",
              file=sys.stderr, flush=True)
        return compiled

    # XLA compiles (and autotunes) the five steps in parallel threads: one after another
    # they took over 120 s on an H200.
    with concurrent.futures.ThreadPoolExecutor(len(TRAIN_RECIPES)) as pool:
        compiled = dict(zip(TRAIN_RECIPES, pool.map(compile_one, TRAIN_RECIPES)))
    for name in TRAIN_RECIPES:
        cases[name] = functools.partial(compiled[name], *inputs[name])
        outs[name] = jax.block_until_ready(cases[name]())
    t = time_interleaved(cases, reps=reps)
    for name in profile:
        print(f"[train_step: {name}'s kernels]\n{kernel_profile(cases[name])}", file=sys.stderr,
              flush=True)
    flops = 3 * 2.0 * tokens * d * (3 * d + d + 4 * d + 4 * d) + 3 * 2 * 2.0 * tokens**2 * d
    base_loss, base_g = outs["bf16"][0], outs["bf16"][1]
    rows, records = [], {}
    for name in TRAIN_RECIPES:
        loss, g = outs[name][0], outs[name][1]
        rel = max(float(jnp.linalg.norm(g[n] - base_g[n]) / jnp.linalg.norm(base_g[n]))
                  for n in LINEARS)
        finite = bool(jnp.isfinite(loss)) and all(bool(jnp.all(jnp.isfinite(v)))
                                                  for v in jax.tree.leaves(g))
        ratio = speed_ratio(t[name], t["bf16"])
        target = TARGET.get(f"train {name}")
        flag = "" if target is None else ("ok" if ratio >= target else f"MISS <{target}x bf16")
        flag += "" if finite else "; NOT FINITE"
        rows.append(Row(
            f"train step {name}, d={d}, {tokens} tokens (ms)", _f(_t(t[name]) * 1e3, 2),
            f"bf16 step {_f(_t(t['bf16']) * 1e3, 2)} ms; grads vs bf16: {rel:.2g} rel; "
            f"loss {float(loss):.4g} (bf16 {float(base_loss):.4g})",
            f"{_f(ratio)}x bf16", _f(roof.pct_matmul(flops, 0, _t(t[name])), 0), flag))
        records[name] = {"seconds": _t(t[name]), "ratio": ratio, "grad_rel_vs_bf16": rel}
    return rows, records


# Dense datasheet peaks (TFLOP/s) by GEMM kind, for --predict.
PEAK_TFLOPS = {"h100": {"bf16": 989.4, "f8": 1978.9}, "h200": {"bf16": 989.4, "f8": 1978.9},
               "b200": {"bf16": 2250.0, "f8": 4500.0}}
#: The fraction of its kind's peak a large GEMM is assumed to reach (cuBLAS, both kinds).
GEMM_EFFICIENCY = 0.7


def _gemm_kind(g: dict) -> str:
    return "f8" if g["target"].endswith("$f8") else ("bf16" if g["operands"] == ("bf16", "bf16")
                                                      else "other")


def predict_train_step(target: str, d: int, tokens: int) -> int:
    """Compile-only prediction of each recipe's step time (see the module docstring); prints
    the table and returns 0."""
    import gpu_hlo_report as report

    if not report.cuda_plugin_available():
        raise SystemExit("--predict needs the JAX CUDA plugin (pip install 'lowprec[gpu-compile]')")
    spec = report.TARGETS[target]
    peaks = PEAK_TFLOPS[target]
    rows, base = [], None
    for name in TRAIN_RECIPES:
        args = jax.eval_shape(lambda n=name: train_inputs(d, tokens, n))
        fn = jax.value_and_grad(functools.partial(block_loss, TRAIN_RECIPES[name]), argnums=(0, 1))
        hlo = report.compile_gemm_hlo(fn, args, target)
        gemms = report.gemm_view(hlo)
        instrs, sizes, _, _ = report.entry_kernels(hlo)
        other = sum(out + sum(sizes.get(o, 0) for o in set(ops))
                    for _, _, label, out, ops in instrs if not label.startswith("__cublas"))
        by_kind = {}
        for g in gemms:
            k = _gemm_kind(g)
            n, f = by_kind.get(k, (0, 0))
            by_kind[k] = (n + 1, f + g["flops"])
        t_gemm = sum(f / (peaks.get(k, peaks["bf16"] / 16) * 1e12 * GEMM_EFFICIENCY)
                     for k, (_, f) in by_kind.items())
        t_other = other / (spec.copy_tbs * 1e12)
        total = t_gemm + t_other
        base = total if name == "bf16" else base
        kinds = ", ".join(f"{n} {k} ({f / 1e12:.2f} TFLOP)" for k, (n, f) in sorted(by_kind.items()))
        rows.append([name, kinds, f"{other / 1e9:.2f}", f"{t_gemm * 1e3:.2f}",
                     f"{t_other * 1e3:.2f}", f"{total * 1e3:.2f}", f"{base / total:.2f}x"])
    print(f"predicted for {spec.name} (compile only): one block, d={d}, {tokens} tokens, "
          f"forward + backward; GEMMs at {GEMM_EFFICIENCY:.0%} of the datasheet peak of their "
          f"kind ({peaks}), other kernels' bytes at {spec.copy_tbs} TB/s\n")
    print(render_table(["recipe", "GEMMs (Triton off)", "other GB", "GEMM ms", "other ms",
                        "step ms", "x bf16"], rows, right=(2, 3, 4, 5, 6)))
    return 0


# -- main ---------------------------------------------------------------------------------------------


def pytest_row(path: str) -> Row:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError as e:
        return Row("pytest on this device", f"n/a ({e.strerror})", "", "", "")
    summary = next((ln.strip("= ") for ln in reversed(lines) if " passed" in ln or " failed" in ln), "no summary")
    failed = [ln for ln in lines if ln.startswith("FAILED ")]
    return Row("pytest on this device", summary, "; ".join(f[7:] for f in failed[:5]), "", "",
               "ok" if "failed" not in summary and "error" not in summary else "FAIL")


def main(argv=None) -> int:
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few rounds (smoke test)")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--reps", type=int, default=None, help="interleaved rounds (default 9; quick 3)")
    p.add_argument("--json", metavar="PATH", help="write every row and timing here")
    p.add_argument("--pytest-log", metavar="PATH", help="pytest output to summarize as the first row")
    p.add_argument("--tune", action="store_true", help="sweep MXFP4 kernel tiles instead")
    p.add_argument("--tune-prepared", action="store_true",
                   help="sweep the prepared-weight kernel's launch parameters instead")
    p.add_argument("--tune-space", choices=sorted(TUNE_SPACES), default="small",
                   help="the sweep's configurations (default small: 34 at one token)")
    p.add_argument("--matmul-sizes", type=int, nargs="+", metavar="N",
                   help="square sizes of the mxfp8 section (default 4096 8192 16384; quick 512)")
    p.add_argument("--weight-shapes", nargs="+", metavar="NxK",
                   help="weight shapes of the weight_only section (default 2880x2880 4096x4096 "
                        "8192x8192 16384x8192)")
    p.add_argument("--tokens", type=int, nargs="+", metavar="M",
                   help="token counts of the weight_only section (default 1 4 16)")
    p.add_argument("--train-d", type=int, metavar="D",
                   help="the train_step section's model width (default 4096; quick 256)")
    p.add_argument("--profile", nargs="+", default=(), choices=list(TRAIN_RECIPES),
                   metavar="RECIPE", help="also list the GPU kernels of these recipes' training "
                   "steps (jax.profiler; to stderr)")
    p.add_argument("--train-tokens", type=int, metavar="T",
                   help="the train_step section's tokens (default 2048; quick 128)")
    p.add_argument("--predict", choices=("h100", "h200", "b200"), metavar="TARGET",
                   help="predict the train_step section from a compile for this GPU (no GPU "
                        "needed: the CUDA plugin and JAX_PLATFORMS=cpu) instead of timing")
    p.add_argument("--inner", type=int, metavar="R",
                   help="products in the larger of the two timed programs per weight_only route "
                        "(default 32; the smaller has R/4; every product is compiled into its "
                        "program, so fewer compile faster)")
    args = p.parse_args(argv)
    reps = args.reps or (3 if args.quick else 9)
    train_d = args.train_d or (256 if args.quick else 4096)
    train_tokens = args.train_tokens or (128 if args.quick else 2048)
    if args.predict:
        return predict_train_step(args.predict, train_d, train_tokens)
    if args.quick:
        n, shapes, tokens, inner, sizes, enc = 1024, [(256, 288), (320, 256)], [1, 16], 4, [512], 1 << 18
    else:
        n, shapes, tokens, inner = 16384, [(2880, 2880), (4096, 4096), (8192, 8192), (16384, 8192)], [1, 4, 16], 32
        sizes, enc = [4096, 8192, 16384], 1 << 26
    sizes = args.matmul_sizes or sizes
    tokens = args.tokens or tokens
    inner = args.inner or inner
    if args.weight_shapes:
        try:
            shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.weight_shapes]
        except ValueError:
            p.error(f"--weight-shapes takes NxK pairs such as 4096x4096, got {args.weight_shapes}")
        if any(len(t) != 2 or min(t) < 1 for t in shapes):
            p.error(f"--weight-shapes takes NxK pairs of positive sizes, got {args.weight_shapes}")
    env = environment()
    print(f"lowprec {env['lowprec']}, jax {env['jax']}, {env['platform']}: {env['device']}"
          + ("" if on_gpu else "  (NOT A GPU: figures are a smoke test only)"), flush=True)
    if args.tune:
        tune(shapes, tokens, reps, inner, args.tune_space)
        return 0
    if args.tune_prepared:
        tune_prepared(shapes, tokens, reps, inner)
        return 0
    roof = measure_roofline(n, reps)
    print(f"roofline: copy {roof.copy_bps / 1e12:.2f} TB/s; bf16 {roof.bf16_flops / 1e12:.0f} "
          f"TFLOP/s ({roof.bf16_source}); {reps} interleaved rounds per group\n", flush=True)
    rows, records = [], {}
    if args.pytest_log:
        rows.append(pytest_row(args.pytest_log))
    x = jax.random.normal(jax.random.key(3), (n, n), jnp.float32)
    started = time.time()
    for section in args.only:
        if section == "quantize":
            rows += bench_quantize(x, roof, reps, ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4"))
        elif section == "dequantize":
            rows += bench_dequantize(x, roof, reps, ("mxfp8_e4m3", "mxfp4"))
        elif section == "nvfp4":
            rows += bench_nvfp4(x, roof, reps)
        elif section == "weight_only":
            new, records["weight_only"] = bench_weight_only(shapes, tokens, roof, reps, inner, args.quick)
            rows += new
        elif section == "mxfp8":
            rows += bench_mxfp8(sizes, roof, reps)
        elif section == "encode":
            rows += bench_encode(enc, roof, reps)
        elif section == "train_step":
            new, records["train_step"] = bench_train_step(train_d, train_tokens, roof, reps,
                                                          tuple(args.profile))
            rows += new
        print(f"[{section} done, {time.time() - started:.0f} s]", file=sys.stderr, flush=True)
    headers = ["what", "lowprec", "peers (same run)", "ratio", "% roof", "flag"]
    table = [[r.what, r.value, r.peers, r.ratio, r.roof, r.flag] for r in rows]
    print(render_table(headers, table, right=(4,)))
    misses = sum(1 for r in rows if "MISS" in r.flag or "DIFFER" in r.flag)
    print(f"{misses} of {sum(1 for r in rows if r.flag)} flagged rows miss a target or differ.")
    if args.json:
        record = {"benchmark": "gpu", "env": env, "reps": reps, "roofline": dataclasses.asdict(roof),
                  "rows": [dataclasses.asdict(r) for r in rows], "records": records}
        tmp = args.json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(json_safe(record), f, indent=1)
        os.replace(tmp, args.json)
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
