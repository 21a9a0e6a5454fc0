"""docs/architecture.md cannot drift: its folder map and the tree agree, and so do the layers.

The map is the first ``text`` block of the page: one path per line, nested by two spaces,
then its description; a line indented to the description column continues the one above.
Every listed path exists, and every module with code under ``parallel_state_ng/``,
``compat/``, ``scripts/`` and ``tests/support/``, every docs page and every folder of
``tests/`` is listed. The CLI commands the map names are the parser's.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

from parallel_state_ng.__main__ import build_parser
from tests.docs.test_house import import_graph
from tests.support.paths import ROOT

PAGE = os.path.join(ROOT, "docs", "architecture.md")
#: Lines indented this far or further continue the description of the entry above.
DESCRIPTION_COLUMN = 28
#: Folders whose every module with code must be in the map.
MAPPED_PACKAGES = ("parallel_state_ng", "compat", "scripts", os.path.join("tests", "support"))
#: The engine's layers, lowest first: a layer imports only the layers before it (and itself).
LAYERS = ("releases", "layout", "groups", "builders")


def map_lines() -> list[str]:
    """The lines of the page's first ``text`` block."""
    text = open(PAGE, encoding="utf-8").read()
    found = re.search(r"^```text\n(.*?)^```", text, flags=re.S | re.M)
    assert found, "docs/architecture.md has no ```text block (the folder map)"
    return found.group(1).splitlines()


def mapped_paths() -> dict[str, str]:
    """Each path the map lists (relative, folders end in ``/``) -> the text of its line."""
    paths: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in map_lines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent >= DESCRIPTION_COLUMN:
            continue
        assert indent % 2 == 0, f"map line indented by {indent} (not a multiple of 2): {line!r}"
        name = line.split()[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        path = parent + name
        paths[path] = line
        if name.endswith("/"):
            stack.append((indent, path))
    return paths


def has_code(path: str) -> bool:
    """Whether a module holds more than a docstring."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    body = [node for node in tree.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    return bool(body)


def required_paths() -> set[str]:
    """What the map must list: modules with code, docs files, the folders of tests/."""
    required: set[str] = set()
    for package in MAPPED_PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, package)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for filename in filenames:
                path = os.path.relpath(os.path.join(dirpath, filename), ROOT)
                if filename.endswith(".py") and has_code(path):
                    required.add(path.replace(os.sep, "/"))
    for filename in os.listdir(os.path.join(ROOT, "docs")):
        required.add(f"docs/{filename}" + ("/" if os.path.isdir(os.path.join(ROOT, "docs", filename)) else ""))
    for name in os.listdir(os.path.join(ROOT, "tests")):
        if os.path.isdir(os.path.join(ROOT, "tests", name)) and name != "__pycache__":
            required.add(f"tests/{name}/")
    return required


def test_every_mapped_path_exists():
    stale = [path for path in mapped_paths() if not os.path.exists(os.path.join(ROOT, path))]
    assert stale == [], f"docs/architecture.md lists paths that do not exist: {stale}"


def test_every_module_and_page_is_mapped():
    missing = sorted(required_paths() - set(mapped_paths()))
    assert missing == [], f"docs/architecture.md's map misses: {missing}"


def test_the_map_names_the_cli_commands():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    line = mapped_paths()["parallel_state_ng/__main__.py"]
    named = re.search(r"\{([a-z_,]+)\}", line)
    assert named, f"the map's __main__.py line names no {{command,...}} set: {line!r}"
    assert sorted(named.group(1).split(",")) == sorted(commands)


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_the_layers_below_it(layer):
    allowed = LAYERS[: LAYERS.index(layer) + 1]
    wrong = []
    for module, imported in import_graph().items():
        parts = module.split(".")
        if parts[:2] != ["parallel_state_ng", layer]:
            continue
        for target in imported:
            target_parts = target.split(".")
            if target_parts[0] == "parallel_state_ng" and len(target_parts) > 1 and target_parts[1] in allowed:
                continue
            wrong.append(f"{module} -> {target}")
    assert wrong == [], f"{layer}/ may import only {allowed}: {wrong}"


@pytest.mark.parametrize("layer", ["releases", "layout"])
def test_the_pure_layers_never_import_torch_distributed(layer):
    folder = os.path.join(ROOT, "parallel_state_ng", layer)
    offenders = []
    for filename in sorted(os.listdir(folder)):
        if not filename.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(folder, filename), encoding="utf-8").read())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
            if any(name.startswith("torch.distributed") or name == "torch.distributed" for name in names):
                offenders.append(filename)
    assert offenders == [], f"{layer}/ is pure math and data, yet these import torch.distributed: {offenders}"
