"""Peak memory and throughput of ``lowprec quantize`` / ``lowprec dequantize`` on a large
synthetic checkpoint, for every way a tensor is cut into pieces.

Cases (each a checkpoint of one float32 tensor of ``--size-mib`` MiB, default 1024):

* ``axis-1``: a square matrix, blocks along the last axis (pieces = whole rows);
* ``axis0``: the same file with ``--axis 0`` (blocks down the columns: pieces = block-aligned
  row ranges, or column slabs one block high for very wide matrices);
* ``1d``: a 1-D tensor (``--include``; pieces = whole blocks).

Every conversion runs as ``python -m lowprec ...`` in a subprocess; its peak resident set
size is the child's ``ru_maxrss`` from ``os.wait4`` (the import of JAX and lowprec
included), and throughput is the tensor's float32 bytes over the wall time of the whole
command (start-up included). The bound the checkpoint code promises is
peak RSS <= largest tensor bytes + 300 MB; the ``bound`` column checks it. Two peers
give scale: the peak RSS of a bare ``import lowprec.cli`` (the floor), and a plain copy
of the input file (``shutil.copyfile``, page cache warm: the I/O roofline for a
streaming conversion). Files go under ``--dir`` (default: a new folder in /tmp),
removed at the end unless ``--keep``.

Usage::

    python benchmarks/bench_checkpoint.py                      # 1 GiB, mxfp8_e4m3 and mxfp4
    python benchmarks/bench_checkpoint.py --size-mib 64 --formats mxfp4   # a quick look
    python benchmarks/bench_checkpoint.py --json out/bench_checkpoint.json
    git archive 766180e lowprec | tar -x -C /tmp/old &&     # against an older version
        python benchmarks/bench_checkpoint.py --baseline /tmp/old --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOUND_EXTRA = 300 * 10**6  # bytes allowed above the largest tensor


def make_checkpoint(path: str, name: str, shape, seed: int) -> None:
    """Writes one float32 tensor of standard-normal values, piece by piece."""
    from lowprec.checkpoint import SafetensorsWriter

    rng = np.random.default_rng(seed)
    total = math.prod(shape)
    step = 1 << 22
    with SafetensorsWriter(path, [(name, "F32", shape)]) as w:
        for start in range(0, total, step):
            n = min(step, total - start)
            w.write(name, rng.standard_normal(n, dtype=np.float32))


def run(cmd, pythonpath=None, cwd=None) -> dict:
    """Runs ``cmd`` in ``cwd`` (not the repository root, whose ``lowprec/`` would shadow
    ``pythonpath`` under ``python -m``); returns wall seconds, peak RSS bytes and the load."""
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd or tempfile.gettempdir(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err}")
    return {"seconds": seconds, "peak_rss": usage.ru_maxrss * 1024, "load": load}


def median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="tensor size (float32 MiB)")
    ap.add_argument("--formats", nargs="+", default=["mxfp8_e4m3", "mxfp4"])
    ap.add_argument("--cases", nargs="+", default=["axis-1", "axis0", "1d"],
                    choices=["axis-1", "axis0", "1d"])
    ap.add_argument("--dir", default=None, help="work folder (default: new folder in /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--json", default=None, help="also save the results here")
    ap.add_argument("--rounds", type=int, default=1, help="runs per row (median reported)")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="a source tree holding another lowprec version (e.g. `git archive REV "
                         "lowprec | tar -x -C DIR`), run interleaved with this one on "
                         "--baseline-cases: the 'vs baseline' column is the median per-round "
                         "speed ratio")
    ap.add_argument("--baseline-cases", nargs="+", default=["axis-1"])
    args = ap.parse_args(argv)

    work = args.dir or tempfile.mkdtemp(prefix="lowprec-bench-ckpt-")
    os.makedirs(work, exist_ok=True)
    py = [sys.executable, "-m", "lowprec"]
    n = args.size_mib * 2**20 // 4
    side = int(math.isqrt(n)) // 32 * 32
    files = {}
    rows = []
    try:
        if {"axis-1", "axis0"} & set(args.cases):
            files["2d"] = os.path.join(work, "matrix.safetensors")
            make_checkpoint(files["2d"], "layer.weight", (side, side), 0)
        if "1d" in args.cases:
            files["1d"] = os.path.join(work, "vector.safetensors")
            make_checkpoint(files["1d"], "layer.weight", (n // 32 * 32,), 1)
        floor = run([sys.executable, "-c", "import lowprec.cli"])
        copy_s = {}
        for key, path in files.items():
            t0 = time.perf_counter()
            shutil.copyfile(path, os.path.join(work, "copy.tmp"))
            copy_s[key] = time.perf_counter() - t0
            os.unlink(os.path.join(work, "copy.tmp"))
        print(f"tensor: {args.size_mib} MiB float32 ({side}x{side} matrix, {n // 32 * 32:,}-vector); "
              f"import-only peak RSS {floor['peak_rss'] / 1e6:.0f} MB; "
              f"cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}")
        header = ("case", "format", "op", "MB/s", "copy MB/s", "peak RSS MB", "bound MB", "ok",
                  "vs baseline", "baseline peak RSS MB", "load")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for case in args.cases:
            src = files["1d" if case == "1d" else "2d"]
            tensor_bytes = os.path.getsize(src)  # header is tiny
            extra = {"axis-1": [], "axis0": ["--axis", "0"], "1d": ["--include", "weight"]}[case]
            base = args.baseline if case in args.baseline_cases else None
            for fmt in args.formats:
                q = os.path.join(work, f"{case}-{fmt}.safetensors")
                d = os.path.join(work, f"{case}-{fmt}-back.safetensors")
                ops = [("quantize", py + ["quantize", src, q, "-f", fmt, "-q", "--force", *extra]),
                       ("dequantize", py + ["dequantize", q, d, "-q", "--force"])]
                for op, cmd in ops:
                    ours, theirs = [], []
                    for k in range(args.rounds):
                        order = [("ours", None), ("base", base)] if base else [("ours", None)]
                        for who, pp in (order if k % 2 == 0 else order[::-1]):
                            (ours if who == "ours" else theirs).append(run(cmd, pp))
                        if base:  # leave our own output for the next step
                            run(cmd)
                    r = {"seconds": median([x["seconds"] for x in ours]),
                         "peak_rss": max(x["peak_rss"] for x in ours),
                         "load": median([x["load"] for x in ours])}
                    bound = tensor_bytes + BOUND_EXTRA
                    row = {"case": case, "format": fmt, "op": op, "tensor_bytes": tensor_bytes,
                           "MBps": tensor_bytes / r["seconds"] / 1e6,
                           "copy_MBps": tensor_bytes / copy_s["1d" if case == "1d" else "2d"] / 1e6,
                           "bound_bytes": bound, "ok": r["peak_rss"] <= bound, **r,
                           "runs": ours, "baseline_runs": theirs}
                    ratio = rss_base = ""
                    if theirs:
                        row["speed_vs_baseline"] = median(
                            [b["seconds"] / a["seconds"] for a, b in zip(ours, theirs)])
                        row["baseline_peak_rss"] = max(b["peak_rss"] for b in theirs)
                        ratio = f"{row['speed_vs_baseline']:.2f}x"
                        rss_base = f"{row['baseline_peak_rss'] / 1e6:.0f}"
                    rows.append(row)
                    print(f"| {case} | {fmt} | {op} | {row['MBps']:.0f} | {row['copy_MBps']:.0f} | "
                          f"{r['peak_rss'] / 1e6:.0f} | {bound / 1e6:.0f} | "
                          f"{'yes' if row['ok'] else 'NO'} | {ratio} | {rss_base} | "
                          f"{r['load']:.2f} |", flush=True)
                os.unlink(d)
                os.unlink(q)
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"size_mib": args.size_mib, "import_peak_rss": floor["peak_rss"],
                       "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
