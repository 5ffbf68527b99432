"""MX matmul throughput: lowprec vs bf16 dots and JAX's own MXFP8 paths, both weight layouts.

Run: ``python benchmarks/bench_matmul.py`` (CPU: 1024² and 2048², a couple of minutes;
GPU: 4096² to 16384²). ``--sizes 512 1024``, ``--reps R`` (interleaved rounds),
``--json PATH`` (every timing, for the record), ``--markdown PATH`` (the tables). Timing
follows ``_timing.py``: all methods of one size in interleaved rounds, medians, and ratios as
the median of per-round ratios.

Square products M = N = K = n in the two layouts users call:

* **K-major**: A [M, K] and B [N, K], contracting the last axis of both
  (``dot_general(a, b, (((1,), (1,)), ((), ())))``): the layout of MX hardware and
  ``jax.lax.scaled_dot``.
* **[K, N]**: x [M, K] @ w [K, N] (``matmul(x, w)``), the linear-layer layout, with w
  quantized along axis 0 as ``matmul``'s docstring says. lowprec decodes it in place: no
  transpose of the codes.

Rows (each lowprec row has a bf16 dot of its own layout as its ``x bf16`` peer):

* ``bf16 dot``: ``lax.dot_general`` of bfloat16 operands, float32 accumulation.
* ``f32 dot (HIGHEST)``: float32 operands, full precision (K-major).
* ``lowprec <fmt> pre-q``: MXArray operands quantized beforehand (rceil), decoded exactly
  to bfloat16 in the call and multiplied by a bf16 dot with float32 accumulation.
* ``lowprec mxfp8 +quant``: float32 operands quantized inside the call (rceil).
* ``jax.lax.scaled_dot pre-q``: JAX's composite on float8/e8m0 operands (XLA decomposes it
  to dequantize + dot where there is no native kernel), K-major.
* ``jax.nn.scaled_dot_general``: quantize + scaled matmul; no CPU lowering in jax 0.10
  (reported as n/a), cuDNN/XLA on GPU.

Columns: ``x bf16`` = how many times faster than the bf16 dot of the same layout (below 1:
slower); ``x peer`` = the same against ``jax.nn.scaled_dot_general`` when it runs here, else
against ``jax.lax.scaled_dot pre-q``; ``roof`` = TFLOP/s over the fastest bf16 dot of the
whole run (the machine's compute roof as this process saw it); ``faults`` = median minor page
faults per call. Target: pre-quantized MXFP8 ≥ 0.8x bf16 at n ≥ 1024 on CPU,
in both layouts; rows that miss are flagged.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    Timing,
    environment,
    fmt_faults,
    fmt_num,
    fmt_ratio,
    header_line,
    json_safe,
    rate,
    render_table,
    speed_ratio,
    time_interleaved,
    write_atomic,
)

import lowprec  # noqa: E402
from lowprec import dot_general, matmul  # noqa: E402

NT = (((1,), (1,)), ((), ()))  # A [M, K] x B [N, K]
NN = (((1,), (0,)), ((), ()))  # x [M, K] x w [K, N]
TARGET_VS_BF16 = 0.8
TARGET_MIN_N = 1024


def _jax_mxfp8_quantizer():
    try:
        from jax._src.cudnn import scaled_matmul_stablehlo as sm
    except ImportError:
        return None
    cfg = jax.nn.get_scaled_dot_general_config("mxfp8")
    return jax.jit(lambda x: sm.quantize(x[None], cfg))


def _cases(a, b):
    """name -> (jitted function, args, layout, bf16 peer name); ``b`` is [N, K]."""
    w = b.T  # [K, N]
    cases = {}
    a16, b16, w16 = (v.astype(jnp.bfloat16) for v in (a, b, w))
    cases["bf16 dot K-major"] = (
        jax.jit(lambda x, y: lax.dot_general(x, y, NT, preferred_element_type=jnp.float32)),
        (a16, b16), "K-major", None)
    cases["bf16 dot [K,N]"] = (
        jax.jit(lambda x, y: lax.dot_general(x, y, NN, preferred_element_type=jnp.float32)),
        (a16, w16), "[K,N]", None)
    cases["f32 dot (HIGHEST)"] = (
        jax.jit(lambda x, y: lax.dot_general(x, y, NT, precision=lax.Precision.HIGHEST)),
        (a, b), "K-major", "bf16 dot K-major")
    for fmt in ("mxfp8", "mxfp4"):
        qa = lowprec.quantize_mx(a, fmt, axis=1, scale_rule="rceil")
        qb = lowprec.quantize_mx(b, fmt, axis=1, scale_rule="rceil")
        qw = lowprec.quantize_mx(w, fmt, axis=0, scale_rule="rceil")
        cases[f"lowprec {fmt} pre-q K-major"] = (
            jax.jit(lambda x, y: dot_general(x, y, NT)), (qa, qb), "K-major", "bf16 dot K-major")
        cases[f"lowprec {fmt} pre-q [K,N]"] = (
            jax.jit(lambda x, y: matmul(x, y)), (qa, qw), "[K,N]", "bf16 dot [K,N]")
    kw = dict(lhs_format="mxfp8", rhs_format="mxfp8", scale_rule="rceil")
    cases["lowprec mxfp8 +quant K-major"] = (
        jax.jit(lambda x, y: dot_general(x, y, NT, **kw)), (a, b), "K-major", "bf16 dot K-major")
    cases["lowprec mxfp8 +quant [K,N]"] = (
        jax.jit(lambda x, y: matmul(x, y, **kw)), (a, w), "[K,N]", "bf16 dot [K,N]")
    quantize = _jax_mxfp8_quantizer()
    if quantize is not None and hasattr(lax, "scaled_dot"):
        (qa8, sa), (qb8, sb) = quantize(a), quantize(b)
        dn3 = (((2,), (2,)), ((0,), (0,)))
        cases["jax.lax.scaled_dot pre-q"] = (
            jax.jit(
                lambda x, y, s, t: lax.scaled_dot(
                    x, y, lhs_scale=s, rhs_scale=t, dimension_numbers=dn3,
                    preferred_element_type=jnp.float32,
                )
            ),
            (qa8, qb8, sa, sb), "K-major", "bf16 dot K-major",
        )
    cfg = jax.nn.get_scaled_dot_general_config("mxfp8")
    cases["jax.nn.scaled_dot_general"] = (
        jax.jit(lambda x, y: jax.nn.scaled_dot_general(x, y, NT, configs=[cfg, cfg, cfg])),
        (a, b), "K-major", "bf16 dot K-major",
    )
    return cases


def main(argv=None) -> int:
    backend = jax.default_backend()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_sizes = [4096, 8192, 16384] if backend == "gpu" else [1024, 2048]
    parser.add_argument("--sizes", type=int, nargs="+", default=default_sizes)
    parser.add_argument("--reps", type=int, default=15 if backend == "gpu" else 9)
    parser.add_argument("--json", metavar="PATH", help="write every timing and table row here")
    parser.add_argument("--markdown", metavar="PATH", help="write the tables (Markdown) here")
    args = parser.parse_args(argv)

    env = environment()
    title = (f"`python benchmarks/bench_matmul.py` (square M = N = K = n, rceil-quantized "
             f"operands; {args.reps} interleaved rounds after a warm-up call, medians)")
    print(title + "\n" + header_line(env), flush=True)
    results_by_n, dump, peak = {}, [], 0.0
    for n in args.sizes:
        ka, kb = jax.random.split(jax.random.key(n))
        a = jax.random.normal(ka, (n, n), jnp.float32)
        b = jax.random.normal(kb, (n, n), jnp.float32)
        spec = _cases(a, b)
        cases = {name: functools.partial(fn, *fargs) for name, (fn, fargs, _, _) in spec.items()}
        results = time_interleaved(cases, reps=args.reps)
        results_by_n[n] = (spec, results)
        for name, t in results.items():
            if name.startswith("bf16 dot") and isinstance(t, Timing):
                peak = max(peak, rate(2.0 * n**3, t))
    sections = []
    for n, (spec, results) in results_by_n.items():
        peer_name = "jax.nn.scaled_dot_general"
        if not isinstance(results.get(peer_name), Timing):
            peer_name = "jax.lax.scaled_dot pre-q"
        flops = 2.0 * n**3
        rows, notes = [], []
        for name, t in results.items():
            _, _, layout, bf16_peer = spec[name]
            if not isinstance(t, Timing):
                if t.startswith("n/a: NotImplementedError"):
                    t = f"n/a: no {backend} lowering in jax {jax.__version__}"
                rows.append([name, layout, "n/a", "", "", "", "", "", ""])
                notes.append(f"  {name}: {t}")
                continue
            x_bf16 = speed_ratio(t, results[bf16_peer]) if bf16_peer else float("nan")
            flag = ""
            if ("mxfp8 pre-q" in name and n >= TARGET_MIN_N and backend == "cpu"
                    and x_bf16 == x_bf16):
                flag = "ok" if x_bf16 >= TARGET_VS_BF16 else f"MISS <{TARGET_VS_BF16}x bf16"
            rows.append([
                name, layout,
                fmt_num(t.median * 1e3, 2),
                fmt_num(rate(flops, t) / 1e12, 3),
                "" if bf16_peer is None else fmt_ratio(x_bf16),
                fmt_ratio(speed_ratio(t, results.get(peer_name))),
                fmt_num(100 * rate(flops, t) / peak, 0) + "%" if peak else "n/a",
                fmt_faults(t),
                flag,
            ])
        headers = ["method", "layout", "ms", "TFLOP/s", "x bf16", "x peer", "roof", "faults", "flag"]
        sections.append(f"n = {n}; x peer is against {peer_name}\n\n"
                        + render_table(headers, rows, right=(2, 3, 4, 5, 6, 7))
                        + ("\n\n" + "\n".join(notes) if notes else ""))
        dump.append({
            "n": n, "peer": peer_name, "rows": rows,
            "timings": {k: (v.as_dict() if isinstance(v, Timing) else v) for k, v in results.items()},
        })
    text = "\n\n".join(sections)
    print("\n" + text)
    if args.markdown:
        write_atomic(args.markdown, f"{title}\n\n{header_line(env)}\n\n{text}\n")
    if args.json:
        record = {"benchmark": "matmul", "reps": args.reps, "env": env, "sizes": dump,
                  "peak_bf16_flops": peak}
        write_atomic(args.json, json.dumps(json_safe(record), indent=1))
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
