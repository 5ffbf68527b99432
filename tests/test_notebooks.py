"""Executes every notebook in notebooks/ (the error studies) and checks they are stored clean.

Each notebook asserts its own findings in code cells, so a finding that stops holding fails
here. The kernel is the interpreter running pytest: a kernel spec pointing at
``sys.executable`` is written to a temporary directory and used through a private
``KernelSpecManager``, so neither a user-level ``python3`` spec (which may point at another
Python) nor a missing one matters on a fresh CI machine. The kernel runs with
``MPLBACKEND=Agg`` and ``JAX_PLATFORMS=cpu``; after the last cell every open figure is drawn,
so plotting errors that only appear at render time are caught too.
"""

import pathlib
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is needed to run the notebooks")
nbclient = pytest.importorskip("nbclient", reason="nbclient is needed to run the notebooks")
pytest.importorskip("ipykernel", reason="ipykernel is needed to run the notebooks")
pytest.importorskip("matplotlib", reason="the notebooks plot with matplotlib")

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL_NAME = "lowprec-test-python"
CELL_TIMEOUT_S = 300

# Appended to each executed copy: render every open figure (Agg draws nothing otherwise).
_DRAW_ALL = """
import io as _io
import matplotlib.pyplot as _plt
for _n in _plt.get_fignums():
    _plt.figure(_n).savefig(_io.BytesIO(), format="png", dpi=50)
_plt.close("all")
"""


@pytest.fixture(scope="module")
def kernel_spec_manager(tmp_path_factory):
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager

    kernels = tmp_path_factory.mktemp("kernels")
    env = {"MPLBACKEND": "Agg", "JAX_PLATFORMS": "cpu", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    write_kernel_spec(
        kernels / KERNEL_NAME,
        overrides={"display_name": f"lowprec tests ({sys.executable})", "env": env},
    )
    return KernelSpecManager(kernel_dirs=[str(kernels)], ensure_native_kernel=False)


def test_there_are_notebooks():
    names = [p.name for p in NOTEBOOKS]
    assert len(names) >= 4, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: cell {i} has outputs; strip them"
            assert cell.execution_count is None, f"{path.name}: cell {i} has an execution count"
    assert any(
        c.cell_type == "markdown" and "Findings" in c.source for c in nb.cells
    ), f"{path.name} states no findings"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, kernel_spec_manager):
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(_DRAW_ALL))
    km = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=kernel_spec_manager)
    client = nbclient.NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError (with the traceback) on any failing cell
    elapsed = time.perf_counter() - start
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "error"
    ]
    assert not errors, errors
    print(f"{path.name}: executed in {elapsed:.1f} s")
