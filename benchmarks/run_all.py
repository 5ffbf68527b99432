"""Runs every benchmark once and rewrites the tables of benchmarks/README.md from that run.

Usage (from the repository root, lowprec installed)::

    python benchmarks/run_all.py            # full sizes; ~3 min on a 2-core CPU
    python benchmarks/run_all.py --quick    # small sizes, to check the pipeline
    python benchmarks/run_all.py --no-readme --out results/   # keep JSON + tables only

Each benchmark runs in its own process (``bench_codec.py``, ``bench_mx.py``,
``bench_matmul.py``), with ``--json`` and ``--markdown`` into the output folder (default: a
temporary one). The README sections between ``<!-- bench:NAME:begin -->`` and
``<!-- bench:NAME:end -->`` are then replaced by the Markdown tables, and the file is
rewritten atomically; nothing else in it changes.

Allocator: by default the benchmarks run with jemalloc preloaded when it is installed
(``libjemalloc.so.2``, Debian/Ubuntu package ``libjemalloc2``), with its page purging off
(``MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1``), so XLA's output buffers are reused
instead of coming from fresh pages on every call (see ``_timing.py``). ``--allocator glibc``
runs with the system malloc. Every table states the allocator it ran with, the load average
at its start, and the page faults per call of each lowprec row.

Run it on an otherwise idle machine: ratios between methods are measured in interleaved
rounds and hold up under background load, absolute throughputs do not.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _timing import write_atomic  # noqa: E402

README = os.path.join(HERE, "README.md")
BENCHMARKS = {
    # name: (script, full-run arguments, --quick arguments)
    "codec": ("bench_codec.py", [], ["--quick"]),
    "mx": ("bench_mx.py", [], ["--quick"]),
    "matmul": ("bench_matmul.py", [], ["--sizes", "256", "512", "--reps", "3"]),
}
JEMALLOC_GLOBS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib*/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so*",
)
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def find_jemalloc():
    for pattern in JEMALLOC_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def child_env(allocator: str) -> dict:
    env = dict(os.environ)
    if allocator == "glibc":
        return env
    lib = find_jemalloc()
    if lib is None:
        if allocator == "jemalloc":
            sys.exit("run_all.py: --allocator jemalloc, but libjemalloc.so.2 is not installed "
                     "(apt-get install libjemalloc2, or run with --allocator glibc)")
        print("run_all.py: jemalloc not found; running with glibc malloc (page faults per call "
              "are reported in the tables)", flush=True)
        return env
    preload = " ".join(v for v in (env.get("LD_PRELOAD", ""), lib) if v)
    env["LD_PRELOAD"] = preload
    env["MALLOC_CONF"] = JEMALLOC_CONF
    return env


def splice(readme: str, name: str, body: str) -> str:
    """``readme`` with the text between the markers of section ``name`` replaced by ``body``."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(readme):
        raise SystemExit(f"run_all.py: {README} has no {begin} ... {end} section to replace")
    return pattern.sub(lambda _: f"{begin}\n{body.strip()}\n{end}", readme)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (checks the pipeline)")
    p.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), default=sorted(BENCHMARKS),
                   help="run these benchmarks only (their README sections are replaced)")
    p.add_argument("--out", metavar="DIR", help="keep the JSON and Markdown results here")
    p.add_argument("--no-readme", action="store_true", help="do not rewrite benchmarks/README.md")
    p.add_argument("--allocator", choices=("auto", "jemalloc", "glibc"), default="auto")
    args = p.parse_args(argv)

    out = args.out or tempfile.mkdtemp(prefix="lowprec-bench-")
    os.makedirs(out, exist_ok=True)
    env = child_env(args.allocator)
    tables = {}
    for name in args.only:
        script, full, quick = BENCHMARKS[name]
        md, js = os.path.join(out, f"{name}.md"), os.path.join(out, f"{name}.json")
        cmd = [sys.executable, os.path.join(HERE, script), "--markdown", md, "--json", js]
        cmd += quick if args.quick else full
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, check=True)
        print(f"== {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        with open(md) as f:
            tables[name] = f.read()
    if not args.no_readme:
        with open(README) as f:
            text = f.read()
        for name, body in tables.items():
            text = splice(text, name, body)
        write_atomic(README, text)
        print(f"rewrote the {', '.join(tables)} tables of {README}")
    print(f"results (JSON with every sample, Markdown tables): {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
