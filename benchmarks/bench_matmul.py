"""MXFP8 matmul throughput: lowprec vs bf16 and vs JAX's own MXFP8 paths, in one run.

Run: ``python benchmarks/bench_matmul.py`` (CPU: 1024² and 2048², under a minute;
GPU: 4096² to 16384²). ``--sizes 512 1024``, ``--reps R`` (interleaved rounds) and
``--json PATH`` (every timing, for the record). Timing follows ``_timing.py``: all methods
of one size in interleaved rounds, medians, and ratios as the median of per-round ratios.

All operands are K-major (A [M, K], B [N, K], contracting the last axis of both), the
layout MX hardware and ``jax.lax.scaled_dot`` use. Rows:

* ``bf16 dot``: ``lax.dot_general`` of bfloat16 operands, float32 accumulation — the
  baseline every ratio ``x bf16`` divides by.
* ``f32 dot (HIGHEST)``: float32 operands, full precision.
* ``lowprec mxfp8 pre-q``: :func:`lowprec.dot_general` on MXArray operands (quantized
  beforehand): decode + exact bfloat16 dequantization + bf16 dot with float32 accumulation.
* ``lowprec mxfp4 pre-q``: the same with MXFP4 (packed) operands.
* ``lowprec mxfp8 +quant``: float operands quantized inside the call (rceil).
* ``jax.lax.scaled_dot pre-q``: JAX's composite on float8/e8m0 operands (XLA decomposes it
  to dequantize + dot where there is no native kernel).
* ``jax.nn.scaled_dot_general``: quantize + scaled matmul; no CPU lowering in jax 0.10
  (reported as n/a), cuDNN/XLA on GPU.

``x bf16`` = how many times faster than the bf16 dot (below 1: slower). ``x peer`` is the
same against ``jax.nn.scaled_dot_general`` when it runs here, else against
``jax.lax.scaled_dot pre-q`` (the line above each table says which).
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
from jax import lax

import lowprec
from lowprec import dot_general

from _timing import Timing, environment, fmt_num, fmt_ratio, rate, render_table, speed_ratio
from _timing import time_interleaved

DN = (((1,), (1,)), ((), ()))


def _jax_mxfp8_quantizer():
    try:
        from jax._src.cudnn import scaled_matmul_stablehlo as sm
    except ImportError:
        return None
    cfg = jax.nn.get_scaled_dot_general_config("mxfp8")
    return jax.jit(lambda x: sm.quantize(x[None], cfg))


def _cases(a, b):
    """name -> (jitted function, args); a function that cannot run here maps to an error."""
    cases = {}
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    cases["bf16 dot"] = (
        jax.jit(lambda x, y: lax.dot_general(x, y, DN, preferred_element_type=jnp.float32)),
        (a16, b16),
    )
    cases["f32 dot (HIGHEST)"] = (
        jax.jit(lambda x, y: lax.dot_general(x, y, DN, precision=lax.Precision.HIGHEST)),
        (a, b),
    )
    for fmt in ("mxfp8", "mxfp4"):
        qa = lowprec.quantize_mx(a, fmt, axis=1, scale_rule="rceil")
        qb = lowprec.quantize_mx(b, fmt, axis=1, scale_rule="rceil")
        cases[f"lowprec {fmt} pre-q"] = (jax.jit(lambda x, y: dot_general(x, y, DN)), (qa, qb))
    cases["lowprec mxfp8 +quant"] = (
        jax.jit(
            lambda x, y: dot_general(
                x, y, DN, lhs_format="mxfp8", rhs_format="mxfp8", scale_rule="rceil"
            )
        ),
        (a, b),
    )
    quantize = _jax_mxfp8_quantizer()
    if quantize is not None and hasattr(lax, "scaled_dot"):
        (qa, sa), (qb, sb) = quantize(a), quantize(b)
        dn3 = (((2,), (2,)), ((0,), (0,)))
        cases["jax.lax.scaled_dot pre-q"] = (
            jax.jit(
                lambda x, y, s, t: lax.scaled_dot(
                    x, y, lhs_scale=s, rhs_scale=t, dimension_numbers=dn3,
                    preferred_element_type=jnp.float32,
                )
            ),
            (qa, qb, sa, sb),
        )
    cfg = jax.nn.get_scaled_dot_general_config("mxfp8")
    cases["jax.nn.scaled_dot_general"] = (
        jax.jit(lambda x, y: jax.nn.scaled_dot_general(x, y, DN, configs=[cfg, cfg, cfg])),
        (a, b),
    )
    return cases


def main() -> None:
    backend = jax.default_backend()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_sizes = [4096, 8192, 16384] if backend == "gpu" else [1024, 2048]
    parser.add_argument("--sizes", type=int, nargs="+", default=default_sizes)
    parser.add_argument("--reps", type=int, default=15 if backend == "gpu" else 9)
    parser.add_argument("--json", metavar="PATH", help="write every timing and table row here")
    args = parser.parse_args()

    env = environment()
    print(f"lowprec {env['lowprec']}, jax {env['jax']}, {backend}: {env['device']}")
    print(f"square M = N = K; median of {args.reps} interleaved rounds after a warm-up call\n")
    dump = []
    for n in args.sizes:
        ka, kb = jax.random.split(jax.random.key(n))
        a = jax.random.normal(ka, (n, n), jnp.float32)
        b = jax.random.normal(kb, (n, n), jnp.float32)
        cases = {name: functools.partial(fn, *fargs) for name, (fn, fargs) in _cases(a, b).items()}
        results = time_interleaved(cases, reps=args.reps)
        peer_name = "jax.nn.scaled_dot_general"
        if not isinstance(results.get(peer_name), Timing):
            peer_name = "jax.lax.scaled_dot pre-q"
        flops = 2.0 * n**3
        rows, notes = [], []
        for name, t in results.items():
            if not isinstance(t, Timing):
                if t.startswith("n/a: NotImplementedError"):
                    t = f"n/a: no {backend} lowering in jax {jax.__version__}"
                rows.append([name, "n/a", "", "", ""])
                notes.append(f"  {name}: {t}")
                continue
            rows.append([
                name,
                fmt_num(t.median * 1e3, 2),
                fmt_num(rate(flops, t) / 1e12, 3),
                fmt_ratio(speed_ratio(t, results["bf16 dot"])),
                fmt_ratio(speed_ratio(t, results.get(peer_name))),
            ])
        print(f"n = {n}; x peer is against {peer_name}")
        headers = ["method", "ms", "TFLOP/s", "x bf16", "x peer"]
        print(render_table(headers, rows, right=(1, 2, 3, 4)))
        print("\n".join(notes + [""]))
        dump.append({
            "n": n, "peer": peer_name, "rows": rows,
            "timings": {
                k: (v.as_dict() if isinstance(v, Timing) else v) for k, v in results.items()
            },
        })
    if args.json:
        with open(args.json, "w") as f:
            record = {"benchmark": "matmul", "reps": args.reps, "env": env, "sizes": dump}
            json.dump(record, f, indent=1)
        print(f"saved {args.json}")


if __name__ == "__main__":
    main()
