"""Executes the error-study notebooks and stores them with their outputs (figures included).

Usage::

    python scripts/run_notebooks.py                 # every notebooks/*.ipynb, in place
    python scripts/run_notebooks.py notebooks/03_mx_block_scaling.ipynb
    python scripts/run_notebooks.py --check         # execute, compare stored numbers, write nothing
    python scripts/run_notebooks.py --check --size small   # the test suite's run (see below)

Each notebook runs top to bottom in a fresh kernel of *this* interpreter (a kernel spec written
to a temporary directory, so no ``ipykernel install`` is needed and no other Python is picked
up), with ``JAX_PLATFORMS=cpu`` and matplotlib's inline backend, so every figure is rendered
as a PNG output that GitHub shows. Figures use a modest dpi (set in each notebook's first cell)
to keep the files small. A failing cell (each notebook asserts its findings) aborts with the
traceback and leaves the stored notebook untouched; a successful run replaces it atomically.
Volatile metadata (execution timings) is dropped, so a rerun with the same library versions
changes only what the computation changed.

Stored numbers must stay true: :func:`stale_numbers` compares every number printed in a stored
notebook's outputs with a fresh run's, within :data:`RTOL` or one unit of the last printed digit
(whichever is larger), ignoring cells tagged ``volatile`` (the provenance stamp — commit and
package versions — and the wall-clock time). The test suite (``tests/test_notebooks.py``)
imports :func:`execute`, :func:`check_figures` and :func:`stale_numbers` from here; its default
run executes the notebooks in one :class:`SharedKernel` per worker instead of a fresh kernel each.

Problem size. Each notebook reads ``LOWPREC_NOTEBOOK_SIZE`` (:data:`SIZE_ENV`) in its first cell:
``full`` (the default; the study as stored) or ``small`` (fewer seeds, samples and steps: every cell
and every asserted finding still runs, in a fraction of the time; a notebook's ``sized(full,
small)`` calls say which constants shrink). Regenerating stores the full run's outputs and, in
the notebook's metadata (:data:`SMALL_RUN_KEY`), the numbers a small run prints, so the default
test run executes the small version and still catches stale numbers (:func:`stale_small_numbers`),
while the extended sweep (``LOWPREC_FULL_SUITE=1``) and ``--check`` compare the full run with the
stored outputs.
"""

from __future__ import annotations

import argparse
import base64
import os
import pathlib
import re
import struct
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
KERNEL_NAME = "lowprec-notebooks-python"
CELL_TIMEOUT_S = 600

# The problem size a notebook runs at (read by each notebook's first cell).
SIZE_ENV = "LOWPREC_NOTEBOOK_SIZE"
SIZES = ("full", "small")
# nb.metadata[SMALL_RUN_KEY]: {"numbers": {cell index: "its number tokens, space-separated"},
# "figures": count} of a small run, recorded when the stored outputs (a full run) are regenerated.
SMALL_RUN_KEY = "lowprec_small_run"

# A rendered figure must be a real PNG of a sensible size: not a blank placeholder, not a
# 300-dpi poster that bloats the repository.
MIN_SIDE_PX, MAX_SIDE_PX = 150, 1600
MIN_PNG_BYTES, MAX_PNG_BYTES = 3_000, 400_000


def _kernel_manager(tmpdir: pathlib.Path, size: str = "full"):
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    env = {
        "JAX_PLATFORMS": "cpu",
        "MPLBACKEND": "module://matplotlib_inline.backend_inline",
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        "PYTHONHASHSEED": "0",
        # The notebooks' NumPy products are small ([2048, 32] x [32, 64]): OpenBLAS's worker
        # threads spin waiting for work and burned most of their CPU time (matmul_rel_error of
        # analysis.compare: 9-21 ms of CPU per call threaded, 0.6 ms on one thread; notebook
        # 03's first study 21.9 -> 10.2 CPU s). Same products: the threads split rows and
        # columns, not the sum.
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "1"),
        SIZE_ENV: size,
    }
    write_kernel_spec(
        tmpdir / KERNEL_NAME,
        overrides={"display_name": f"lowprec notebooks ({sys.executable})", "env": env},
    )
    ksm = KernelSpecManager(kernel_dirs=[str(tmpdir)], ensure_native_kernel=False)
    return KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)


