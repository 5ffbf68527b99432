"""Peak memory and throughput of ``lowprec quantize`` / ``lowprec dequantize`` on a large
synthetic checkpoint, for every way a tensor is cut into pieces.

Cases (each a checkpoint of one float32 tensor of ``--size-mib`` MiB, default 1024):

* ``axis-1``: a square matrix, blocks along the last axis (pieces = whole rows);
* ``axis0``: the same file with ``--axis 0`` (blocks down the columns: pieces = block-aligned
  row ranges, or column slabs one block high for very wide matrices);
* ``1d``: a 1-D tensor (``--include``; pieces = whole blocks);
* ``shards``: a sharded folder (``model.safetensors.index.json`` and ``--shards`` files) of
  bfloat16 [k, k] ``*.weight`` matrices of ``--size-mib`` MiB in all, the shape of a real
  model's checkpoint (many tensors: compilations and per-tensor costs show here). Its copy
  peer copies every shard.
* ``model-bf16`` / ``model-f32``: a multi-GiB sharded folder shaped like a Llama-7B-like
  model's checkpoint (:func:`make_model`: decoder layers of seven 4096-wide ``*.weight``
  matrices, 4096 x 4096 and 11008 x 4096, plus kept norms, two layers to a shard, an index
  and a config.json) of about ``--model-mib`` MiB of bfloat16 or float32 values.

Each row also gives the command's CPU seconds (user + system, the child's ``ru_utime +
ru_stime``, start-up included) and ``idle MB/s``: the bytes over CPU seconds / cores, what
the command would reach on an idle machine of ``os.cpu_count()`` cores if it kept them all
busy (an upper estimate for a shared machine, where the wall time counts other people's
work; the bytes over the CPU seconds alone would be the serial lower one).

Every conversion runs as ``python -m lowprec ...`` in a subprocess, as an installed lowprec
runs (its modules' bytecode compiled once, kept under the work folder, whatever
``PYTHONDONTWRITEBYTECODE`` says), and the ``model-*`` quantize commands write their error
report (``--report``); its peak resident set
size is the command's own ``ru_maxrss`` (the import of lowprec, and of JAX where it is used,
included), read by a small launcher process between the benchmark and the command (measured
from the benchmark itself it started at the benchmark's RSS, ~336 MB, at fork), and
throughput is the tensor's float32 bytes over the wall time of the whole
command (start-up included). The bound the checkpoint code promises is
peak RSS <= largest tensor bytes + 300 MB; the ``bound`` column checks it. Two peers
give scale: the peak RSS of a bare ``import lowprec.cli`` (the floor), and a plain copy
of the input file (``shutil.copyfile``, page cache warm: the I/O roofline for a
streaming conversion), and the same copy made durable (:func:`durable_copy`: fsynced as
lowprec's outputs are; the disk's roofline for a command that writes as many bytes, such
as a dequantize to the input's dtype). Files go under ``--dir`` (default: a new folder in /tmp),
removed at the end unless ``--keep``.

Usage::

    python benchmarks/bench_checkpoint.py                      # 1 GiB, mxfp8_e4m3 and mxfp4
    python benchmarks/bench_checkpoint.py --size-mib 64 --formats mxfp4   # a quick look
    python benchmarks/bench_checkpoint.py --json out/bench_checkpoint.json
    python benchmarks/bench_checkpoint.py --cases model-bf16 --formats nvfp4 mxfp4 --rounds 2
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


def make_sharded(folder: str, total_bytes: int, shards: int, seed: int) -> None:
    """A folder of ``shards`` files of bfloat16 [k, k] matrices (four per shard, k a
    multiple of 32) of about ``total_bytes`` in all, with its index."""
    import ml_dtypes

    from lowprec.checkpoint import SafetensorsWriter

    os.makedirs(folder, exist_ok=True)
    per = 4
    k = max(32, int(math.isqrt(total_bytes // (2 * shards * per))) // 32 * 32)
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        names = [f"model.layers.{i}.mlp.proj{j}.weight" for j in range(per)]
        with SafetensorsWriter(os.path.join(folder, shard),
                               [(n, "BF16", (k, k)) for n in names]) as w:
            for n in names:
                for r0 in range(0, k, max(1, (1 << 22) // k)):
                    r1 = min(k, r0 + max(1, (1 << 22) // k))
                    w.write(n, rng.standard_normal((r1 - r0) * k, dtype=np.float32)
                            .astype(ml_dtypes.bfloat16))
        weight_map.update(dict.fromkeys(names, shard))
        total += per * k * k * 2
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)


#: The shapes of one decoder layer of the ``model`` case (a Llama-7B-like layer: d 4096,
#: MLP 11008): the 2-D ``*.weight`` matrices are quantized, the norms kept.
MODEL_D, MODEL_FF = 4096, 11008


def model_layer(i: int, d: int = MODEL_D, ff: int = MODEL_FF) -> list:
    p = f"model.layers.{i}."
    return ([(p + f"self_attn.{n}_proj.weight", (d, d)) for n in "qkvo"]
            + [(p + "mlp.gate_proj.weight", (ff, d)), (p + "mlp.up_proj.weight", (ff, d)),
               (p + "mlp.down_proj.weight", (d, ff)),
               (p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,))])


def durable_copy(src: str, dst: str) -> float:
    """Wall seconds to copy the file or folder ``src`` to ``dst`` (removed after) and make it
    durable (each file fsynced, then its folder): the floor for any command that writes as
    many bytes as safely as lowprec does (its outputs are fsynced before they are renamed),
    set by the disk where the plain copy above is set by the page cache. Written as lowprec
    writes: 16 MiB at a time, each range handed to the disk once written
    (``sync_file_range``), and the range written 64 MiB earlier waited for and dropped from
    the page cache, so that the copy reuses its pages (fresh ones cost ~3 ns/B of CPU on
    this project's virtual machines) and the final fsync waits only for the tail."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sfr = libc.sync_file_range
    sfr.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    chunk, lag = 16 << 20, 4
    names = sorted(os.listdir(src)) if os.path.isdir(src) else [None]
    if os.path.isdir(src):
        os.makedirs(dst)
    t0 = time.perf_counter()
    for name in names:
        s, d = (src, dst) if name is None else (os.path.join(src, name), os.path.join(dst, name))
        with open(s, "rb") as fi, open(d, "wb", buffering=0) as fo:
            fd, pos = fo.fileno(), 0
            while data := fi.read(chunk):
                fo.write(data)
                sfr(fd, pos, len(data), 2)  # SYNC_FILE_RANGE_WRITE
                old = pos - lag * chunk
                if old >= 0:
                    sfr(fd, old, chunk, 1 | 2 | 4)  # wait before, write, wait after
                    os.posix_fadvise(fd, old, chunk, os.POSIX_FADV_DONTNEED)
                pos += len(data)
            os.fsync(fd)
    fd = os.open(dst if os.path.isdir(dst) else os.path.dirname(os.path.abspath(dst)), os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    seconds = time.perf_counter() - t0
    shutil.rmtree(dst) if os.path.isdir(dst) else os.unlink(dst)
    return seconds


def make_model(folder: str, total_bytes: int, dtype: str, seed: int,
               layers_per_shard: int = 2) -> int:
    """A sharded folder shaped like a real model's checkpoint (``dtype`` "BF16" or "F32"):
    decoder layers of :func:`model_layer` (seven 4096-wide ``*.weight`` matrices, two norms)
    until about ``total_bytes``, ``layers_per_shard`` to a shard, a final norm and an
    index; values N(0, 0.02²). Returns the bytes of its tensors."""
    import ml_dtypes

    from lowprec.checkpoint import SafetensorsWriter

    os.makedirs(folder, exist_ok=True)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "BF16" else np.dtype(np.float32)
    per_layer = sum(math.prod(s) for _, s in model_layer(0)) * np_dtype.itemsize
    layers = max(1, round(total_bytes / per_layer))
    shards = -(-layers // layers_per_shard)
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for k in range(shards):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        entries = [e for i in range(k * layers_per_shard, min(layers, (k + 1) * layers_per_shard))
                   for e in model_layer(i)]
        if k == shards - 1:
            entries.append(("model.norm.weight", (MODEL_D,)))
        with SafetensorsWriter(os.path.join(folder, shard),
                               [(n, dtype, s) for n, s in entries]) as w:
            for n, s in entries:
                size = math.prod(s)
                for start in range(0, size, 1 << 24):
                    x = rng.standard_normal(min(1 << 24, size - start), dtype=np.float32)
                    x *= np.float32(0.02)
                    w.write(n, x.astype(np_dtype))
                total += size * np_dtype.itemsize
        weight_map.update({n: shard for n, _ in entries})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "hidden_size": MODEL_D,
                   "intermediate_size": MODEL_FF, "num_hidden_layers": layers,
                   "torch_dtype": "bfloat16" if dtype == "BF16" else "float32"}, f)
    return total


# A small launcher between this process and the command: Linux starts a child's ru_maxrss at
# the RSS of the process it forked from (the mm copied by fork counts at exec), so a command
# started from this process, which holds the generated arrays, reported this process's
# ~336 MB as its own peak in every row. The launcher (python -S, ~10 MB) forks and execs the
# command, waits for it and writes the command's own rusage to its stdout.
_LAUNCHER = """\
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
_, status, u = os.wait4(pid, 0)
os.write(1, ("%d %d %r %r" % (os.waitstatus_to_exitcode(status), u.ru_maxrss, u.ru_utime,
                              u.ru_stime)).encode())
"""


#: Where the commands keep their compiled bytecode (set by main, under the work folder). An
#: installed lowprec has its .pyc files; a command that compiled every module it imports
#: (PYTHONDONTWRITEBYTECODE, as in the development environment) spent ~0.17 of its ~0.40
#: start-up CPU seconds doing that, which no user pays.
PYCACHE: str | None = None


def run(cmd, pythonpath=None, cwd=None) -> dict:
    """Runs ``cmd`` in ``cwd`` (not the repository root, whose ``lowprec/`` would shadow
    ``pythonpath`` under ``python -m``) through :data:`_LAUNCHER`; returns wall seconds,
    the command's own peak RSS bytes and CPU seconds, and the load."""
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    if PYCACHE is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = PYCACHE
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, *cmd], env=env,
                              cwd=cwd or tempfile.gettempdir(), stdout=subprocess.PIPE,
                              stderr=err, stdin=subprocess.DEVNULL)
        seconds = time.perf_counter() - t0
        err.seek(0)
        message = err.read().decode(errors="replace")
    code, maxrss, utime, stime = proc.stdout.split()
    if proc.returncode or int(code):
        raise SystemExit(f"{' '.join(cmd)} failed ({code}):\n{message}")
    return {"seconds": seconds, "peak_rss": int(maxrss) * 1024, "load": load,
            "cpu": float(utime) + float(stime)}


