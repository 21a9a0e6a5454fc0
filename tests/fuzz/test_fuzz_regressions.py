"""Regression tests: each hostile input of issue 37 and each defect the fuzz harness found.

Exit code 2 and one line naming the file or option, the field and the limit; or, past the
enumeration limit with ``--rank``, that rank's view.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest

from parallel_state_ng.groups.liveness import failure_timeout
from parallel_state_ng.layout.bounded_input import MAX_ENUMERATED_RANKS, json_depth_error
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.topology_spec import ModuleSpec, TopologySpecError, validate_topology
from parallel_state_ng.releases import select_release
from tests.fuzz.cli import run_cli
from tests.fuzz.strategies import VALID_SNAPSHOTS, deep


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "input.json"
    path.write_text(text)
    return str(path)


def test_deep_snapshot_is_exit_2(tmp_path: Path) -> None:
    _, _, err = run_cli(["layout", "--check", _write(tmp_path, deep(200_000))], (2,))
    assert "nesting: nests 200000 levels deep, over the limit of 32" in err


def test_deep_spec_is_exit_2(tmp_path: Path) -> None:
    _, _, err = run_cli(["topology", _write(tmp_path, deep(200_000))], (2,))
    assert "nesting" in err and "limit of 32" in err


def test_snapshot_world_size_past_the_limit(tmp_path: Path) -> None:
    snapshot = json.loads(json.dumps(VALID_SNAPSHOTS[0]))
    snapshot["config"]["world_size"] = 10**12
    _, _, err = run_cli(["layout", "--check", _write(tmp_path, json.dumps(snapshot))], (2,))
    assert "config.world_size: must be an integer from 1 to 262144" in err


def test_layout_world_past_the_limit() -> None:
    _, _, err = run_cli(["layout", "--world-size", str(10**12), "--tp", "8"], (2,))
    assert "argument --world-size: 1000000000000 ranks is over the limit of 262144" in err and "--rank" in err
    _, out, _ = run_cli(
        ["layout", "--world-size", str(10**12), "--tp", "8", "--rank", "12345", "--format", "json"], (0,)
    )
    view = json.loads(out)
    assert view["rank"]["groups"]["tp"]["ranks"] == list(range(12344, 12352))
    assert view["omitted_kinds"]["dp"] == 10**12 // 8


def test_layout_explicit_kind_past_the_limit() -> None:
    _, _, err = run_cli(["layout", "--world-size", str(10**12), "--rank", "0", "--kinds", "dp"], (2,))
    assert "argument --kinds" in err and str(MAX_ENUMERATED_RANKS) in err


def test_topology_span_past_the_limit(tmp_path: Path) -> None:
    spec = _write(tmp_path, json.dumps([{"name": "language", "ranks": [0, 10**12], "language": True}]))
    _, _, err = run_cli(["topology", spec], (2,))
    assert "argument SPEC: 1000000000000 ranks is over the limit" in err
    _, out, _ = run_cli(["topology", spec, "--rank", "77", "--format", "json"], (0,))
    assert json.loads(out)["rank"]["views"]["language"]["groups"]["tp"]["ranks"] == [77]


def test_diff_against_world_size_past_the_limit() -> None:
    argv = ["layout", "--world-size", "8", "--release", "0.16", "--diff", "--against-set", f"world-size={10**12}"]
    _, _, err = run_cli(argv, (2,))
    assert "argument --against-set: 1000000000000 ranks is over the limit" in err


def test_huge_number_argument_is_not_echoed_whole() -> None:
    _, _, err = run_cli(["layout", "--world-size", "9" * 5000], (2,))
    assert len(err.splitlines()[-1]) < 200 and "..." in err


def test_zero_size_is_named() -> None:
    with pytest.raises(ZeroDivisionError, match="expert_model_parallel_size must be >= 1, got 0"):
        MegatronLayout(world_size=1, expert_model_parallel_size=0, release="0.16")


def test_rank_past_2_62_is_refused() -> None:
    with pytest.raises(ValueError, match=r"world_size 18446744073709551616 is over the limit"):
        MegatronLayout(world_size=2**64, release="0.16")
    with pytest.raises(TopologySpecError, match="over the limit"):
        validate_topology([ModuleSpec("language", (0, 2**64), language=True)], 8, "0.19")


def test_repeated_module_names_still_found() -> None:
    modules = [ModuleSpec(f"m{i % 3}", (2 * i, 2 * i + 2), language=i == 0) for i in range(6)]
    with pytest.raises(TopologySpecError, match=r"repeated: \['m0', 'm1', 'm2'\]"):
        validate_topology(modules, 12, "0.19")


@pytest.mark.parametrize("value", ["nan", "inf", "1e999"])
def test_seconds_must_be_finite(value: str) -> None:
    with mock.patch.dict(os.environ, {"PSNG_FAILURE_TIMEOUT": value}):
        with pytest.raises(ValueError, match="PSNG_FAILURE_TIMEOUT must be a finite number"):
            failure_timeout()


def test_release_variable_is_named() -> None:
    with mock.patch.dict(os.environ, {"PSNG_MEGATRON_VERSION": " "}):
        with pytest.raises(ValueError, match="environment variable PSNG_MEGATRON_VERSION"):
            select_release()


def test_depth_scan_ignores_brackets_in_strings() -> None:
    assert json_depth_error('["' + "[" * 100 + '"]') is None
    assert json_depth_error('["\\\\"' + "[" * 40 + "]" * 40 + "]") is not None
