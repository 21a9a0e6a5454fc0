"""The API reference (docs/api/, rendered by mkdocstrings): every module and member it names exists.

mkdocstrings fails the strict build on a path that does not resolve, but skips a name in an
explicit ``members`` list silently. ``compat.parallel_state`` makes its served functions at
import time and binds what compat adds by assignment, which the static reader sees as plain
attributes; its page therefore documents those functions where they are implemented
(``compat._scoping.get_state``), and this test checks that each is the very object
``compat.parallel_state`` serves under that name.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import compat.parallel_state
from tests.support.paths import ROOT
from tests.support.releases.compat_checks import COMPAT_EXTRAS

API = Path(ROOT, "docs", "api")
#: The public modules the reference must document.
PUBLIC = {"parallel_state_ng", "compat", "compat.parallel_state", "compat.run"}


def _directives() -> dict[str, list[str]]:
    """``::: path`` of each page -> the names of its ``members`` list (empty: all public members)."""
    found: dict[str, list[str]] = {}
    for page in sorted(API.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for path, body in re.findall(r"^::: (\S+)\n((?:    .*\n?)*)", text, flags=re.M):
            found[path] = re.findall(r"^        - (\w+)$", body, flags=re.M)
    return found


def _resolve(path: str) -> Any:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def test_the_reference_documents_every_public_module():
    assert PUBLIC <= set(_directives())


def test_every_named_path_and_member_exists():
    for path, members in _directives().items():
        obj = _resolve(path)
        missing = [name for name in members if not hasattr(obj, name)]
        assert not missing, f"docs/api names {path}.{missing}, which do not exist"


def test_compat_parallel_state_documents_what_compat_adds():
    documented = {path.rpartition(".")[2]: _resolve(path) for path in _directives() if path.startswith("compat._")}
    assert set(documented) == COMPAT_EXTRAS
    for name, obj in documented.items():
        assert getattr(compat.parallel_state, name) is obj, name
    assert {"MEGATRON_RELEASE", "MEGATRON_VERSION"} <= set(_directives()["compat.parallel_state"])