def median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="tensor size (float32 MiB)")
    ap.add_argument("--formats", nargs="+", default=["mxfp8_e4m3", "mxfp4"])
    ap.add_argument("--cases", nargs="+", default=["axis-1", "axis0", "1d"],
                    choices=["axis-1", "axis0", "1d", "shards", "model-bf16", "model-f32"])
    ap.add_argument("--model-mib", type=int, default=3090,
                    help="input size of the model-* cases (MiB)")
    ap.add_argument("--shards", type=int, default=16, help="files of the 'shards' case")
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
    global PYCACHE
    PYCACHE = os.path.join(work, "pycache")
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
        if "shards" in args.cases:
            files["shards"] = os.path.join(work, "sharded")
            make_sharded(files["shards"], args.size_mib * 2**20, args.shards, 2)
        for case, dt in (("model-bf16", "BF16"), ("model-f32", "F32")):
            if case in args.cases:
                files[case] = os.path.join(work, case)
                if not os.path.exists(os.path.join(files[case], "config.json")):
                    make_model(files[case], args.model_mib * 2**20, dt, 3)
        for pp in {None, args.baseline}:  # compiles each version's bytecode once
            run([sys.executable, "-c", "import lowprec.cli"], pp)
        floor = run([sys.executable, "-c", "import lowprec.cli"])
        copy_s, durable_s = {}, {}
        for key, path in files.items():
            t0 = time.perf_counter()
            if os.path.isdir(path):
                shutil.copytree(path, os.path.join(work, "copy.tmp"))
                copy_s[key] = time.perf_counter() - t0
                shutil.rmtree(os.path.join(work, "copy.tmp"))
            else:
                shutil.copyfile(path, os.path.join(work, "copy.tmp"))
                copy_s[key] = time.perf_counter() - t0
                os.unlink(os.path.join(work, "copy.tmp"))
            durable_s[key] = durable_copy(path, os.path.join(work, "copy.tmp"))
        print(f"tensor: {args.size_mib} MiB float32 ({side}x{side} matrix, {n // 32 * 32:,}-vector); "
              f"import-only peak RSS {floor['peak_rss'] / 1e6:.0f} MB, CPU {floor['cpu']:.2f} s; "
              f"cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}")
        header = ("case", "format", "op", "MB/s", "copy MB/s", "durable copy MB/s", "CPU s",
                  "idle MB/s",
                  "peak RSS MB", "bound MB", "ok", "vs baseline", "baseline CPU s",
                  "baseline idle MB/s", "CPU ratio", "baseline peak RSS MB", "load")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for case in args.cases:
            key = case if case in ("1d", "shards", "model-bf16", "model-f32") else "2d"
            src = files[key]
            if case == "shards":  # every shard's bytes; the bound is per largest tensor
                tensor_bytes = sum(os.path.getsize(os.path.join(src, f))
                                   for f in os.listdir(src) if f.endswith(".safetensors"))
                largest = tensor_bytes // (4 * args.shards)
            elif case.startswith("model"):  # the tensors' bytes (headers aside)
                with open(os.path.join(src, "model.safetensors.index.json")) as f:
                    tensor_bytes = json.load(f)["metadata"]["total_size"]
                largest = MODEL_D * MODEL_FF * (2 if case == "model-bf16" else 4)
            else:
                tensor_bytes = largest = os.path.getsize(src)  # header is tiny
            extra = {"axis-1": [], "axis0": ["--axis", "0"], "1d": ["--include", "weight"],
                     "shards": [], "model-bf16": [], "model-f32": []}[case]
            base = args.baseline if case in args.baseline_cases else None
            for fmt in args.formats:
                suffix = "" if case == "shards" or case.startswith("model") else ".safetensors"
                q = os.path.join(work, f"{case}-{fmt}{suffix}")
                d = os.path.join(work, f"{case}-{fmt}-back{suffix}")
                if case.startswith("model"):  # the error report written, as a user asks
                    extra = [*extra, "--report", os.path.join(work, f"{case}-{fmt}.json")]
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
                         "load": median([x["load"] for x in ours]),
                         "cpu": median([x["cpu"] for x in ours])}
                    bound = largest + BOUND_EXTRA
                    idle = tensor_bytes / (r["cpu"] / os.cpu_count()) / 1e6
                    row = {"case": case, "format": fmt, "op": op, "tensor_bytes": tensor_bytes,
                           "MBps": tensor_bytes / r["seconds"] / 1e6,
                           "copy_MBps": tensor_bytes / copy_s[key] / 1e6,
                           "durable_copy_MBps": tensor_bytes / durable_s[key] / 1e6,
                           "idle_MBps": idle,
                           "bound_bytes": bound, "ok": r["peak_rss"] <= bound, **r,
                           "runs": ours, "baseline_runs": theirs}
                    ratio = rss_base = cpu_base = idle_base = cpu_ratio = ""
                    if theirs:
                        row["speed_vs_baseline"] = median(
                            [b["seconds"] / a["seconds"] for a, b in zip(ours, theirs)])
                        row["baseline_peak_rss"] = max(b["peak_rss"] for b in theirs)
                        row["baseline_cpu"] = median([b["cpu"] for b in theirs])
                        row["cpu_vs_baseline"] = median(
                            [b["cpu"] / a["cpu"] for a, b in zip(ours, theirs)])
                        ratio = f"{row['speed_vs_baseline']:.2f}x"
                        rss_base = f"{row['baseline_peak_rss'] / 1e6:.0f}"
                        cpu_base = f"{row['baseline_cpu']:.2f}"
                        idle_base = f"{tensor_bytes / (row['baseline_cpu'] / os.cpu_count()) / 1e6:.0f}"
                        cpu_ratio = f"{row['cpu_vs_baseline']:.2f}x"
                    rows.append(row)
                    print(f"| {case} | {fmt} | {op} | {row['MBps']:.0f} | {row['copy_MBps']:.0f} | "
                          f"{row['durable_copy_MBps']:.0f} | {r['cpu']:.2f} | {idle:.0f} | "
                          f"{r['peak_rss'] / 1e6:.0f} | {bound / 1e6:.0f} | "
                          f"{'yes' if row['ok'] else 'NO'} | {ratio} | {cpu_base} | {idle_base} | "
                          f"{cpu_ratio} | {rss_base} | {r['load']:.2f} |", flush=True)
                for path in (d, q):
                    shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
                if case.startswith("model"):
                    os.unlink(os.path.join(work, f"{case}-{fmt}.json"))
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
        elif not args.keep:  # a given folder: keep its inputs (slow to make), drop outputs
            for case in args.cases:
                for fmt in args.formats:
                    for suffix in ("", "-back", ".safetensors", "-back.safetensors"):
                        path = os.path.join(work, f"{case}-{fmt}{suffix}")
                        if os.path.isdir(path):
                            shutil.rmtree(path, ignore_errors=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"size_mib": args.size_mib, "import_peak_rss": floor["peak_rss"],
                       "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