def execute(path: pathlib.Path, size: str = "full", kernel: "SharedKernel | None" = None):
    """Runs the notebook at ``path`` in a fresh kernel at problem size ``size`` (one of
    :data:`SIZES`), or in ``kernel`` (a running :class:`SharedKernel` of that size, its
    namespace cleared first); returns (notebook node, seconds)."""
    import nbclient
    import nbformat

    if size not in SIZES:
        raise ValueError(f"size {size!r}: expected one of {SIZES}")
    if kernel is not None and kernel.size != size:
        raise ValueError(f"size {size!r}: the shared kernel runs size {kernel.size!r}")
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as tmp:
        if kernel is not None:
            kernel.reset()
        client = nbclient.NotebookClient(
            nb,
            km=_kernel_manager(pathlib.Path(tmp), size) if kernel is None else kernel.km,
            timeout=CELL_TIMEOUT_S,
            allow_errors=False,
            record_timing=False,
            resources={"metadata": {"path": str(path.parent)}},
        )
        start = time.perf_counter()
        try:
            client.execute()  # raises CellExecutionError (with the traceback) on a failing cell
        finally:
            if kernel is not None:
                if client.kc is not None:
                    client.kc.stop_channels()
            # nbclient shuts down only a kernel manager it made itself: given ours, it leaves
            # the kernel running (each holding 0.3-1 GiB until this process exits).
            elif client.km.has_kernel:
                client.km.shutdown_kernel(now=True)
        elapsed = time.perf_counter() - start
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    return nb, elapsed


class SharedKernel:
    """One kernel that runs several notebooks in turn (the test suite's default run).

    Before each notebook its namespace is cleared (``%reset -f``: every name an earlier
    notebook defined is gone, so a notebook that uses a name it does not define still fails).
    Modules stay imported and JAX keeps its compiled programs: a notebook after the first
    skips the kernel's start and its imports (~2 CPU s) and the compiles of programs an
    earlier one built. Not isolated: process state outside the namespace (JAX's caches,
    matplotlib's rcParams — which every notebook's first cell sets —, a module's own state).
    A leak that changed a result would show as a stale number: the test compares every
    number with the run recorded from fresh kernels. Regenerating and ``--check`` (and the
    extended sweep) run each notebook in a fresh kernel.

    Use as a context manager, or call :meth:`close`.
    """

    RESET = "%reset -f"

    def __init__(self, size: str, cwd: pathlib.Path = NOTEBOOK_DIR):
        if size not in SIZES:
            raise ValueError(f"size {size!r}: expected one of {SIZES}")
        self.size = size
        self._tmp = tempfile.TemporaryDirectory()
        self.km = _kernel_manager(pathlib.Path(self._tmp.name), size)
        self.km.start_kernel(cwd=str(cwd))

    def reset(self) -> None:
        """Clears the kernel's namespace (raises if the kernel died)."""
        import nbclient
        import nbformat

        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(self.RESET)])
        client = nbclient.NotebookClient(nb, km=self.km, timeout=CELL_TIMEOUT_S, allow_errors=False)
        try:
            client.execute()
        finally:
            if client.kc is not None:
                client.kc.stop_channels()

    def close(self) -> None:
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=True)
        self._tmp.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# A printed number matches a fresh run's if it differs by at most RTOL relative, or by one unit
# in its last printed decimal (a value on a rounding boundary may print either way). Integers
# (counts, sizes, exponents) must match exactly.
RTOL = 1e-6
VOLATILE_TAG = "volatile"
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w.])")


