"""The error-study notebooks: stored with their figures, and still true when executed.

Two layers:

* The committed notebooks (fast): every code cell ran, in order, without error; every cell that
  draws shows a real PNG of sane size (so a reader browsing the repository sees the figures);
  each notebook states its findings.
* Fresh execution (slow): each notebook runs top to bottom in a kernel of this interpreter
  (``scripts/run_notebooks.py``'s executor: a temporary kernel spec, ``JAX_PLATFORMS=cpu``,
  matplotlib's inline backend) and must render the same figures. In the default run the
  notebooks one worker executes share a kernel, its namespace cleared before each
  (``run_notebooks.SharedKernel``: one kernel start and the programs the notebooks share
  compiled once); the extended sweep starts a fresh kernel for each, as regenerating does. Each notebook asserts its
  findings in code cells, so a finding that stops holding fails here. The same run checks that
  the stored outputs are not stale: every number they print must equal the fresh run's within
  ``run_notebooks.RTOL`` (1e-6 relative) or one unit of its last printed digit; only cells
  tagged ``volatile`` (the provenance stamp: commit and package versions; the wall-clock time)
  are exempt. Regenerate the stored outputs with ``python scripts/run_notebooks.py``.

  The default run executes each notebook at its small problem size (``LOWPREC_NOTEBOOK_SIZE=
  small``: every cell and asserted finding, on fewer seeds and samples) and compares its numbers
  with the small run recorded in the notebook's metadata when it was regenerated; the extended
  sweep (``LOWPREC_FULL_SUITE=1``) executes the full study and compares it with the stored
  outputs, as ``python scripts/run_notebooks.py --check`` does.
"""

import importlib.util
import pathlib

import pytest

from helpers import tiers

nbformat = pytest.importorskip("nbformat", reason="nbformat is needed to read the notebooks")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
MAX_NOTEBOOK_BYTES = 600_000


def _runner():
    spec = importlib.util.spec_from_file_location("run_notebooks", ROOT / "scripts" / "run_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert len(names) >= 5, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_shows_its_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.name} is not stored as one top-to-bottom run (execution counts {counts}); "
        "regenerate it with: python scripts/run_notebooks.py " + str(path.relative_to(ROOT))
    )
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} stores an error output"
    pytest.importorskip("matplotlib", reason="decoding the stored figures needs matplotlib")
    runner = _runner()
    assert runner.figures(nb), f"{path.name} shows no figure"
    assert runner.check_figures(nb, path.name) == []
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES, f"{path.name} is {path.stat().st_size} bytes"
    assert any(c.cell_type == "markdown" and "## Findings" in c.source for c in nb.cells), (
        f"{path.name} states no findings"
    )
    # the outputs say what produced them: commit and package versions, in a volatile cell
    stamp = [c for c in code if runner.VOLATILE_TAG in c.metadata.get("tags", [])
             and "commit" in "".join(o.get("text", "") for o in c.outputs)]
    assert stamp, f"{path.name} has no provenance stamp (commit and versions)"
    text = "".join(o.get("text", "") for o in stamp[0].outputs)
    for package in ("lowprec", "jax", "numpy", "ml_dtypes", "pandas", "matplotlib", "python"):
        assert package in text, (path.name, package, text)
    # the default run's check of a small run has a record to compare with, cell for cell
    record = nb.metadata.get(runner.SMALL_RUN_KEY)
    assert record, (f"{path.name} records no small run; regenerate it with: "
                    "python scripts/run_notebooks.py " + str(path.relative_to(ROOT)))
    assert sorted(map(int, record["numbers"])) == sorted(runner.numbers(nb)), path.name
    assert record["figures"] == len(runner.figures(nb)), path.name


