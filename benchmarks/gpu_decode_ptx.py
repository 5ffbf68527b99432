"""PTX instructions per weight element in the steady-state loop of the decode-time products,
from a compile for a GPU without one (JAX's CUDA plugin, as ``gpu_hlo_report.py``).

Run: ``JAX_PLATFORMS=cpu python benchmarks/gpu_decode_ptx.py`` (``--target h200``,
``--shape N K``, ``--json PATH``). For each kernel, format, scale arithmetic and token
count (1 and 16) it compiles the product, reads the kernel's PTX and ``ptxas -v``, and
prints: the instructions of the steady-state loop, the weight elements one thread handles
per trip, their ratio (the figure docs/design.md §15 states and tests/test_gpu_compile.py
holds to at most 4), registers, spilled bytes, and what the loop holds: warp shuffles,
``bar.sync`` barriers, 16-byte loads, tensor-core instructions.

Kernels: ``mgpu`` is the Mosaic GPU kernel of a :class:`lowprec.PreparedWeight`
(``lowprec/kernels/_weight_only_mgpu.py``: ``lowprec.weight_only_matmul``), with one or two
``mul.bf16x2`` per bfloat16 pair (``one``/``two``: ``PreparedWeight.one_multiply``);
``triton`` is the split-K Pallas/Triton kernel ``dot_general`` runs for an MXFP4 MXArray
(``lowprec/kernels/_gemv_pallas.py``), the route before.

The steady-state loop is the largest loop of the kernel's PTX (the compute loop: the memory
warpgroup's TMA loop is smaller), from its head label to its last backward branch, every
instruction counted once (inline assembly included; a spin wait on a barrier counts as one
pass). The count is PTX, not SASS: ptxas may fuse or split a few.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_hlo_report as report  # noqa: E402

import lowprec  # noqa: E402
from lowprec import _prepared as prep  # noqa: E402
from lowprec.kernels import _gemv_pallas  # noqa: E402
from lowprec.kernels import _weight_only_mgpu as mgpu  # noqa: E402

#: The budget of issue 32 for the decode kernel (PTX instructions per weight element).
BUDGET = 4.0


@dataclasses.dataclass(frozen=True)
class LoopStats:
    """The steady-state loop of one kernel's PTX."""

    instructions: int
    ops: dict  # opcode (first dotted part) -> count
    shuffles: int  # shfl.sync
    barriers: int  # bar.sync / barrier.sync (mbarrier waits are not counted here)
    loads_16b: int  # ld.*.v4 of 32-bit words
    tensor_core: int  # wgmma.mma_async / mma.sync

    @property
    def summary(self) -> str:
        top = ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items(), key=lambda kv: -kv[1])[:6])
        return f"{self.instructions} ({top})"


_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")


def _instructions(lines) -> list:
    out = []
    for line in lines:
        s = line.split("//")[0].strip()
        if not s or s.startswith(".") or s in ("{", "}"):
            continue
        s = re.sub(r"^[\w$]+:\s*", "", s)  # a label (also inside inline assembly)
        for part in s.split(";"):
            p = part.strip().lstrip("{").strip()
            if p and not p.startswith(".") and p != "}":
                out.append(p)
    return out


def _opcode(ins: str) -> str:
    words = ins.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def loop_stats(ptx: str) -> LoopStats:
    """The largest loop of ``ptx`` (one kernel's text): from a block label to the last branch
    back to it."""
    lines = ptx.splitlines()
    best = None
    for i, line in enumerate(lines):
        m = _LABEL.match(line)
        if not m:
            continue
        back = re.compile(r"\bbra(\.uni)?\s+" + re.escape(m.group(1)) + r"\s*;")
        ends = [j for j in range(i + 1, len(lines)) if back.search(lines[j])]
        if ends and (best is None or ends[-1] - i > best[1] - best[0]):
            best = (i, ends[-1])
    if best is None:
        raise ValueError("no loop in this PTX")
    ins = _instructions(lines[best[0]:best[1] + 1])
    ops = collections.Counter(_opcode(x) for x in ins)
    text = "\n".join(ins)
    return LoopStats(
        instructions=len(ins), ops=dict(ops),
        shuffles=len(re.findall(r"\bshfl\.", text)),
        barriers=len(re.findall(r"\b(?:bar|barrier)\.sync\b", text)),
        loads_16b=len(re.findall(r"\bld\.[\w:.]*v4\.(b|u|s)32\b", text)),
        tensor_core=len(re.findall(r"\bwgmma\.mma_async\b|\bmma\.sync\b", text)),
    )


def _ptxas_stats(text: str) -> tuple:
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (int(regs.group(1)) if regs else -1,
            int(spill.group(1)) + int(spill.group(2)) if spill else -1)


def _spec(fmt: str, shape, one_multiply: bool) -> prep.PreparedWeight:
    s = jax.ShapeDtypeStruct
    tn, tk = prep.tile_counts(shape)
    return prep.PreparedWeight(
        s((tn, tk, prep.THREADS, prep.WORDS_PER_THREAD), jnp.uint32),
        s((tn, tk, 32 * prep.SCALE_BYTES_PER_QUAD[fmt]), jnp.uint8), s((shape[0],), jnp.bool_),
        lowprec.mx_format(fmt), tuple(shape), 1, one_multiply, None,
        s((), jnp.float32) if fmt == "nvfp4" else None)


