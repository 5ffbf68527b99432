"""Time and peak memory of a test run: the numbers the README states about the suite.

Run: ``python scripts/suite_footprint.py [pytest arguments]`` (e.g. ``-m "not slow"``). It
runs ``python -m pytest`` with those arguments and samples, every 0.2 s, the resident memory
(RSS) of pytest and every process under it (the xdist workers, the notebook kernels, the
subprocesses of the CLI and sharding tests). It prints pytest's own output, then the wall
time, the peak of the summed RSS over the whole tree (what the machine must hold at once) and
the peak RSS of the largest single process. Needs psutil (installed with the notebooks'
ipykernel). Exits with pytest's status.
"""

from __future__ import annotations

import subprocess
import sys
import time

try:
    import psutil
except ImportError:  # pragma: no cover - psutil comes with ipykernel ([test] extra)
    sys.exit("suite_footprint.py needs psutil: pip install psutil")


def _tree_rss(root: psutil.Process) -> tuple:
    """(summed RSS, largest single RSS) in bytes of ``root`` and its descendants."""
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


def main(argv: list) -> int:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *argv])
    root = psutil.Process(proc.pid)
    peak_total = peak_one = 0
    while proc.poll() is None:
        total, one = _tree_rss(root)
        peak_total, peak_one = max(peak_total, total), max(peak_one, one)
        time.sleep(0.2)
    wall = time.perf_counter() - start
    print(f"suite_footprint: {wall / 60:.1f} min wall, peak RSS {peak_total / 2**30:.2f} GiB "
          f"summed over the process tree, {peak_one / 2**30:.2f} GiB in the largest process "
          f"({psutil.cpu_count()} cores)")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
