"""Time, CPU and peak memory of a test run: the numbers the README states about the suite.

Run: ``python scripts/suite_footprint.py [--profile DIR] [pytest arguments]`` (e.g.
``-m "not slow"``). It runs ``python -m pytest`` with those arguments and samples, every 0.2 s,
the resident memory (RSS) of pytest and every process under it (the xdist workers, the
notebook kernels, the subprocesses of the CLI and sharding tests). It prints pytest's own
output, then the wall time, the CPU seconds of the whole process tree, the peak of the summed
RSS over the tree (what the machine must hold at once) and the peak RSS of the largest single
process. Exits with pytest's status. Needs psutil (installed with the notebooks' ipykernel).

On a machine others are using, the wall time measures them too; the CPU seconds do not.
``CPU seconds / cores`` is what the run would take on the same cores left idle, if the work
divides evenly between the xdist workers; the profile says whether it does.

``--profile DIR`` also records, per test, CPU seconds (its own and its subprocesses'), wall
seconds and peak RSS (tests/helpers/footprint.py, via ``--footprint-log``) and prints where
they go: the top files and tests, each worker's share, and an estimate of the idle wall time.
``python scripts/suite_footprint.py --report DIR`` prints that from an earlier profile (or
from several, e.g. one per test file: it reads every ``*.jsonl`` under DIR).
``python scripts/suite_footprint.py --per-file DIR [files] [pytest arguments]`` profiles each test
file (every tests/test_*.py unless files are named) in its own serial run (``-n 0``, one process at a time: for a shared machine, where CPU
seconds per file are what can be measured) into ``DIR/<file>/`` and prints the same report
plus each file's whole-tree CPU seconds, wall time and peak memory.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30


def _tree_rss(root) -> tuple:
    """(summed RSS, largest single RSS) in bytes of ``root`` and its descendants."""
    import psutil

    total = largest = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    for p in procs:
        try:
            rss = p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += rss
        largest = max(largest, rss)
    return total, largest


def _load(directory: Path) -> tuple:
    """(test records, session records) of every ``*.jsonl`` under ``directory``."""
    tests, sessions = [], []
    for path in sorted(directory.rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            record["log"] = str(path.relative_to(directory))
            (sessions if "session" in record else tests).append(record)
    return tests, sessions


def report(directory: Path, cores: int, top: int = 25) -> None:
    """Prints where the CPU seconds and memory of a profiled run went."""
    tests, sessions = _load(directory)
    if not tests:
        print(f"suite_footprint: no test records under {directory}")
        return
    for t in tests:
        t["total"] = t["cpu"] + t["child_cpu"]
        t["file"] = t["test"].split("::")[0]
    files = collections.defaultdict(lambda: dict(n=0, cpu=0.0, child=0.0, peak=0, child_peak=0,
                                                  quick=0.0, compiles=0))
    for t in tests:
        f = files[t["file"]]
        f["n"] += 1
        f["cpu"] += t["cpu"]
        f["child"] += t["child_cpu"]
        f["compiles"] += t.get("compiles", 0)
        f["peak"] = max(f["peak"], t["peak"])
        f["child_peak"] = max(f["child_peak"], t["child_peak"])
        if not t.get("slow"):
            f["quick"] += t["total"]
    test_cpu = sum(t["total"] for t in tests)
    quick_cpu = sum(t["total"] for t in tests if not t.get("slow"))

    print(f"\n{'file':44} {'tests':>6} {'CPU s':>8} {'subproc':>8} {'quick s':>8} "
          f"{'compiles':>8} {'peak RSS':>9} {'subproc RSS':>11}")
    for name, f in sorted(files.items(), key=lambda kv: -(kv[1]["cpu"] + kv[1]["child"]))[:top]:
        print(f"{name:44} {f['n']:6d} {f['cpu']:8.1f} {f['child']:8.1f} {f['quick']:8.1f} "
              f"{f['compiles']:8d} {f['peak'] / GIB:8.2f}G {f['child_peak'] / GIB:10.2f}G")
    print(f"\ntop {top} tests by CPU seconds (own + subprocesses)")
    for t in sorted(tests, key=lambda t: -t["total"])[:top]:
        print(f"  {t['total']:7.1f} s  {t['test']}" + ("" if t.get("slow") else "  [quick]"))
    print(f"\ntop {top // 2} tests by subprocess RSS (summed over its live subprocesses)")
    for t in sorted(tests, key=lambda t: -t["child_peak"])[: top // 2]:
        if not t["child_peak"]:
            break
        print(f"  {t['child_peak'] / GIB:6.2f} GiB  {t['test']}")
    print(f"\ntop {top // 2} RSS growths (a test after which its process holds more)")
    by_log = collections.defaultdict(list)
    for t in tests:
        by_log[t["log"]].append(t)
    growth = []
    for records in by_log.values():
        for before, after in zip(records, records[1:]):
            growth.append((after["rss"] - before["rss"], after["test"]))
    for delta, name in sorted(growth, reverse=True)[: top // 2]:
        print(f"  {delta / GIB:+6.2f} GiB  {name}")

    print(f"\nper process ({len(sessions)}): CPU s, of which start-up (imports, collection), "
          "peak RSS")
    for s in sessions[:8]:
        print(f"  {s['log']:40} {s['cpu']:8.1f} {s['startup_cpu']:7.1f} "
              f"{s['maxrss'] / GIB:6.2f}G")
    if len(sessions) > 8:
        print(f"  ... {len(sessions) - 8} more")
    longest = max(tests, key=lambda t: t["total"])
    print(f"\n{len(tests)} tests: {test_cpu:.0f} CPU s in tests ({quick_cpu:.0f} in the quick "
          f"tier), {sum(s['startup_cpu'] for s in sessions):.0f} CPU s of start-up over "
          f"{len(sessions)} processes; the longest test {longest['total']:.1f} s")
    print(f"estimated idle wall on {cores} cores = CPU s / {cores} + one worker's start-up: "
          f"{test_cpu / cores / 60:.1f} min (+ start-up), quick tier "
          f"{quick_cpu / cores / 60:.1f} min")


def _measure(argv: list) -> tuple:
    """Runs ``python -m pytest *argv``; returns (returncode, wall s, CPU s of the process tree,
    peak summed RSS, peak RSS of one process)."""
    import psutil

    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    # PYTHONSAFEPATH: `python -m` would put the working directory on sys.path, where CI's
    # plain `pytest` does not, and a test importing the repository's un-installed folders
    # (`reference`, `formats`) would pass here and fail in CI.
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *argv], env=env)
    root = psutil.Process(proc.pid)
    peak_total = peak_one = 0
    while proc.poll() is None:
        total, one = _tree_rss(root)
        peak_total, peak_one = max(peak_total, total), max(peak_one, one)
        time.sleep(0.2)
    wall = time.perf_counter() - start
    # Every process of the tree was waited for by its parent, so its CPU time is counted here.
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime - cpu0.ru_utime - cpu0.ru_stime
    return proc.returncode, wall, cpu, peak_total, peak_one


def per_file(directory: Path, argv: list, cores: int) -> int:
    """Profiles each tests/test_*.py (or each test file named in ``argv``) in its own serial
    pytest run (``-n 0``; one process at a time, for a machine others are using), into
    ``directory/<file>/``, then reports them together. The per-file table's CPU seconds add up to the default run's, less the xdist
    workers' start-up."""
    files = [Path(a) for a in argv if a.endswith(".py") and Path(a).is_file()]
    argv = [a for a in argv if Path(a) not in files]
    files = files or sorted((Path(__file__).resolve().parents[1] / "tests").glob("test_*.py"))
    status, rows = 0, []
    for path in files:
        log = directory / path.stem
        rc, wall, cpu, peak_total, _ = _measure(
            [str(path), "-n", "0", "-q", "-p", "no:cacheprovider", f"--footprint-log={log}", *argv])
        if rc not in (0, 5):  # 5: every test deselected (e.g. -m "not slow")
            status = status or rc
        rows.append((path.name, rc, wall, cpu, peak_total))
    report(directory, cores)
    print(f"\n{'file':44} {'rc':>3} {'wall s':>8} {'CPU s':>8} {'peak RSS':>9}  (whole process tree)")
    for name, rc, wall, cpu, peak in sorted(rows, key=lambda r: -r[3]):
        print(f"{name:44} {rc:3d} {wall:8.1f} {cpu:8.1f} {peak / GIB:8.2f}G")
    total = sum(r[3] for r in rows)
    print(f"suite_footprint: {len(rows)} files, {total:.0f} CPU s in all "
          f"({total / cores / 60:.1f} min on {cores} idle cores if evenly divided)")
    return status


def main(argv: list) -> int:
    cores = os.cpu_count() or 1
    if argv[:1] == ["--report"]:
        report(Path(argv[1]), cores)
        return 0
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with ipykernel ([test] extra)
        sys.exit("suite_footprint.py needs psutil: pip install psutil")
    if argv[:1] == ["--per-file"]:
        return per_file(Path(argv[1]), argv[2:], cores)
    profile = None
    if argv[:1] == ["--profile"]:
        profile, argv = Path(argv[1]), argv[2:]
        argv = [*argv, f"--footprint-log={profile}"]
    rc, wall, cpu, peak_total, peak_one = _measure(argv)
    if profile is not None:
        report(profile, cores)
    print(f"suite_footprint: {wall / 60:.1f} min wall, {cpu:.0f} CPU s over the process tree "
          f"({cpu / cores / 60:.1f} min on {cores} idle cores if evenly divided), peak RSS "
          f"{peak_total / GIB:.2f} GiB summed over the process tree, {peak_one / GIB:.2f} GiB "
          f"in the largest process ({psutil.cpu_count()} cores)")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