def mgpu_kernel(fmt: str, one_multiply: bool, m: int, shape, target: str = "h100") -> dict:
    """Compiles ``weight_only_matmul``'s kernel for ``m`` tokens × a prepared ``fmt`` weight of
    ``shape`` (N, K): its loop's stats, instructions per weight element, registers, spills."""
    cfg = mgpu.default_config(m, shape)
    with tempfile.TemporaryDirectory() as tmp:
        env = {"MOSAIC_GPU_DUMP_TO": tmp, "MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            report.compile_hlo(lambda x, w: mgpu.weight_only_mgpu(x, w, cfg),
                               (jax.ShapeDtypeStruct((m, shape[1]), jnp.bfloat16),
                                _spec(fmt, shape, one_multiply)), target)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        ptx_files = sorted(glob.glob(os.path.join(tmp, f"{mgpu.KERNEL_NAME}*.ptx")))
        ptxas_files = sorted(glob.glob(os.path.join(tmp, f"{mgpu.KERNEL_NAME}*.ptxas")))
        if len(ptx_files) != 1:
            raise RuntimeError(f"expected the kernel's PTX in the dump, found {ptx_files}")
        with open(ptx_files[0], encoding="utf-8") as f:
            ptx = f.read()
        ptxas = ""
        if ptxas_files:
            with open(ptxas_files[0], encoding="utf-8") as f:
                ptxas = f.read()
    stats = loop_stats(ptx)
    per_trip = cfg.tiles_per_step * prep.TILE_ROWS * prep.TILE_COLS // prep.THREADS
    regs, spilled = _ptxas_stats(ptxas)
    return {"kernel": "mgpu", "format": fmt, "scale": "one" if one_multiply else "two",
            "tokens": m, "config": dataclasses.asdict(cfg), "loop": stats,
            "elements_per_trip": per_trip, "per_element": stats.instructions / per_trip,
            "registers": regs, "spilled_bytes": spilled, "ptx": ptx}


def triton_kernel(m: int, shape, target: str = "h100") -> dict:
    """The same for the Pallas/Triton kernel ``dot_general`` runs for an MXFP4 MXArray."""
    n, k = shape
    cfg = _gemv_pallas.default_config(m, n, k)
    w = jax.eval_shape(lambda v: lowprec.quantize_mx(v, "mxfp4", axis=1),
                       jax.ShapeDtypeStruct((n, k), jnp.float32))
    dn = (((1,), (1,)), ((), ()))
    with tempfile.TemporaryDirectory() as tmp:
        report.compile_hlo(lambda a, b: lowprec.dot_general(a, b, dn),
                           (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), w), target, tmp)
        paths = sorted(glob.glob(os.path.join(tmp, "*.ptx")))
        texts = {p: open(p, encoding="utf-8").read() for p in paths}
        mine = [p for p, t in texts.items() if "lowprec_mxfp4_matmul" in t]
        if len(mine) != 1:
            raise RuntimeError(f"expected one PTX file of the Triton kernel, found {mine}")
        stats_by_name = report.ptx_kernel_stats(mine, report.TARGETS[target].arch)
        ptx = texts[mine[0]]
    regs, st, ld = stats_by_name.get("lowprec_mxfp4_matmul", (-1, -1, -1))
    stats = loop_stats(ptx)
    per_trip = cfg.block_n * cfg.block_groups * 32 // (cfg.num_warps * 32)
    return {"kernel": "triton", "format": "mxfp4", "scale": "-", "tokens": m,
            "config": dataclasses.asdict(cfg), "loop": stats, "elements_per_trip": per_trip,
            "per_element": stats.instructions / per_trip, "registers": regs,
            "spilled_bytes": st + ld, "ptx": ptx}


def rows(shape, target: str = "h100", tokens=(1, 16), triton: bool = True) -> list:
    out = []
    for m in tokens:
        if triton:
            out.append(triton_kernel(m, shape, target))
        for fmt in prep.FORMATS:
            for one in (True, False):
                out.append(mgpu_kernel(fmt, one, m, shape, target))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=sorted(report.TARGETS), default="h100")
    p.add_argument("--shape", type=int, nargs=2, default=(4096, 4096), metavar=("N", "K"))
    p.add_argument("--json", metavar="PATH", help="write the rows (without the PTX) as JSON")
    args = p.parse_args(argv)
    if not report.cuda_plugin_available():
        p.error("needs the JAX CUDA plugin: pip install -e '.[gpu-compile]'")
    if jax.default_backend() != "cpu" and os.environ.get("JAX_PLATFORMS") != "cpu":
        print("note: run with JAX_PLATFORMS=cpu to compile for a compile-only GPU", file=sys.stderr)
    env = report.environment()
    t = report.TARGETS[args.target]
    print(f"lowprec {env['lowprec']}, jax {env['jax']}: compiled for {t.name} ({t.arch}), "
          f"weight {args.shape[0]}x{args.shape[1]}\n")
    table = []
    found = rows(tuple(args.shape), args.target)
    for r in found:
        s = r["loop"]
        table.append([r["kernel"], r["format"], r["scale"], str(r["tokens"]),
                      str(s.instructions), str(r["elements_per_trip"]), f"{r['per_element']:.2f}",
                      str(r["registers"]), str(r["spilled_bytes"]), str(s.shuffles),
                      str(s.barriers), str(s.loads_16b), str(s.tensor_core)])
    headers = ["kernel", "format", "scale", "tokens", "loop instr", "elems/thread",
               "instr/elem", "regs", "spill B", "shfl", "bar.sync", "16-B loads", "mma"]
    print(report.render_table(headers, table, right=tuple(range(3, 13))))
    if args.json:
        rec = [{k: (dataclasses.asdict(v) if isinstance(v, LoopStats) else v)
                for k, v in r.items() if k != "ptx"} for r in found]
        tmp = args.json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"target": args.target, "shape": args.shape, "rows": rec}, f, indent=1)
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