def _output_text(output) -> str:
    """The text of one output as a reader sees it (markdown/plain text; figures are checked
    by :func:`check_figures`, and an object repr next to a figure or markdown is skipped)."""
    if output.get("output_type") == "stream":
        return output.get("text", "")
    data = output.get("data", {})
    for mime in ("text/markdown", "text/latex"):
        if mime in data:
            return data[mime]
    if "image/png" in data:
        return ""
    return data.get("text/plain", "")


def numbers(nb) -> dict:
    """cell index -> list of the number tokens (strings) printed in its outputs, for every code
    cell not tagged ``volatile``."""
    out = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or VOLATILE_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        text = "".join(_output_text(o) for o in cell.get("outputs", []))
        out[i] = _NUMBER.findall(text)
    return out


def _last_digit(token: str) -> float:
    """One unit in the last printed decimal of a number token (0 for an integer)."""
    mantissa, _, exp = token.lower().partition("e")
    if "." not in mantissa and not exp:
        return 0.0
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return 10.0 ** (-decimals + (int(exp) if exp else 0))


def stale_numbers(stored, fresh, name: str = "notebook", rtol: float = RTOL) -> list[str]:
    """Where the numbers of ``stored`` disagree with a fresh run ``fresh`` (empty: none).

    Cells are matched by index, numbers by position within a cell; a different count of
    numbers in a cell is a difference too (a changed table or message).
    """
    return _compare(numbers(stored), numbers(fresh), name, rtol)


def small_run_record(nb) -> dict:
    """What :data:`SMALL_RUN_KEY` stores for ``nb``, a notebook run at size ``small``."""
    return {"numbers": {str(i): " ".join(v) for i, v in numbers(nb).items()},
            "figures": len(figures(nb))}


def stale_small_numbers(stored, fresh_small, name: str = "notebook", rtol: float = RTOL) -> list[str]:
    """Where a fresh small run ``fresh_small`` disagrees with the small run recorded in
    ``stored``'s metadata (empty: none); as :func:`stale_numbers`, figures counted too."""
    record = stored.metadata.get(SMALL_RUN_KEY)
    if not record:
        return [f"{name}: no small run recorded (regenerate with scripts/run_notebooks.py)"]
    problems = _compare({int(i): v.split() for i, v in record["numbers"].items()},
                        numbers(fresh_small), name, rtol)
    if record["figures"] != len(figures(fresh_small)):
        problems.append(f"{name}: the small run draws {len(figures(fresh_small))} figures, "
                        f"{record['figures']} recorded")
    return problems


def _compare(a: dict, b: dict, name: str, rtol: float) -> list[str]:
    problems = []
    if sorted(a) != sorted(b):
        return [f"{name}: the code cells differ (stored {sorted(a)}, fresh {sorted(b)})"]
    for i in a:
        if len(a[i]) != len(b[i]):
            problems.append(f"{name}: cell {i} prints {len(a[i])} numbers stored, {len(b[i])} fresh")
            continue
        for k, (s, f) in enumerate(zip(a[i], b[i])):
            tol = max(rtol * abs(float(f)), _last_digit(s), _last_digit(f)) * (1 + 1e-9)
            if abs(float(s) - float(f)) > tol:
                problems.append(f"{name}: cell {i}, number {k}: stored {s}, fresh run {f}")
    return problems


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; raises ValueError if it is not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG image")
    return struct.unpack(">II", data[16:24])


