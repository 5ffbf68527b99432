"""lowprec's own imports form no circle (issue 38): a module imports only modules below it.

The graph is read from the source with ``ast``: every ``import`` / ``from ... import`` of a
lowprec module, at module level or inside a function (a deferred import is still a
dependency; deferring one only hides a circle from the interpreter). ``from . import x``
where ``x`` is a submodule is an edge to that submodule, and ``from .x import y`` is an edge
to ``.x`` (and to ``.x.y`` when that is a submodule). Importing a submodule also runs its
package's ``__init__``; that implicit edge is not counted, since ``lowprec/__init__.py``
imports the public API from every layer by design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lowprec

ROOT = Path(lowprec.__file__).parent

#: Circles that are allowed, each with its reason. Edges are (importer, imported).
ALLOWED_EDGES = {
    # Type-only: _scheme.py imports ElementFormat under `if TYPE_CHECKING:` for annotations;
    # nothing of _format is used at run time (_format imports _scheme for real).
    ("lowprec._scheme", "lowprec._format"): "type-only (TYPE_CHECKING) annotation import",
    # Type-only too: check_rounding's `fmt: ElementFormat` annotation; _format needs
    # _rounding at run time (through _tapered's integer rounding).
    ("lowprec._rounding", "lowprec._format"): "type-only (TYPE_CHECKING) annotation import",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, level: int, module) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def import_graph() -> dict:
    """{module: {imported lowprec module: line}} for every module of the package."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                # `from pkg import submodule` imports the submodule; any other name is pkg's
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            for t in targets:
                # `import lowprec.x.y` and `from lowprec.x import y` reach the deepest module
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("lowprec"):
                    edges.setdefault(t, node.lineno)
        graph[name] = edges
    return graph


def _cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _without_allowed(graph: dict) -> dict:
    return {v: {w: ln for w, ln in ws.items() if (v, w) not in ALLOWED_EDGES}
            for v, ws in graph.items()}


def test_the_graph_is_read():
    # The reader sees what it should: known edges of each kind (module-level, deferred,
    # relative from a subpackage), so an empty graph cannot pass the test below.
    g = import_graph()
    assert "lowprec._format" in g["lowprec._mx"]
    assert "lowprec.kernels._dispatch" in g["lowprec._mx"]
    assert "lowprec._format" in g["lowprec.kernels._dispatch"]
    assert ("lowprec._scheme", "lowprec._format") in {(v, w) for v in g for w in g[v]}
    assert len(g) > 60


def test_no_import_cycles():
    cycles = _cycles(_without_allowed(import_graph()))
    assert not cycles, "import cycles among lowprec modules: " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_allowed_cycle_edges_are_still_needed():
    # Each allowed edge exists and closes a circle; remove it from the list when it no longer does.
    g = import_graph()
    for (v, w), why in ALLOWED_EDGES.items():
        assert w in g[v], f"allowed edge {v} -> {w} ({why}) is gone: drop it from ALLOWED_EDGES"
        assert any(v in c and w in c for c in _cycles(g)), f"{v} -> {w} closes no circle"


def test_the_reader_finds_a_circle():
    toy = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert _cycles(toy) == [["a", "b", "c"]]


#: Repository folders installed under another name (pyproject's package-dir). Under CI's plain
#: ``pytest`` (no working directory on sys.path) their on-disk names do not import.
INSTALLED_AS = {"reference": "lowprec_reference", "formats": "lowprec_formats"}


def _imports_of(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno


def test_nothing_imports_the_uninstalled_folder_names():
    # Stop 42's CI failed on `from reference import mx` in one test file, which passed locally
    # only because `python -m pytest` puts the working directory on sys.path.
    repo = ROOT.parent
    found = [f"{p.relative_to(repo)}:{line} imports {name!r}; use {INSTALLED_AS[name.split('.')[0]]!r}"
             for folder in ("tests", "benchmarks", "scripts", "lowprec", "examples")
             for p in sorted((repo / folder).rglob("*.py"))
             for name, line in _imports_of(p) if name.split(".")[0] in INSTALLED_AS]
    assert not found, "\n".join(found)


def test_the_uninstalled_folder_check_reads_imports():
    # The reader above sees both import forms, so an empty scan cannot pass vacuously.
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.py"
        p.write_text("import reference.mx\nfrom formats import x\nfrom .reference import y\n")
        assert list(_imports_of(p)) == [("reference.mx", 1), ("formats", 2)]
