"""scripts/matrix/megatron_unit_tests.py: its options, the outcome comparison, and one small run.

The end-to-end run uses a stand-in test file written here into ``tmp_path`` (a harness in the
shape Megatron's unit tests assume: one CUDA device per rank, NCCL), not Megatron's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scripts.matrix import megatron_unit_tests as mut

ROOT = Path(__file__).resolve().parents[2]


def _checkout(tmp_path: Path, body: str = "def test_one():\n    pass\n") -> Path:
    tests = tmp_path / "mlm" / "tests" / "unit_tests"
    tests.mkdir(parents=True)
    (tests.parent / "__init__.py").write_text("")
    (tests / "__init__.py").write_text("")
    (tests / "test_parallel_state.py").write_text(body)
    return tests


def _run(ranks: dict[int, dict[str, str]], setting: str = "compat") -> mut.SettingRun:
    run = mut.SettingRun(setting)
    for rank, results in ranks.items():
        run.ranks[rank] = {
            "rank": rank,
            "results": {t: {"outcome": o, "reason": f"why {o}"} for t, o in results.items()},
        }
    return run


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--tests-dir", "/nonexistent/psng/tests"], ["--tests-dir", "/nonexistent/psng/tests"]),
        (["--nproc", "0"], ["--nproc", "0"]),
        (["--settings", "mcore,sometimes"], ["--settings", "sometimes"]),
        (["--settings", ","], ["--settings"]),
        (["--test-file", "test_absent.py"], ["--test-file", "test_absent.py"]),
        (["--megatron-path", "/nonexistent/psng/wheel"], ["--megatron-path", "/nonexistent/psng/wheel"]),
        (["--timeout", "0"], ["--timeout"]),
    ],
)
def test_bad_input_exits_2_naming_the_option(tmp_path, capsys, argv, names):
    tests = _checkout(tmp_path)
    full = argv if argv[0] == "--tests-dir" else ["--tests-dir", str(tests), *argv]
    assert mut.main(full) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    for name in names:
        assert name in err


def test_a_directory_without_the_test_file_is_named(tmp_path, capsys):
    empty = tmp_path / "unit_tests"
    empty.mkdir()
    assert mut.main(["--tests-dir", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "test_parallel_state.py" in err and str(empty) in err


def test_good_options_are_resolved(tmp_path):
    tests = _checkout(tmp_path)
    args = mut.parse_args(["--tests-dir", str(tests), "--settings", "safe, mcore", "--nproc", "2"])
    assert args.settings == ["safe", "mcore"]
    assert args.test_file == (tests / "test_parallel_state.py").resolve()
    assert mut.find_root(tests) == (tmp_path / "mlm").resolve()
    assert mut.find_root(tmp_path) == tmp_path.resolve()


def test_combined_outcome_over_ranks():
    assert mut.combined({0: "passed", 1: "passed"}, 2) == "passed"
    assert mut.combined({0: "skipped", 1: "failed"}, 2) == "failed[1] skipped[0]"
    assert mut.combined({0: "passed"}, 2) == "missing[1] passed[0]"
    assert mut.combined({}, 2) == "missing"


def test_counts_put_rank_disagreements_under_mixed():
    run = _run({0: {"a": "passed", "b": "failed", "c": "skipped"}, 1: {"a": "passed", "b": "passed", "c": "skipped"}})
    tally = mut.counts(run, 2)
    assert (tally["passed"], tally["mixed"], tally["skipped"], tally["failed"]) == (1, 1, 1, 0)


def test_differences_and_verdict():
    same = {0: {"a": "passed", "b": "failed"}, 1: {"a": "passed", "b": "failed"}}
    runs = {
        "mcore": _run(same, "mcore"),
        "compat": _run(same),
        "safe": _run(same, "safe"),
        "1": _run({0: {"a": "passed", "b": "failed"}, 1: {"a": "error", "b": "failed"}}, "1"),
    }
    assert mut.differences({k: runs[k] for k in ("mcore", "compat", "safe")}, 2) == {}
    assert mut.differences(runs, 2) == {
        "a": {"mcore": "passed", "compat": "passed", "safe": "passed", "1": "error[1] passed[0]"}
    }
    text, agree = mut.report(runs, 2)
    assert agree, text  # "1" is for information: it does not count in the verdict
    assert "- a: " in text and "why error" in text
    runs["safe"] = _run({0: {"a": "passed"}, 1: {"a": "passed"}}, "safe")  # "b" not reported
    text, agree = mut.report(runs, 2)
    assert not agree
    assert "safe=missing" in text


def test_failure_messages_are_compared_without_object_addresses():
    same = {0: {"a": "failed"}, 1: {"a": "failed"}}
    runs = {"mcore": _run(same, "mcore"), "safe": _run(same, "safe")}
    runs["mcore"].ranks[1]["results"]["a"]["reason"] = "E  x = <Group at 0x7f1b0> in Coll(...eac70>)"
    runs["safe"].ranks[1]["results"]["a"]["reason"] = "E  x = <Group at 0x7fd59> in Coll(...c5370>)"
    assert mut.message_differences(runs) == {}
    text, agree = mut.report(runs, 2)
    assert agree and "failed with the same message under every setting" in text
    runs["safe"].ranks[1]["results"]["a"]["reason"] = "E  TypeError: another message"
    assert mut.message_differences(runs) == {
        "a": {"mcore": "E  x = <Group at 0x> in Coll(...>)", "safe": "E  TypeError: another message"}
    }
    text, agree = mut.report(runs, 2)
    assert agree, text  # for information: the outcomes agree
    assert "other failure messages (1):" in text and "safe: E  TypeError: another message" in text


def test_a_setting_that_did_not_report_fails_the_verdict():
    runs = {"mcore": _run({0: {"a": "passed"}}, "mcore"), "safe": mut.SettingRun("safe", note="0 of 1 ranks reported")}
    text, agree = mut.report(runs, 1)
    assert not agree and "0 of 1 ranks reported" in text


def test_groups_left_and_unmet_barriers_are_reported():
    run = _run({0: {"a": "passed", "b": "failed"}, 1: {"a": "passed", "b": "failed"}}, "mcore")
    run.ranks[0]["results"]["a"].update(left_groups=3)
    run.ranks[1]["results"]["a"].update(left_groups=5)
    run.ranks[1]["results"]["b"].update(left_groups=2, unsynced=True)
    assert run.left_groups() == 5 + 2  # per test the most any rank left, summed
    assert run.unsynced() == ["b"]
    text, _ = mut.report({"mcore": run}, 2)
    assert "| groups left |" in text.splitlines()[0]
    assert text.splitlines()[2].split(" | ")[-2] == "7"
    assert "mcore: the ranks did not meet after 1 tests: b" in text


_STAND_IN = textwrap.dedent(
    """
    import datetime
    import os

    import pytest
    import torch

    import megatron.core.parallel_state as ps


    def _join():
        if not torch.distributed.is_initialized():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
            torch.distributed.init_process_group(backend="nccl")


    def test_tp_groups():
        _join()
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
        assert ps.get_tensor_model_parallel_world_size() == 2
        assert torch.cuda.device_count() == torch.distributed.get_world_size()
        group = torch.distributed.new_group(backend="nccl")
        assert torch.distributed.get_backend(group) == "gloo"
        ps.destroy_model_parallel()


    def test_rank_one_fails():
        assert int(os.environ["RANK"]) != 1


    def test_skipped_under_build_sharing():
        if os.environ.get("PSNG_SHARE_GROUPS") == "1":
            pytest.skip("stand-in: skipped under 1")


    def test_rank_one_fails_before_a_collective():
        _join()
        torch.distributed.new_group(backend="nccl")  # left alive
        assert int(os.environ["RANK"]) != 1
        torch.distributed.barrier()  # rank 0 waits here until the groups' timeout


    def test_rank_one_fails_before_a_group():
        _join()
        assert int(os.environ["RANK"]) != 1
        # rank 0 waits for rank 1 here: Megatron's 30 minutes, capped at --collective-timeout
        torch.distributed.new_group([0, 1], timeout=datetime.timedelta(minutes=30), backend="nccl")


    def test_in_step_again_with_nothing_left():
        _join()
        torch.distributed.barrier()
        assert list(torch.distributed.distributed_c10d._world.pg_map) == [
            torch.distributed.distributed_c10d._get_default_group()
        ]
    """
)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.rotating(3, 10)
def test_a_stand_in_file_on_two_ranks(tmp_path):
    tests = _checkout(tmp_path, _STAND_IN)
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "scripts.matrix", "megatron_unit_tests", "--tests-dir", str(tests)]
    cmd += ["--nproc", "2", "--settings", "mcore,safe,1", "--json", str(out), "--timeout", "240"]
    cmd += ["--collective-timeout", "10"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    modules = {name: {r["parallel_state"] for r in run["ranks"].values()} for name, run in data.items()}
    assert modules == {
        "mcore": {"megatron.core.parallel_state"},
        "safe": {"compat.parallel_state"},
        "1": {"compat.parallel_state"},
    }
    outcomes = {
        name: {
            test.split("::")[-1]: {r["results"][test]["outcome"] for r in run["ranks"].values()}
            for test in run["ranks"]["0"]["results"]
        }
        for name, run in data.items()
    }
    for name in ("mcore", "safe"):
        assert outcomes[name] == {
            "test_tp_groups": {"passed"},
            "test_rank_one_fails": {"passed", "failed"},
            "test_skipped_under_build_sharing": {"passed"},
            "test_rank_one_fails_before_a_collective": {"failed"},  # rank 0: the barrier timed out
            "test_rank_one_fails_before_a_group": {"failed"},  # rank 0: the group's creation timed out
            "test_in_step_again_with_nothing_left": {"passed"},
        }
        left = {
            test.split("::")[-1]: max(r["results"][test]["left_groups"] for r in data[name]["ranks"].values())
            for test in data[name]["ranks"]["0"]["results"]
        }
        assert left["test_rank_one_fails_before_a_collective"] == 1
        assert left["test_in_step_again_with_nothing_left"] == 0
    assert outcomes["1"]["test_skipped_under_build_sharing"] == {"skipped"}
    assert "test_skipped_under_build_sharing" in proc.stdout  # differs under 1, listed
    assert "verdict: every test has one outcome under mcore, safe" in proc.stdout
