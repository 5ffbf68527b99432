"""CPU cost of a training step per recipe: the small model of ``examples/train_lm.py``.

For each recipe, in one process: the jitted step's trace + lower and compile CPU seconds
(``time.process_time``, so other processes' load does not count), its optimized HLO's
instruction count, and the step's CPU seconds per call (median of interleaved rounds,
``_timing.time_interleaved``'s order rotation; CPU time of this process, XLA's threads
included). Ratios are against the fp32 step of the same process. The issue-35 goal: the
NVFP4 recipe's step <= 1.5x fp32's and its compile <= 2x fp32's.

Usage::

    python benchmarks/bench_train.py                      # fp32, nvidia_mxfp8, nvidia_nvfp4
    python benchmarks/bench_train.py --configs fp32 nvfp4 --rounds 5 --json out.json

``--xla-single-thread`` runs XLA:CPU on one thread (steadier CPU seconds on a loaded machine).
``--platform-branches all`` traces every platform's formulation (``lax.platform_dependent``,
as before ``lowprec._platform``; what a machine with the CUDA plugin traces): the trace cost
that tracing the CPU branch alone (the default on a CPU-only install) saves.
``--attribute N`` prints, per config, the N lowprec source lines and functions that the most
optimized-HLO instructions come from (the innermost lowprec frame of each instruction's
stack-frame metadata; a custom VJP's backward keeps only its outer frames, and constants
carry the frame of the jit that made them).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["fp32", "mxfp8_rceil", "nvfp4"],
                   help="names from examples/train_lm.py's CONFIGS")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per config")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--xla-single-thread", action="store_true")
    p.add_argument("--platform-branches", choices=("auto", "all"), default="auto",
                   help="lowprec.kernels.Policy.platform_branches while tracing")
    p.add_argument("--json", type=pathlib.Path, default=None, help="write the numbers here")
    p.add_argument("--attribute", type=int, default=0, metavar="N",
                   help="print the N source lines and functions with the most HLO instructions")
    return p.parse_args(argv)


_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = ", flags=re.M)


def _frames(hlo: str):
    """The HLO text's stack-frame tables: {frame id: (location id, parent id)} and
    {location id: (file, function, line)}."""
    tables = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    section = None
    for line in hlo.splitlines():
        s = line.strip()
        if s in tables:
            section = s
            continue
        if section is None or not s or s.startswith(("%", "ENTRY")):
            section = None if s.startswith(("%", "ENTRY")) else section
            continue
        key, _, rest = s.partition(" ")
        if not key.isdigit():
            continue
        fields = dict(re.findall(r"(\w+)=(\d+)", rest))
        tables[section][int(key)] = rest.strip('"') if not fields else fields
    files, funcs = tables["FileNames"], tables["FunctionNames"]
    locs = {k: (pathlib.Path(files.get(int(v["file_name_id"]), "?")).name,
                funcs.get(int(v["function_name_id"]), "?"), int(v["line"]))
            for k, v in tables["FileLocations"].items()}
    frames = {k: (int(v["file_location_id"]), int(v["parent_frame_id"]))
              for k, v in tables["StackFrames"].items()}
    return frames, locs


def attribute(hlo: str, top: int) -> dict:
    """Optimized-HLO instructions per innermost lowprec source line and function (the
    ``top`` largest of each): where a program's size comes from."""
    import collections

    frames, locs = _frames(hlo)
    lines, functions = collections.Counter(), collections.Counter()
    for instr in hlo.splitlines():
        if not _INSTRUCTION.match(instr):
            continue
        m = re.search(r"stack_frame_id=(\d+)", instr)
        frame, site, seen = int(m.group(1)) if m else None, None, set()
        while frame in frames and frame not in seen and site is None:
            seen.add(frame)
            loc, parent = frames[frame]
            f, fn, ln = locs.get(loc, ("?", "?", 0))
            if f.startswith("_") and f.endswith(".py"):  # lowprec's private modules
                site = (f, fn, ln)
            frame = parent
        f, fn, ln = site or ("(outside lowprec)", "", 0)
        lines[f"{f}:{ln} {fn}"] += 1
        functions[f"{f}:{fn}"] += 1
    return {"lines": lines.most_common(top), "functions": functions.most_common(top)}


