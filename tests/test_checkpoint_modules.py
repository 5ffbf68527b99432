"""lowprec's modules use each other through their public names only (the checkpoint package
and the CLI strictly, every other module of the package too).

A module's interface is its names without a leading underscore: no module of
``lowprec.checkpoint`` (nor ``lowprec.cli``) imports another module's private name or
reaches one as ``module._name``, and none imports a module of the package inside a function
(an import cycle hidden from the module's header).
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib

import pytest

import lowprec

ROOT = pathlib.Path(lowprec.__file__).parent
FILES = sorted((ROOT / "checkpoint").glob("*.py")) + [ROOT / "cli.py"]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _package(path: pathlib.Path) -> str:
    """The package a relative import in ``path`` starts from."""
    return ".".join(path.parent.relative_to(ROOT.parent).parts)


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _violations(source: str, package: str) -> list:
    tree = ast.parse(source)
    modules, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                modules.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                if node.level else node.module
            for alias in node.names:
                if _is_module(f"{base}.{alias.name}"):
                    modules.add(alias.asname or alias.name)
                elif _private(alias.name):
                    found.append(f"line {node.lineno}: imports {base}.{alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules and _private(node.attr)):
            found.append(f"line {node.lineno}: uses {node.value.id}.{node.attr}")
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.level:
                    target = importlib.util.resolve_name(
                        "." * node.level + (node.module or ""), package)
                    if target in JAX_MODULES or {f"{target}.{a.name}" for a in node.names} \
                            <= JAX_MODULES:
                        continue
                    found.append(f"line {node.lineno}: imports .{node.module or ''} inside "
                                 f"{fn.name}()")
    return found


#: Library modules that import JAX, which the checkpoint package imports inside the
#: functions that use them, so that the command line's native path imports no JAX
#: (tests/test_checkpoint_nojax.py). Not a hidden cycle: test_import_graph counts those
#: imports as edges like any other, and none of these modules imports lowprec.checkpoint.
JAX_MODULES = {"lowprec._codec", "lowprec._dtypes", "lowprec._mx", "lowprec._mxarray",
               "lowprec._options", "lowprec._mxfp4_nvfp4", "lowprec.kernels._mx_quantize_cpu"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_private_name_across_modules(path):
    assert _violations(path.read_text(encoding="utf-8"), _package(path)) == []


def test_the_check_sees_violations():
    """The scan above finds each kind of violation (so that passing means something)."""
    bad = ("from . import _convert as cv\nfrom ._atomic import _LIVE\n"
           "def f():\n    from . import _pipeline\n    return cv._compile\n")
    got = _violations(bad, "lowprec.checkpoint")
    assert len(got) == 3, got
    assert any("_LIVE" in v for v in got) and any("cv._compile" in v for v in got)
    assert any("inside f()" in v for v in got)
    # a JAX module imported where it is used is allowed; a checkpoint module is not
    lazy = "def g():\n    from .._mx import quantize_mx\n    from . import _chunk\n"
    assert [v for v in _violations(lazy, "lowprec.checkpoint") if "inside" in v] == [
        "line 3: imports . inside g()"]


ALL_FILES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_across_modules_anywhere_in_lowprec(path):
    """The whole package keeps to public names across modules too (its private modules'
    names without a leading underscore are their interface); imports inside functions are
    allowed outside the checkpoint package (lazy imports of the optional extras)."""
    found = _violations(path.read_text(encoding="utf-8"), _package(path))
    assert [v for v in found if " inside " not in v] == []
