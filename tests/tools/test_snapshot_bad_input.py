"""Bad input to ``layout --check`` and ``layout --diff``: exit code 2 and a message naming the field and values.

Snapshot files are a valid 0.16 snapshot (``layout --format json``) with one thing broken; the
``--diff`` cases are command lines that cannot be compared. Each case states the fragments the
message must hold: the field (or option) at fault and the values involved.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from parallel_state_ng.__main__ import main

BASE = ["layout", "--world-size", "8", "--tp", "2", "--pp", "2", "--release", "0.16"]


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """A mutation: set the dotted ``path`` of the snapshot (``kinds.tp.groups.0``) to ``value``."""

    def mutate(data: dict) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        elif value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return mutate


_DELETE = object()

# (case id, the snapshot's text from the valid one's, message fragments)
FILE_CASES: list[tuple[str, Callable[[str], str], list[str]]] = [
    ("truncated", lambda t: t[: len(t) // 2], ["--check", "not valid JSON (truncated?)", "line"]),
    ("not json", lambda t: "tp=2 pp=2\n", ["not valid JSON", "line 1 column 1"]),
    ("a list", lambda t: "[1, 2]", ["snapshot: must be a JSON object, got list"]),
]


def _json_case(mutation: Callable[[dict], None]) -> Callable[[str], str]:
    def edit(text: str) -> str:
        data = json.loads(text)
        mutation(data)
        return json.dumps(data)

    return edit


JSON_CASES: list[tuple[str, Callable[[dict], None], list[str]]] = [
    ("no schema", _set("schema", _DELETE), ["schema: missing", "'parallel_state_ng.layout/1'"]),
    (
        "schema version 2",
        _set("schema", "parallel_state_ng.layout/2"),
        ["schema: 'parallel_state_ng.layout/2' is not supported; supported: ['parallel_state_ng.layout/1']"],
    ),
    ("unknown release", _set("release", "0.11"), ["release: '0.11' is not a supported series", "'0.19'"]),
    ("missing config field", _set("config.order", _DELETE), ["config: missing field(s) ['order']"]),
    ("unknown config field", _set("config.dp", 2), ["config: unknown field(s) ['dp']", "world_size"]),
    (
        "config field type",
        _set("config.tensor_model_parallel_size", "2"),
        [
            "config.tensor_model_parallel_size: must be an integer from 1 to 262144 (the limit of ranks a snapshot holds), got '2'"
        ],
    ),
    (
        "world size too large",
        _set("config.world_size", 16),
        ["config.world_size: 16 is inconsistent with the groups", "covers 8 ranks", "[8, 9, 10"],
    ),
    (
        "world size too small",
        _set("config.world_size", 4),
        ["kinds.dp_cp.groups[2]: rank 4 is out of range for config.world_size 4 (ranks 0..3)"],
    ),
    (
        "rank out of range",
        _set("kinds.tp.groups.3", [6, 9]),
        ["kinds.tp.groups[3]: rank 9 is out of range for config.world_size 8 (ranks 0..7)"],
    ),
    ("negative rank", _set("kinds.pp.groups.0", [-1, 4]), ["kinds.pp.groups[0]: rank -1 is out of range"]),
    ("duplicate rank", _set("kinds.tp.groups.0", [0, 0]), ["kinds.tp.groups[0]: rank 0 appears twice in [0, 0]"]),
    (
        "rank in two groups",
        _set("kinds.tp.groups.1", [1, 3]),
        ["kinds.tp: rank 1 is in groups[0] [0, 1] and groups[1] [1, 3]"],
    ),
    ("unknown kind", _set("kinds.foo", {}), ["kinds.foo: unknown group kind 'foo'", "tp"]),
    (
        "timeout rule",
        _set("kinds.ep.timeout.rule", "forever"),
        ["kinds.ep.timeout: the timeout rule must be one of ['init', 'torch'], got 'forever'"],
    ),
    ("groups not lists", _set("kinds.tp.groups.0", "0,1"), ["kinds.tp.groups[0]: must be a non-empty list", "'0,1'"]),
    (
        "cannot exist: tp 3",
        _set("config.tensor_model_parallel_size", 3),
        ["config: megatron-core 0.16 cannot build this configuration", "world_size (8)", "(3)"],
    ),
    (
        "cannot exist: gtp on 0.16",
        _set("config.gtp_remat_size", 2),
        ["config: megatron-core 0.16 cannot build this configuration", "gtp_remat_size=2"],
    ),
]

# (case id, command line after "layout", message fragments)
DIFF_CASES: list[tuple[str, list[str], list[str]]] = [
    (
        "unknown --against release",
        [*BASE[1:], "--diff", "--against", "0.11"],
        ["argument --against: release '0.11' is not supported", "0.12, 0.13"],
    ),
    (
        "unknown --release",
        ["--world-size", "8", "--diff", "--release", "0.10", "--against", "0.19"],
        ["(--release)", "release 0.10 has no release facts", "0.19"],
    ),
    (
        "configuration that cannot exist",
        ["--world-size", "8", "--tp", "3", "--diff", "--release", "0.16", "--against", "0.19"],
        ["(--release)", "--world-size (8) is not divisible by --tp (3)"],
    ),
    (
        "cannot exist on the other side",
        ["--world-size", "16", "--gtp-remat-size", "2", "--diff", "--release", "0.19", "--against", "0.18"],
        ["(--against 0.18)", "megatron-core 0.18 has no --gtp-remat-size", "--gtp-remat-size=2"],
    ),
    (
        "--against-set: unknown key",
        [*BASE[1:], "--diff", "--against-set", "dp=4"],
        ["argument --against-set: expected KEY=VALUE with KEY one of world-size, tp", "'dp=4'"],
    ),
    (
        "--against-set: bad value",
        [*BASE[1:], "--diff", "--against-set", "tp=two"],
        ["argument --against-set: tp: must be an integer >= 1, got 'two'"],
    ),
    (
        "--against-set: cannot exist",
        [*BASE[1:], "--diff", "--against-set", "pp=3"],
        ["--against-set: invalid layout: --world-size (8) is not divisible by --tp (2) x --pp (3)"],
    ),
    ("one file", ["--diff", "a.json"], ["argument --diff: takes two snapshot files or none, got 1: ['a.json']"]),
    ("nothing to compare", [*BASE[1:], "--diff"], ["needs --against RELEASE or --against-set KEY=VALUE"]),
    ("no world size", ["--diff", "--against", "0.19"], ["give --world-size"]),
    ("files and sizes", ["--diff", "a.json", "b.json", "--tp", "2"], ["--tp cannot be combined with --diff A.json"]),
    ("--check and sizes", ["--check", "a.json", "--pp", "2", "--release", "0.16"], ["--pp, --release cannot be"]),
    ("--check and --rank", ["--check", "a.json", "--rank", "3"], ["--rank cannot be combined with --check / --diff"]),
    ("svg", [*BASE[1:], "--diff", "--against", "0.19", "--format", "svg"], ["argument --format", "not svg"]),
    ("--against alone", [*BASE[1:], "--against", "0.19"], ["--against / --against-set only go with --diff"]),
    ("missing file", ["--check", "no/such/snapshot.json"], ["argument --check: cannot read snapshot", "no/such"]),
]


@pytest.fixture(scope="module")
def valid_snapshot(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("snapshot") / "valid.json"
    assert main([*BASE, "--format", "json", "--output", str(path)]) == 0
    return path.read_text()


def _expect_error(capsys, argv: list[str], fragments: list[str]) -> None:
    code = main(["layout", *argv])
    captured = capsys.readouterr()
    assert code == 2, captured.out
    assert captured.out == ""
    message = captured.err.strip()
    assert message.startswith("parallel-state-ng layout: error: ") and "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize("edit,fragments", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_bad_snapshot_text(capsys, tmp_path: Path, valid_snapshot: str, edit, fragments) -> None:
    path = tmp_path / "bad.json"
    path.write_text(edit(valid_snapshot))
    _expect_error(capsys, ["--check", str(path)], [f"snapshot {path}", *fragments])


@pytest.mark.parametrize("mutation,fragments", [c[1:] for c in JSON_CASES], ids=[c[0] for c in JSON_CASES])
def test_bad_snapshot_fields(capsys, tmp_path: Path, valid_snapshot: str, mutation, fragments) -> None:
    path = tmp_path / "bad.json"
    path.write_text(_json_case(mutation)(valid_snapshot))
    _expect_error(capsys, ["--check", str(path)], ["argument --check:", f"snapshot {path}", *fragments])
    # --diff reads snapshots through the same check (a configuration that cannot exist is a
    # --check finding: --diff compares the files as they are)
    if not any("cannot build" in f for f in fragments):
        _expect_error(capsys, ["--diff", str(path), str(path)], ["argument --diff:", *fragments])


@pytest.mark.parametrize("argv,fragments", [c[1:] for c in DIFF_CASES], ids=[c[0] for c in DIFF_CASES])
def test_bad_diff_and_check_options(capsys, argv: list[str], fragments: list[str]) -> None:
    _expect_error(capsys, argv, fragments)