def figures(nb) -> list[tuple[int, bytes]]:
    """(cell index, PNG bytes) of every image output of the notebook."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for o in cell.get("outputs", []):
            data = o.get("data", {})
            if "image/png" in data:
                out.append((i, base64.b64decode(data["image/png"])))
    return out


def check_figures(nb, name: str = "notebook") -> list[str]:
    """Problems with the notebook's figures (empty list: every figure rendered and sane).

    Every code cell that draws (calls ``plt.`` / ``analysis.plot_``) must have produced a
    PNG; every PNG must decode, be between 150 and 1600 px a side and 3 KB to 400 KB, and
    not be a single flat colour.
    """
    problems = []
    drawn = {i for i, _ in figures(nb)}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and ("plt." in cell.source or "analysis.plot_" in cell.source):
            if "plt.rcParams" in cell.source and "subplots" not in cell.source and "plot_" not in cell.source:
                continue  # the set-up cell only configures matplotlib
            if i not in drawn:
                problems.append(f"{name}: cell {i} draws but produced no image")
    for i, png in figures(nb):
        try:
            w, h = png_size(png)
        except ValueError as e:
            problems.append(f"{name}: cell {i}: {e}")
            continue
        if not (MIN_SIDE_PX <= w <= MAX_SIDE_PX and MIN_SIDE_PX <= h <= MAX_SIDE_PX):
            problems.append(f"{name}: cell {i}: figure is {w}x{h} px")
        if not MIN_PNG_BYTES <= len(png) <= MAX_PNG_BYTES:
            problems.append(f"{name}: cell {i}: PNG of {len(png)} bytes")
        if _flat(png):
            problems.append(f"{name}: cell {i}: figure is a single flat colour")
    return problems


def _flat(png: bytes) -> bool:
    try:
        import io

        import matplotlib.image as mpimg

        pixels = mpimg.imread(io.BytesIO(png), format="png")
    except Exception:  # pragma: no cover - decoding problems are reported by png_size
        return False
    return float(pixels.std()) == 0.0


def _file_mode(path: pathlib.Path) -> int:
    """The file's current permission bits, or 0644 less the umask for a new file."""
    if path.exists():
        return path.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    return 0o644 & ~umask


def _write_atomically(nb, path: pathlib.Path) -> None:
    import nbformat

    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".ipynb.tmp")
    os.close(fd)
    try:
        nbformat.write(nb, tmp)
        os.chmod(tmp, _file_mode(path))   # mkstemp makes 0600; keep the notebook's own mode
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path,
                        help="notebooks to run (default: every notebooks/*.ipynb)")
    parser.add_argument("--check", action="store_true",
                        help="execute, check the figures and the stored numbers, write nothing")
    parser.add_argument("--size", choices=SIZES, default="full",
                        help="with --check: the problem size to run and compare (small: against "
                             "the small run recorded in the notebook's metadata)")
    parser.add_argument("--record-small", action="store_true",
                        help="run only the small version and record its numbers, keeping the "
                             "stored outputs (after changing only a notebook's small sizes)")
    args = parser.parse_args(argv)
    if args.size != "full" and not args.check:
        parser.error("--size applies to --check (regenerating runs both sizes)")
    paths = args.notebooks or sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    import nbformat

    total, failed = 0.0, False
    for path in paths:
        print(f"{path.name}: running ...", flush=True)
        stored = nbformat.read(path, as_version=4)
        if args.check:
            nb, seconds = execute(path, args.size)
            problems = check_figures(nb, path.name)
            problems += (stale_numbers(stored, nb, path.name) if args.size == "full"
                         else stale_small_numbers(stored, nb, path.name))
        else:
            # The stored outputs are a full run; the small run's numbers go into its metadata.
            nb, seconds = (stored, 0.0) if args.record_small else execute(path, "full")
            small, small_seconds = execute(path, "small")
            seconds += small_seconds
            problems = check_figures(nb, path.name) + check_figures(small, path.name + " (small)")
            nb.metadata[SMALL_RUN_KEY] = small_run_record(small)
        total += seconds
        for p in problems:
            print("  " + p)
        failed |= bool(problems)
        n_fig = len(figures(nb))
        if not args.check and not problems:
            _write_atomically(nb, path)
        size = path.stat().st_size / 1e3
        print(f"{path.name}: {seconds:.1f} s, {n_fig} figures"
              + ("" if args.check else f", stored ({size:.0f} KB)"), flush=True)
    print(f"total {total:.1f} s for {len(paths)} notebooks")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
