"""Fuzz the file formats: layout snapshots (``load_snapshot``, ``diff_snapshots``, ``layout --check``,
``layout --diff A B``) and topology specs (``parse_spec``, ``topology SPEC``).

Valid, mutated and hostile files (tests/fuzz/strategies.py). Contract: the API raises its
documented error (``SnapshotError``, ``UsageError``) with one line naming the source; the CLI
exits 0, 1 (``--check`` / ``--diff``: the layouts differ) or 2 with one line, never a traceback.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallel_state_ng.layout.layout_diff import diff_snapshots
from parallel_state_ng.layout.snapshot import SnapshotError, load_snapshot
from parallel_state_ng.tools.common import UsageError
from parallel_state_ng.tools.topology.report import parse_spec, place_modules
from tests.fuzz.cli import run_cli
from tests.fuzz.strategies import VALID_SNAPSHOTS, fuzz_settings, mutated_documents, snapshot_texts, spec_texts

pytestmark = pytest.mark.slow  # a time-boxed fuzz run: docs/testing.md


def _one_line(err: Exception, source: str) -> None:
    text = str(err)
    assert "\n" not in text and text.startswith(source) and len(text) < 2000, text[:2000]


@fuzz_settings(150)
@given(snapshot_texts())
def test_load_snapshot(text: str) -> None:
    try:
        snapshot = load_snapshot(text, "fuzz.json")
    except SnapshotError as err:
        _one_line(err, "fuzz.json")
    else:
        assert set(snapshot) == {"schema", "release", "config", "kinds"}


@fuzz_settings(40)
@given(
    st.one_of(st.sampled_from(VALID_SNAPSHOTS), mutated_documents(VALID_SNAPSHOTS)), st.sampled_from(VALID_SNAPSHOTS)
)
def test_diff_snapshots(old: dict, new: dict) -> None:
    try:
        old = load_snapshot(json.dumps(old), "old")
    except SnapshotError:
        return  # diff_snapshots takes loaded snapshots
    diff_snapshots(old, new, "old", "new")  # any new document: a diff or a SnapshotError, nothing else
    assert diff_snapshots(old, old, "old", "old").same  # a snapshot is the same as itself


@fuzz_settings(40)
@given(snapshot_texts())
def test_layout_check(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "snap.json")
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        code, out, err = run_cli(["layout", "--check", str(path)], (0, 1, 2))
    if text in (json.dumps(s) for s in VALID_SNAPSHOTS):
        assert code == 0, err


@fuzz_settings(25)
@given(snapshot_texts(), st.sampled_from(VALID_SNAPSHOTS))
def test_layout_diff_files(text: str, other: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp, "a.json"), Path(tmp, "b.json")
        a.write_text(text, encoding="utf-8", errors="surrogatepass")
        b.write_text(json.dumps(other), encoding="utf-8")
        run_cli(["layout", "--diff", str(a), str(b)], (0, 1, 2))


@fuzz_settings(150)
@given(spec_texts())
def test_parse_and_place_spec(text: str) -> None:
    try:
        modules = parse_spec(text, "spec.json")
        place_modules(modules, None, "0.19")
    except UsageError as err:
        assert "\n" not in str(err) and len(str(err)) < 2000, str(err)[:2000]


@fuzz_settings(40)
@given(spec_texts(), st.sampled_from(["text", "json", "svg"]), st.one_of(st.none(), st.integers(0, 40)))
def test_topology_cli(text: str, fmt: str, rank: int | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "spec.json")
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        argv = ["topology", str(path), "--release", "0.19", "--format", fmt]
        run_cli(argv + ([] if rank is None else ["--rank", str(rank)]), (0, 2))
