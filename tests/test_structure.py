"""The shape of the code: no import circles, the engine free of front ends, no file too long.

Every module's imports are read from its source (those inside functions too, since a circle
through a function-level import still ties two modules together), so these checks hold without
importing anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "app")
FRONT_ENDS = ("app", "PySide6", "pyqtgraph", "shiboken6")  # what the engine may never import
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Every module ``path`` imports, wherever the import statement is: ``from a.b import c`` counts
    as a.b, and as a.b.c when that is a module itself."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {name: {m for m in imports_of(path, name, known) if m in known and m != name}
            for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_import_reader_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    from engine.errors import CadenceError\n")
    assert imports_of(source, "m", {"engine.errors"}) >= {"os", "engine.errors"}


def test_no_import_circle_among_the_projects_modules():
    graph = import_graph()
    assert len(graph) > 50  # the reader found the modules
    assert circles(graph) == []


def test_the_engine_imports_no_front_end():
    modules = project_modules()
    known = set(modules)
    offenders = []
    for name, path in modules.items():
        if name.split(".")[0] != "engine":
            continue
        for imported in imports_of(path, name, known):
            if imported.split(".")[0] in FRONT_ENDS:
                offenders.append(f"{name} imports {imported}")
    assert offenders == []


def test_no_source_file_is_over_500_lines():
    files = [p for folder in (*PACKAGES, "tests", "bench") for p in (ROOT / folder).rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}
