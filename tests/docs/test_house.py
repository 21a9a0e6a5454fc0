"""The tree's structure: no import circle anywhere, no Python file over 500 lines.

Every import counts, at module level, inside functions and under ``TYPE_CHECKING``: a circle
that only a lazy import hides is still a circle to a reader. Run this file alone to see the
figures: ``python -m pytest -q -s tests/docs/test_house.py``.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

from tests.support.paths import ROOT

#: The folders whose Python files are scanned (the whole tree but tool caches and environments).
FOLDERS = ("parallel_state_ng", "compat", "scripts", "tests")
MAX_LINES = 500


def python_files() -> Iterator[str]:
    """Every ``.py`` file of the scanned folders and the top level, relative to the repository root."""
    for name in sorted(os.listdir(ROOT)):
        if name.endswith(".py"):
            yield name
    for folder in FOLDERS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            for filename in sorted(filenames):
                if filename.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, filename), ROOT)


def module_name(path: str) -> str:
    """``a/b/c.py`` -> ``a.b.c``; ``a/b/__init__.py`` -> ``a.b``."""
    parts = path[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: str, modules: set[str]) -> set[str]:
    """The modules of the tree that ``path`` imports (any import statement anywhere in the file)."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read(), filename=path)
    this = module_name(path)
    package = this if path.endswith("__init__.py") else this.rpartition(".")[0]
    found: set[str] = set()

    def add(name: str) -> None:
        # the longest prefix that is a module of the tree
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != this:
            found.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                add(candidate if candidate in modules else source)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the tree's modules it imports, for every Python file of the tree."""
    paths = list(python_files())
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules) for p in paths}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return circles


def test_no_import_circle_in_the_tree():
    graph = import_graph()
    circles = import_circles(graph)
    edges = sum(len(v) for v in graph.values())
    print(f"\nimport scan: {len(graph)} modules, {edges} imports between them, {len(circles)} circles")
    assert circles == [], "import circles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_the_scan_finds_a_circle_and_a_relative_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]
    found = imports_of(os.path.join("compat", "_init.py"), {m for m in import_graph()})
    assert "compat._scoping" in found and "parallel_state_ng.groups.pipeline" in found


def test_no_python_file_over_500_lines():
    sizes = {path: sum(1 for _ in open(os.path.join(ROOT, path), encoding="utf-8")) for path in python_files()}
    print(f"\nlargest Python files: {sorted(sizes.items(), key=lambda item: -item[1])[:3]}")
    too_long = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert too_long == {}, f"files over {MAX_LINES} lines: {too_long}"
