"""The API reference (docs/api/, rendered by mkdocstrings): every module and member it names exists.

mkdocstrings fails the strict build on a module that does not resolve, but skips a name in an
explicit ``members`` list silently; ``compat.parallel_state``'s page lists its members by hand
(its served functions are made at import time), so this test imports what the pages name.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import compat
import compat.parallel_state
from tests.support.paths import ROOT

API = Path(ROOT, "docs", "api")
#: The public modules the reference must document.
PUBLIC = {"parallel_state_ng", "compat", "compat.parallel_state", "compat.run"}


def _directives() -> dict[str, list[str]]:
    """``::: module`` of each page -> the names of its ``members`` list (empty: all public members)."""
    found: dict[str, list[str]] = {}
    for page in sorted(API.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for module, body in re.findall(r"^::: (\S+)\n((?:    .*\n?)*)", text, flags=re.M):
            found[module] = re.findall(r"^        - (\w+)$", body, flags=re.M)
    return found


def test_the_reference_documents_every_public_module():
    assert set(_directives()) == PUBLIC


def test_every_named_member_exists():
    for module, members in _directives().items():
        imported = importlib.import_module(module)
        missing = [name for name in members if not hasattr(imported, name)]
        assert not missing, f"docs/api names {module}.{missing}, which do not exist"


def test_compat_parallel_state_lists_what_compat_adds():
    members = set(_directives()["compat.parallel_state"])
    added = {"get_state", "use_state", "detach_state", "destroy_state", "abort_model_parallel", "use_collection"}
    added |= set(importlib.import_module("compat._sleep").__all__)
    assert added <= members, sorted(added - members)
    assert {"MEGATRON_RELEASE", "MEGATRON_VERSION"} <= members
    assert callable(compat.parallel_state.initialize_model_parallel)  # served, made at import: not on the page