def main(argv=None) -> dict:
    args = _parse(argv)
    if args.xla_single_thread:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen"
                                   "=false intra_op_parallelism_threads=1").strip()
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax

    import lowprec.flax
    import lowprec.kernels
    import train_lm

    lowprec.kernels.set_policy(platform_branches=args.platform_branches)

    s = dataclasses.replace(train_lm.Settings(), batch=args.batch, seq=args.seq,
                            d_model=args.d_model, layers=args.layers)
    vocab = 96
    data = jax.random.randint(jax.random.key(0), (200_000,), 0, vocab).astype(jnp.int32)
    model = train_lm.CharLM(vocab, s.seq, s.d_model, s.heads, s.layers)
    params = model.init(jax.random.key(1), jnp.zeros((1, s.seq), jnp.int32))
    opt = optax.adamw(1e-3)
    opt_state = opt.init(params)
    steps, rows = {}, {}
    for name in args.configs:
        recipe = train_lm.CONFIGS[name]
        runner = model if recipe is None else lowprec.flax.quantize_model(model, recipe)

        def step(p, o, i, runner=runner):
            x, y = train_lm.batch_at(data, jax.random.fold_in(jax.random.key(2), i), s.batch, s.seq)
            loss, grads = jax.value_and_grad(
                lambda q: train_lm.cross_entropy(runner.apply(q, x), y))(p)
            updates, o = opt.update(grads, o, p)
            return optax.apply_updates(p, updates), o, loss

        t0 = time.process_time()
        lowered = jax.jit(step).lower(params, opt_state, 0)
        t1 = time.process_time()
        compiled = lowered.compile()
        t2 = time.process_time()
        hlo = compiled.as_text()
        ops = len(_INSTRUCTION.findall(hlo))
        jax.block_until_ready(compiled(params, opt_state, 0))  # warm-up, never timed
        steps[name] = compiled
        rows[name] = {"trace_lower_cpu_s": t1 - t0, "compile_cpu_s": t2 - t1, "hlo_ops": ops,
                      "step_cpu_s": []}
        print(f"{name}: compiled in {t2 - t1:.1f} CPU s ({ops} HLO instructions)", flush=True)
        if args.attribute:
            where = attribute(hlo, args.attribute)
            rows[name]["attribution"] = where
            for kind in ("functions", "lines"):
                print(f"  HLO instructions by lowprec {kind[:-1]}:")
                for site, n in where[kind]:
                    print(f"    {n:7,d}  {site}")
    names = list(steps)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.process_time()
            jax.block_until_ready(steps[name](params, opt_state, r))
            rows[name]["step_cpu_s"].append(time.process_time() - t)
    base = rows.get("fp32")
    print(f"\nmodel: batch {s.batch}, seq {s.seq}, d {s.d_model}, {s.layers} layers; "
          f"{args.rounds} rounds; XLA single thread: {args.xla_single_thread}; "
          f"platform branches: {args.platform_branches}")
    print("| config | step CPU s (median) | step / fp32 | compile CPU s | compile / fp32 | "
          "trace+lower CPU s | HLO instructions |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        row["step_cpu_s_median"] = statistics.median(row["step_cpu_s"])
        ratio = lambda k: (f"{row[k] / base[k]:.2f}x" if base else "n/a")
        print(f"| {name} | {row['step_cpu_s_median']:.3f} | {ratio('step_cpu_s_median')} | "
              f"{row['compile_cpu_s']:.1f} | {ratio('compile_cpu_s')} | "
              f"{row['trace_lower_cpu_s']:.1f} | {row['hlo_ops']:,} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
