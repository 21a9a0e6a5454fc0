"""The identity audit (parallel_state_ng/layout/identity_audit.py) against the release wheels.

Each recorded line of each recorded file, in every release whose unzipped wheel is in the cache,
contains the use's snippet; a release without its wheel is skipped by name (main's lines are
checked when ``PSNG_MEGATRON_LM`` names a Megatron-LM checkout at MAIN_COMMIT). The kinds are
GROUP_KINDS', the ids unique, and docs/compat.md shows the table the data renders.
"""

from __future__ import annotations

import functools
import os
import re

import pytest

from parallel_state_ng.layout.identity_audit import (
    CHANGES,
    HARMLESS,
    IDENTITY_USES,
    MAIN_COMMIT,
    RELEASES,
    IdentityUse,
    render_table,
    uses_tying,
)
from parallel_state_ng.layout.kinds import GROUP_KINDS
from tests.support.paths import ROOT
from tests.support.releases.fetch import RELEASES as CACHED_RELEASES
from tests.support.releases.fetch import cache_root

START = "<!-- identity-audit: begin (rendered from parallel_state_ng/layout/identity_audit.py) -->"
END = "<!-- identity-audit: end -->"


@functools.cache
def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return handle.read().splitlines()


@pytest.mark.parametrize("release", RELEASES)
def test_recorded_lines_hold_the_snippets(release: str) -> None:
    core = os.path.join(cache_root(), release, "megatron", "core")
    if not os.path.isdir(core):
        pytest.skip(f"megatron-core {release}: no unzipped wheel at {core}")
    wrong = []
    for use in IDENTITY_USES:
        line = use.line(release)
        path = os.path.join(core, use.path)
        if line is None:
            continue
        if not os.path.isfile(path):
            wrong.append(f"{use.id}: {use.path} missing")
            continue
        text = _lines(path)
        if line > len(text) or use.snippet not in text[line - 1]:
            wrong.append(f"{use.id}: {use.path}:{line} lacks {use.snippet!r}")
    assert not wrong, f"megatron-core {release}: " + "; ".join(wrong)


def test_main_lines_hold_the_snippets() -> None:
    checkout = os.environ.get("PSNG_MEGATRON_LM", "")
    core = os.path.join(checkout, "megatron", "core")
    if not checkout or not os.path.isdir(core):
        pytest.skip(f"Megatron-LM main: set PSNG_MEGATRON_LM to a checkout at {MAIN_COMMIT}")
    wrong = []
    for use in IDENTITY_USES:
        if use.main is None:
            continue
        path = os.path.join(core, use.path)
        text = _lines(path) if os.path.isfile(path) else []
        if use.main > len(text) or use.snippet not in text[use.main - 1]:
            wrong.append(f"{use.id}: {use.path}:{use.main} lacks {use.snippet!r}")
    assert not wrong, f"Megatron-LM main ({checkout}): " + "; ".join(wrong)


def test_audit_covers_the_cached_releases() -> None:
    assert RELEASES == tuple(CACHED_RELEASES.values())


def test_ids_unique_kinds_known_verdicts_stated() -> None:
    ids = [u.id for u in IDENTITY_USES]
    assert len(ids) == len(set(ids))
    for use in IDENTITY_USES:
        assert set(use.kinds) <= set(GROUP_KINDS), use.id
        assert use.verdict.startswith((CHANGES, HARMLESS)), use.id
        assert use.lines or use.main is not None, use.id
        have = [r for r, _ in use.lines]
        start = RELEASES.index(have[0]) if have else 0
        assert have == list(RELEASES[start : start + len(have)]), f"{use.id}: releases not contiguous"
        assert 0 < len(use.snippet) <= 60, use.id


def test_uses_tying() -> None:
    tied = uses_tying("mp", "tp_ep_pp")
    assert [u.id for u in tied] == ["chained_grad_stats_eq"]
    assert tied[0].changes_decision
    assert uses_tying("mp", "intra_dist_opt_instance") == tied
    assert uses_tying("tp_ep_pp", "mp") == tied
    assert uses_tying("cp", "hcp") == ()
    assert all(isinstance(u, IdentityUse) for u in uses_tying("dp_cp", "ep_dp"))
    assert "fsdp_dual_ubr_ne" in {u.id for u in uses_tying("dp_cp", "ep_dp")}


def test_docs_table_is_the_rendered_data() -> None:
    with open(os.path.join(ROOT, "docs", "compat.md"), encoding="utf-8") as handle:
        page = handle.read()
    found = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), page, flags=re.S)
    assert found, f"docs/compat.md lacks the identity-audit markers {START!r} ... {END!r}"
    assert "None" not in render_table()
    assert found.group(1).strip("\n") == render_table().strip("\n"), (
        "docs/compat.md's identity-audit table differs from render_table(): paste "
        "`python -c 'from parallel_state_ng.layout.identity_audit import render_table; "
        "print(render_table())'` between the markers"
    )