def test_stale_numbers_catches_changed_outputs():
    runner = _runner()

    def notebook(*texts, tags=()):
        nb = nbformat.v4.new_notebook()
        for t in texts:
            cell = nbformat.v4.new_code_cell("print()")
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=t)]
            cell.metadata["tags"] = list(tags)
            nb.cells.append(cell)
        return nb

    stored = notebook("SQNR 12.34 dB [12.30, 12.38], e4m3 at K=32, 2^-6, 1.5e-05")
    assert runner.stale_numbers(stored, stored) == []
    # a last-digit flip (a value on a rounding boundary) is within tolerance; more is not
    assert runner.stale_numbers(stored, notebook("SQNR 12.35 dB [12.30, 12.38], e4m3 at K=32, 2^-6, 1.6e-05")) == []
    assert runner.stale_numbers(stored, notebook("SQNR 12.37 dB [12.30, 12.38], e4m3 at K=32, 2^-6, 1.5e-05")) == [
        "notebook: cell 0, number 0: stored 12.34, fresh run 12.37"]
    assert runner.stale_numbers(stored, notebook("SQNR 12.34 dB [12.30, 12.38], e4m3 at K=32, 2^-7, 1.5e-05")) == [
        "notebook: cell 0, number 5: stored -6, fresh run -7"]
    assert runner.stale_numbers(stored, notebook("SQNR 12.34 dB")) == [
        "notebook: cell 0 prints 7 numbers stored, 1 fresh"]
    # volatile cells (the provenance stamp, timings) are not compared
    assert runner.stale_numbers(notebook("ran in 3.1 s", tags=["volatile"]),
                                notebook("ran in 9.9 s", tags=["volatile"])) == []
    # a small run is compared with the record of one, by the same rule
    small = notebook("SQNR 11.9 dB, 2^-6")
    assert runner.stale_small_numbers(stored, small) == [
        "notebook: no small run recorded (regenerate with scripts/run_notebooks.py)"]
    stored.metadata[runner.SMALL_RUN_KEY] = runner.small_run_record(small)
    assert stored.metadata[runner.SMALL_RUN_KEY] == {"numbers": {"0": "11.9 2 -6"}, "figures": 0}
    assert runner.stale_small_numbers(stored, small) == []
    assert runner.stale_small_numbers(stored, notebook("SQNR 11.7 dB, 2^-6")) == [
        "notebook: cell 0, number 0: stored 11.9, fresh run 11.7"]


def test_check_figures_catches_missing_and_broken_figures():
    pytest.importorskip("matplotlib")
    runner = _runner()
    nb = nbformat.v4.new_notebook()
    draws = nbformat.v4.new_code_cell("fig, ax = plt.subplots()")
    nb.cells = [draws]
    assert runner.check_figures(nb) == ["notebook: cell 0 draws but produced no image"]
    import base64

    draws.outputs = [nbformat.v4.new_output("display_data", {"image/png": base64.b64encode(b"GIF89a").decode()})]
    assert runner.check_figures(nb) == ["notebook: cell 0: not a PNG image"]
    assert runner.png_size(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x02\x00\x00\x00\x01\x00") == (512, 256)


@pytest.fixture(scope="module")
def shared_kernel():
    """The default run's kernel, shared by the notebooks this worker executes (None in the
    extended sweep: a fresh kernel each, as regenerating uses)."""
    for module in ("nbclient", "ipykernel", "matplotlib", "pandas"):
        pytest.importorskip(module, reason=f"executing the notebooks needs {module}")
    if tiers.full_suite():
        yield None
        return
    with _runner().SharedKernel("small", NOTEBOOK_DIR) as kernel:
        yield kernel


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_and_renders_its_figures(path, shared_kernel):
    runner = _runner()
    size = "full" if tiers.full_suite() else "small"
    # raises with the traceback if a cell (a finding) fails
    nb, seconds = runner.execute(path, size, kernel=shared_kernel)
    assert runner.check_figures(nb, path.name) == []
    stored = nbformat.read(path, as_version=4)
    assert len(runner.figures(nb)) == len(runner.figures(stored)), (
        f"{path.name} now draws a different number of figures than the stored copy; "
        "regenerate it with: python scripts/run_notebooks.py"
    )
    stale = (runner.stale_numbers(stored, nb, path.name) if size == "full"
             else runner.stale_small_numbers(stored, nb, path.name))
    assert not stale, (
        f"{path.name}'s stored outputs are stale ({len(stale)} numbers of its {size} run differ "
        "from a fresh run; regenerate with: python scripts/run_notebooks.py "
        + str(path.relative_to(ROOT)) + "):\n" + "\n".join(stale[:20])
    )
    print(f"{path.name}: executed at size {size} in {seconds:.1f} s")


@pytest.mark.slow
def test_shared_kernel_forgets_the_previous_notebook(shared_kernel, tmp_path):
    # The default run's shared kernel must not let a notebook lean on a name an earlier one
    # defined: what a fresh kernel would reject, it rejects.
    if shared_kernel is None:
        pytest.skip("the extended sweep runs each notebook in a fresh kernel")
    import nbclient

    runner = _runner()
    first, second = tmp_path / "first.ipynb", tmp_path / "second.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("leftover = 1")]), first)
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(leftover)")]), second)
    runner.execute(first, "small", kernel=shared_kernel)
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="NameError"):
        runner.execute(second, "small", kernel=shared_kernel)
