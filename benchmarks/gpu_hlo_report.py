"""How many kernels (passes over memory) each lowprec entry point compiles to, on this backend.

Run: ``python benchmarks/gpu_hlo_report.py`` (any backend; the point is a GPU), with
``--dump DIR`` to keep every optimized HLO module, ``--shape 4096 4096`` for the array.

For each entry point (``quantize_mx`` per format and rule, along the last axis and along
axis 0, with ``pad=True``; ``dequantize`` to float32 and bfloat16; ``fake_quantize_mx``;
``shared_exponents``; ``encode``; the dot products) the script jits it, takes XLA's
optimized module (``jax.jit(f).lower(x).compile().as_text()``) and lists the top-level
instructions of its entry computation that launch work: fusions (with their kind: kLoop =
elementwise, kInput = a reduction, kCustom = Triton/cuBLAS), custom calls, copies and
transposes that move data, reduces, dots, conditionals and loops. Bitcasts, tuples,
parameters and constants are free.

Columns: ``kernels`` (that count), ``kinds``, ``traffic/ideal``: the bytes every kernel
reads and writes (each operand and result counted once per kernel) over the bytes a
single pass needs (the entry's parameters and result) — 1.0 is one fused pass; 2.0 means
the data went through memory twice (e.g. a block-max reduction that the encode reads
back). ``fused ops``: arithmetic instructions inside the kernels' fused computations
(broadcasts, reshapes and other layout-only instructions not counted), a proxy for the
work per element: a memory-bound kernel on an H100 has room for roughly 30 integer
operations per float32 element before the ALUs, not HBM, set its speed. ``notes`` names
materialized transposes/copies and separate reductions.

This is the measurement behind the issue's "find out why XLA does not fuse the current
graph into one pass": run it on the GPU and compare with the CPU listing in
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import Counter

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import environment, render_table  # noqa: E402

import lowprec  # noqa: E402

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
FREE = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all",
        "partition-id", "replica-id", "opt-barrier"}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string (an array or a tuple of arrays)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * _BYTES.get(dtype, 1)
    return total


def _split_shape(rest: str):
    """'(u8[2]{0}, u8[1]{0}) fusion(%a), kind=kLoop' -> (shape, opcode, operands, attrs)."""
    if rest.startswith("("):
        depth = 0
        for i, c in enumerate(rest):
            depth += c == "("
            depth -= c == ")"
            if depth == 0:
                break
        shape, tail = rest[: i + 1], rest[i + 1 :].strip()
    else:
        shape, _, tail = rest.partition(" ")
    m = re.match(r"([\w\-]+)\((.*?)\)(.*)$", tail)
    if not m:
        return shape, tail.split("(")[0], [], ""
    operands = re.findall(r"%([\w.\-]+)", m.group(2))
    return shape, m.group(1), operands, m.group(3)


def entry_kernels(hlo: str):
    """[(name, opcode, kind, out_bytes, operand_names)] for the entry computation; and the
    bytes of its parameters and result."""
    lines = hlo[hlo.index("\nENTRY") :].splitlines()[1:]
    instrs, sizes, alias = [], {}, {}
    param_bytes = root_bytes = 0
    for line in lines:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.groups()
        shape, opcode, operands, attrs = _split_shape(rest.strip())
        nbytes = shape_bytes(shape)
        sizes[name] = nbytes
        if opcode == "parameter":
            param_bytes += nbytes
        if line.lstrip().startswith("ROOT"):
            root_bytes = nbytes
        if opcode in ("bitcast", "get-tuple-element") and operands:
            alias[name] = alias.get(operands[0], operands[0])
            continue
        if opcode in FREE:
            continue
        kind = re.search(r"kind=(\w+)", attrs)
        target = re.search(r'custom_call_target="([^"]+)"', attrs)
        label = kind.group(1) if kind else (target.group(1) if target else "")
        instrs.append((name, opcode, label, nbytes, [alias.get(o, o) for o in operands]))
    return instrs, sizes, param_bytes, root_bytes


# Instructions that cost (next to) nothing per element inside a fusion.
_LAYOUT_ONLY = FREE | {"broadcast", "reshape", "slice", "iota", "transpose", "concatenate"}


def fused_op_counts(hlo: str) -> dict:
    """Computation name -> number of arithmetic instructions in it (a per-element cost proxy)."""
    counts, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^\s*%?([\w.\-]+)\s*\(.*\{\s*$", line)
        if head and not line.lstrip().startswith("ENTRY"):
            name, counts[head.group(1)] = head.group(1), 0
            continue
        if line.startswith("}"):
            name = None
            continue
        m = _INSTR.match(line)
        if name and m:
            _, opcode, _, _ = _split_shape(m.group(2).strip())
            counts[name] += opcode not in _LAYOUT_ONLY
    return counts


def summarize(hlo: str) -> dict:
    instrs, sizes, params, root = entry_kernels(hlo)
    ops = fused_op_counts(hlo)
    calls = re.findall(r"calls=%([\w.\-]+)", hlo[hlo.index("\nENTRY"):])
    traffic = sum(out + sum(sizes.get(o, 0) for o in set(ops)) for _, _, _, out, ops in instrs)
    kinds = Counter(f"{op}:{label}" if label else op for _, op, label, _, _ in instrs)
    notes = [f"{op} {name}" for name, op, _, _, _ in instrs if op in ("copy", "transpose")]
    notes += [f"reduction {name}" for name, op, label, _, _ in instrs if label == "kInput" or op == "reduce"]
    return {
        "kernels": len(instrs),
        "kinds": ", ".join(f"{k}×{v}" if v > 1 else k for k, v in sorted(kinds.items())),
        "traffic_over_ideal": traffic / max(1, params + root),
        "fused_ops": sum(ops.get(c, 0) for c in calls),
        "notes": "; ".join(notes),
    }


def entry_points(shape):
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    xt = jax.ShapeDtypeStruct((shape[0], shape[1] - 16), jnp.float32)  # needs pad=True
    cases = {}
    for fmt in ("mxfp8_e4m3", "mxfp4"):
        for rule in ("floor", "rceil"):
            cases[f"quantize_mx {fmt} {rule}"] = (lambda v, f=fmt, r=rule: lowprec.quantize_mx(v, f, scale_rule=r), x)
        cases[f"quantize_mx {fmt} axis=0"] = (lambda v, f=fmt: lowprec.quantize_mx(v, f, axis=0), x)
        cases[f"quantize_mx {fmt} pad=True"] = (lambda v, f=fmt: lowprec.quantize_mx(v, f, pad=True), xt)
        mx = jax.eval_shape(lambda v, f=fmt: lowprec.quantize_mx(v, f), x)
        cases[f"dequantize {fmt} f32"] = (lambda m: lowprec.dequantize(m), mx)
        cases[f"dequantize {fmt} bf16"] = (lambda m: lowprec.dequantize(m, jnp.bfloat16), mx)
        cases[f"fake_quantize_mx {fmt}"] = (lambda v, f=fmt: lowprec.fake_quantize_mx(v, f), x)
    if jax.default_backend() == "gpu":  # on CPU this would list the Pallas interpreter
        from lowprec._options import MXCast
        from lowprec._quantize_pallas import quantize_mx_pallas

        for fmt in ("mxfp8_e4m3", "mxfp4"):
            cast = MXCast(lowprec.mx_format(fmt), "rceil", "nearest_even")
            cases[f"quantize_mx {fmt} rceil, Pallas kernel"] = (lambda v, c=cast: quantize_mx_pallas(v, c), x)
    cases["shared_exponents mxfp8 floor"] = (lambda v: lowprec.shared_exponents(v, "mxfp8"), x)
    cases["encode e4m3"] = (lambda v: lowprec.encode(v, "e4m3"), x)
    n, k = shape
    dn = (((1,), (1,)), ((), ()))
    a = jax.ShapeDtypeStruct((n, k), jnp.float32)
    q8 = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "mxfp8", axis=1), a)
    cases["dot_general mxfp8 pre-q"] = (lambda p, q: lowprec.dot_general(p, q, dn), q8, q8)
    cases["dot_general mxfp8 +quant"] = (
        lambda p, q: lowprec.dot_general(p, q, dn, lhs_format="mxfp8", rhs_format="mxfp8"), a, a)
    w4 = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "mxfp4", axis=1), a)
    t4 = jax.ShapeDtypeStruct((4, k), jnp.bfloat16)
    cases["dot_general mxfp4 weight x 4 tokens"] = (lambda t, w: lowprec.dot_general(t, w, dn), t4, w4)
    return cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=None)
    p.add_argument("--dump", metavar="DIR", help="write each optimized HLO module here")
    p.add_argument("--only", metavar="SUBSTRING", help="entry points whose name contains this")
    args = p.parse_args(argv)
    shape = tuple(args.shape) if args.shape else ((16384, 16384) if jax.default_backend() == "gpu" else (1024, 1024))
    env = environment()
    print(f"lowprec {env['lowprec']}, jax {env['jax']}, {env['platform']}: {env['device']}; "
          f"array {shape} float32\n")
    rows = []
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    for name, (fn, *specs) in entry_points(shape).items():
        if args.only and args.only not in name:
            continue
        try:
            hlo = jax.jit(fn).lower(*specs).compile().as_text()
        except Exception as e:  # noqa: BLE001 - report and go on
            rows.append([name, "n/a", f"{type(e).__name__}: {str(e)[:60]}", "", "", ""])
            continue
        if args.dump:
            path = os.path.join(args.dump, re.sub(r"[^\w.=-]+", "_", name) + ".hlo.txt")
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(hlo)
            os.replace(path + ".tmp", path)
        s = summarize(hlo)
        rows.append([name, str(s["kernels"]), s["kinds"], f"{s['traffic_over_ideal']:.2f}",
                     str(s["fused_ops"]), s["notes"]])
    headers = ["entry point", "kernels", "kinds", "traffic/ideal", "fused ops", "notes"]
    print(render_table(headers, rows, right=(1, 3, 4)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
