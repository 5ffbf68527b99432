"""docs/design.md's module map and README's layout row name exactly the files of the code.

The module map (docs/design.md §7) has one table row per file under ``lowprec/``,
``formats/`` and ``reference/``, first cell the file's path in backticks; the README's
``lowprec/`` layout row names every top-level module and subpackage of ``lowprec/``. The
expected set is the tree on disk (bytecode caches aside), so a module added, renamed or
removed without its line here fails.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
README = ROOT / "README.md"
PACKAGES = ("lowprec", "formats", "reference")

_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|(.*)\|\s*$")


def _files() -> set[str]:
    """Repository-relative paths of every file under the packages (no caches)."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            rel = path.relative_to(ROOT)
            # Build outputs (bytecode, the native kernel's shared library) are not sources.
            if (path.is_file() and "__pycache__" not in rel.parts
                    and path.suffix not in (".pyc", ".so", ".pyd", ".dylib")):
                found.add(rel.as_posix())
    return found


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def _map_rows() -> list[tuple[str, str]]:
    section = _section(DESIGN.read_text(encoding="utf-8"), "\n## 7. ")
    return [(m.group(1), m.group(2).strip()) for line in section.splitlines()
            if (m := _ROW.match(line))]


def test_the_tree_is_found():
    # Guards the comparisons below: an empty walk would make them vacuous.
    files = _files()
    assert {"lowprec/__init__.py", "formats/elements.json", "reference/mx.py"} <= files
    assert len(files) > 50


def test_module_map_names_every_file_and_only_files():
    rows = _map_rows()
    paths = [path for path, _ in rows]
    duplicates = sorted({p for p in paths if paths.count(p) > 1})
    assert not duplicates, f"named twice in the module map of docs/design.md §7: {duplicates}"
    files = _files()
    missing = sorted(files - set(paths))
    stale = sorted(set(paths) - files)
    assert not (missing or stale), (
        f"docs/design.md §7: add a row (path | job) for {missing}; "
        f"remove or fix the rows naming files that do not exist: {stale}")


def test_every_module_has_a_job():
    empty = [path for path, job in _map_rows() if not job or "|" in job]
    assert not empty, f"give these rows of docs/design.md §7 one job (one cell): {empty}"


def _readme_lowprec_row() -> str:
    """The second cell of README.md's layout row for ``lowprec/``."""
    head = "| `lowprec/` |"
    rows = [line for line in README.read_text(encoding="utf-8").splitlines()
            if line.startswith(head)]
    assert len(rows) == 1, "README.md's layout table must have one `lowprec/` row"
    return rows[0][len(head):]


def test_readme_layout_row_names_every_lowprec_module():
    names = set(re.findall(r"`([^`]+)`", _readme_lowprec_row()))
    top = ROOT / "lowprec"
    modules = {p.stem for p in top.glob("*.py") if p.stem != "__init__"}
    packages = {p.name for p in top.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    missing = sorted(m for m in modules if m not in names and f"{m}.py" not in names)
    missing += sorted(f"{p}/" for p in packages if f"{p}/" not in names)
    # Every module-like name in the row exists: `_name`, `name.py` or `package/`.
    stale = sorted(
        n for n in names
        if (n.startswith("_") and n not in modules)
        or (n.endswith(".py") and "/" not in n and n[:-3] not in modules)
        or (n.endswith("/") and n[:-1] not in packages)
    )
    assert not (missing or stale), (
        f"README.md's `lowprec/` row: name {missing}; remove or fix the names of modules "
        f"that do not exist: {stale}")


#: Identifiers with "native" in them that name the C++ kernels (``lowprec/kernels/_cpu_native.py``
#: and the passes it loads): the one thing the word means (docs/design.md, "**Words.**").
NATIVE_NAMES = {"_cpu_native", "_native_cpu_can_run", "native", "native_quantize_serves",
                "native_status"}


def _identifiers(tree) -> set[str]:
    import ast

    names = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, ast.alias):
            names.update(filter(None, (n.name.rpartition(".")[2], n.asname)))
        elif isinstance(n, ast.arg):
            names.add(n.arg)
    return names


def test_native_names_only_the_cpp_kernels():
    """Every identifier of lowprec's code that says "native" is one of the C++ kernels' names,
    as docs/design.md says; a new one (say, for XLA's hardware-float path) must be added
    here, on purpose, or take another word."""
    import ast

    assert '"Native" names only the C++ kernels' in DESIGN.read_text(encoding="utf-8")
    found = {}
    for path in (ROOT / "lowprec").rglob("*.py"):
        for name in _identifiers(ast.parse(path.read_text(encoding="utf-8"))):
            if "native" in name.lower():
                found.setdefault(name, path.relative_to(ROOT).as_posix())
    unknown = {n: f for n, f in found.items() if n not in NATIVE_NAMES}
    assert not unknown, f"'native' means the C++ kernels only; found {unknown}"
    stale = NATIVE_NAMES - set(found)
    assert not stale, f"no longer in the code, drop from the lists here: {sorted(stale)}"
