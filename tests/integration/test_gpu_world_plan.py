"""The GPU check's N-rank plan and report, without starting a world: which worlds the options
select, their worst-case time, the training layouts, and the rows made from ranks' results.

The worlds themselves run on gloo in tests/integration/test_gpu_check.py (docs/results/gpus.md).
"""

from __future__ import annotations

import pytest

from scripts.gpu import check, world_nonblocking
from scripts.gpu.world import WorldError
from scripts.gpu.world_report import (
    LIMIT_MARGIN,
    MEASURED_8_RANKS_S,
    WORLD_SLACK_S,
    WorldPlan,
    _failure_summary,
    default_limit_s,
    worst_case_s,
)
from scripts.gpu.world_training import training_layouts, training_rows


def test_the_plan_lists_each_world_with_its_limit():
    plan = WorldPlan((8, 16), ("lazy", "bound"), ("groups", "training", "death"), timeout=100, training_timeout=200)
    worlds = plan.worlds("nccl")
    assert worlds == [
        (8, "lazy", "groups", 100),
        (8, "lazy", "training", 200),
        (8, "bound", "groups", 100),
        (8, "bound", "training", 200),
        (16, "lazy", "groups", 100),
        (16, "lazy", "training", 200),
        (16, "bound", "groups", 100),
        (16, "bound", "training", 200),
        (8, "bound", "death (blocking)", 100),  # the worlds that run once come last, at the first size
    ]
    assert worst_case_s(plan, "nccl") == 5 * 100 + 4 * 200 + 9 * WORLD_SLACK_S
    # the nonblocking death is a check of its own, one world, on NCCL and on gloo (the stand-in waits as torch)
    both = WorldPlan((8, 16), ("bound",), ("death", "death-nonblocking"), timeout=100)
    for backend in ("nccl", "gloo"):
        assert both.worlds(backend) == [
            (8, "bound", "death (blocking)", 100),
            (8, "bound", "death-nonblocking (nonblocking)", 100),
        ]
    assert worst_case_s(both, "nccl") == 2 * (100 + WORLD_SLACK_S)
    assert WorldPlan((8,), ("bound",), ("builders",)).worlds("nccl") == [(8, "bound", "groups", 110.0)]


def test_default_limits_are_twice_the_measured_8_rank_worlds_per_size():
    # 2 x 51.6 s (groups) and 2 x 58.2 s (training) at 8 ranks on the H200, times size / 8, up to 10 s
    assert MEASURED_8_RANKS_S == {"groups": 51.6, "training": 58.2} and LIMIT_MARGIN == 2.0
    plan = WorldPlan((4, 8, 16), ("bound",), ("groups", "training", "death"))
    assert plan.worlds("nccl") == [
        (4, "bound", "groups", 110.0),
        (4, "bound", "training", 120.0),
        (8, "bound", "groups", 110.0),
        (8, "bound", "training", 120.0),
        (16, "bound", "groups", 210.0),
        (16, "bound", "training", 240.0),
        (4, "bound", "death (blocking)", 110.0),
    ]
    for size, *_, limit in plan.worlds("nccl"):
        what = "training" if limit in (120.0, 240.0) else "groups"
        assert limit >= LIMIT_MARGIN * MEASURED_8_RANKS_S[what] * max(size, 8) / 8
    # the dry run (gloo on CPUs) has 8-rank limits of its own, scaled alike; a given limit wins everywhere
    assert [(w[0], w[2], w[3]) for w in plan.worlds("gloo")] == [
        (4, "groups", 150.0),
        (4, "training", 300.0),
        (8, "groups", 150.0),
        (8, "training", 300.0),
        (16, "groups", 300.0),
        (16, "training", 600.0),
        (4, "death (blocking)", 150.0),
    ]
    given = WorldPlan((16,), ("lazy",), ("groups", "training"), timeout=180, training_timeout=200)
    assert given.worlds("nccl") == [(16, "lazy", "groups", 180), (16, "lazy", "training", 200)]
    assert default_limit_s(64, "groups", "nccl") == 830.0  # 2 x 51.6 x 8, rounded up to 10 s


def test_options_select_worlds_and_refuse_a_call_over_its_budget(capsys):
    args = check.parse_args(
        ["--world", "8", "--world-only", "--no-tests", "--world-modes", "bound", "--world-checks", "training"]
    )
    assert check.world_plan(args).worlds("nccl") == [(8, "bound", "training", 120.0)]
    assert check.worst_case(args) == check.START_S + 120 + WORLD_SLACK_S
    with pytest.raises(SystemExit):
        check.parse_args(
            ["--world", "8", "--world-only", "--no-tests", "--world-checks", "training", "--budget", "250"]
        )
    assert "may take 285 s, over --budget 250 s: start 15 s, 8 lazy training 135 s, 8 bound training 135 s" in (
        capsys.readouterr().err
    )
    dry_run = "--dry-run --world 4 --world-only --no-tests --world-modes lazy --world-checks training"
    dry = check.parse_args(dry_run.split())
    assert check.worst_case(dry) == check.START_S + 300 + WORLD_SLACK_S  # the dry run's own limit
    for bad in (["--world-checks", "speed"], ["--world-modes", "eager"], ["--training-layouts", "vpp"]):
        with pytest.raises(SystemExit):
            check.parse_args(["--world", "8", *bad])
    with pytest.raises(SystemExit):
        check.parse_args(["--world", "6", "--world-checks", "training"])
    assert "multiples of 4" in capsys.readouterr().err
    assert check.parse_args(["--dry-run", "--world", "4"]).cpu_dry_run  # --dry-run: the same option


def test_training_layouts_of_a_world():
    assert list(training_layouts(8)) == ["tp2 pp2 dp2", "tp1 pp2 dp4 ep2 experts4 alltoall"]
    assert list(training_layouts(16, ("moe",))) == ["tp1 pp2 dp8 ep2 experts4 alltoall"]
    assert list(training_layouts(4)) == ["tp2 pp2 dp1", "tp1 pp2 dp2 ep2 experts4 alltoall"]
    with pytest.raises(ValueError, match="multiple of 4"):
        training_layouts(6)


def _run(losses, digest="d" * 64, impl="compat.parallel_state", leaked=0):
    facts = {
        "version": "x",
        "megatron.core.parallel_state": impl,
        "schedules.parallel_state": impl,
        "initialized": "True",
    }
    return {
        "losses": losses,
        "grad_norms": [1.0, 0.5],
        "digest": digest,
        "params": 10,
        "facts": facts,
        "leaked_groups": leaked,
        "param_device": "cpu",
        "wall_s": 1.0,
    }


def _rank(rank, compat_digest="d" * 64, leaked=0):
    losses = [4.5, 4.25] if rank % 2 else None  # the last pipeline stage reports
    mcore = _run(losses, impl="megatron.core.parallel_state", leaked=20)
    return {
        "rank": rank,
        "device": "cpu",
        "layouts": {"tp2 pp2 dp1": {"mcore": mcore, "compat": _run(losses, compat_digest, leaked=leaked)}},
        "groups_left": 0,
    }


def test_training_rows_pass_only_when_every_rank_is_bit_identical():
    rows = training_rows("4 ranks gloo bound", [_rank(r) for r in range(4)])
    assert [(name, ok) for name, ok, _ in rows] == [
        ("4 ranks gloo bound training tp2 pp2 dp1: bit-identical to MCore", True),
        ("4 ranks gloo bound training tp2 pp2 dp1: megatron's code used compat", True),
        ("4 ranks gloo bound training tp2 pp2 dp1: no group left after compat's destroy", True),
        ("4 ranks gloo bound training: no group left at the end", True),
    ]
    results = [_rank(r, compat_digest="e" * 64 if r == 2 else "d" * 64, leaked=int(r == 3)) for r in range(4)]
    rows = {name: (ok, detail) for name, ok, detail in training_rows("t", results)}
    ok, detail = rows["t training tp2 pp2 dp1: bit-identical to MCore"]
    assert not ok and "differs (rank, field): [(2, 'digest')]" in detail
    ok, detail = rows["t training tp2 pp2 dp1: no group left after compat's destroy"]
    assert not ok and "compat left [0, 0, 0, 1]" in detail


def test_a_failed_world_is_summarized_rank_by_rank():
    stack = (
        "Thread 0x01 (most recent call first):\n"
        '  File "/x/threading.py", line 331 in wait\n'
        "\nCurrent thread 0x02 (most recent call first):\n"
        '  File "/x/distributed_c10d.py", line 5000 in split_group\n'
        '  File "/x/world.py", line 140 in _rank_main\n'
    )
    err = WorldError(
        "2 rank(s) of 3 failed: [0, 1]\n--- rank 0:\nRankFailureError: rank 2 died\nTraceback ...\n"
        f"--- rank(s) [1]: no result in 50 s\n--- rank 1: stack at the timeout (most recent call first)\n{stack}",
        [0, 1],
    )
    assert _failure_summary(err) == (
        "2 rank(s) of 3 failed: [0, 1]; rank 0: RankFailureError: rank 2 died; rank(s) [1]: no result in 50 s; "
        'rank 1 stopped in: File "/x/distributed_c10d.py", line 5000 in split_group'
    )


def _survivor(rank: int, **changes) -> dict:
    result = {
        "rank": rank,
        "refusal": "nonblocking NCCL init ...: TORCH_NCCL_NONBLOCKING_TIMEOUT is unset, so torch waits 1800 s. ...",
        "refused_in": 0.1,
        "initialized_after_refusal": False,
        "wait": "8",
        "raised": "RankFailureError",
        "names_victim": True,
        "message": "rank 0: ... rank(s) [3] never reached this group",
        "seconds": 11.5,
        "abort_seconds": 0.2,
        "new_world_seconds": 1.5,
        "new_world_sum": 3.0,
    }
    return {**result, **changes}


@pytest.mark.parametrize(
    ("change", "failed"),
    [
        ({}, []),
        ({"refusal": None, "initialized_after_refusal": True}, ["refused"]),
        ({"names_victim": False}, ["death"]),
        ({"seconds": 40.0}, ["death"]),
        ({"new_world_sum": None, "new_world_error": "DistBackendError: x"}, ["death"]),
    ],
)
def test_the_nonblocking_death_rows(change, failed):
    results = [_survivor(0), _survivor(1, **change), _survivor(2), None]
    rows = world_nonblocking.rows("4 ranks nccl bound", 4, 3, 3, 20.0, 15.0, results)
    assert [name.split(": ")[0] for name, _, _ in rows] == [
        "4 ranks nccl bound nonblocking NCCL init without a bounded wait",
        "4 ranks nccl bound death of rank 3 at split 3 (nonblocking NCCL init)",
    ]
    assert [("refused" if "without" in name else "death") for name, ok, _ in rows if not ok] == failed
    assert "TORCH_NCCL_NONBLOCKING_TIMEOUT=8" in rows[1][2] and "abort_seconds 0.2 s" in rows[1][2]
    assert world_nonblocking.world_env(20.0) == {
        "PSNG_FAILURE_TIMEOUT": "20",
        "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",
        "TORCH_NCCL_NONBLOCKING_TIMEOUT": "8",
    }


def test_the_split_share_measurement_summarizes_and_keeps_its_budget(tmp_path, capsys):
    from scripts.gpu import split_share

    def rank(free: list[int | None], rss: list[float], threads: list[int]) -> dict:
        keys = ("before", "in use", "after")
        points = {k: {"free_mib": f, "rss_mib": r, "threads": t} for k, f, r, t in zip(keys, free, rss, threads)}
        return {"points": points, "groups_used": 17, "seconds": 2.5}

    log = tmp_path / "nccl.1.log"
    log.write_text(
        "host:1:1 [0] NCCL INFO Comm config Split share set to 1\n"
        "host:1:1 [0] NCCL INFO init.cc:10 Cuda Alloc Size 2097152 pointer 0x1\n"
        "host:1:1 [0] NCCL INFO init.cc:11 Cuda Alloc Size 1048576 pointer 0x2\n"
    )
    results = [
        rank([1000, 400, 990], [100.0, 160.0, 120.0], [10, 14, 10]),
        rank([1000, 400, 990], [90.0, 100.0, 95.0], [9, 11, 9]),
    ]
    results[0]["nccl_log"] = split_share._log_summary(str(log))
    row = split_share.summarize("NCCL_COMM_SPLIT_SHARE_RESOURCES=1", results)
    assert row["device_held_mib"] == 600.0 and row["device_left_after_destroy_mib"] == 10.0
    assert row["host_rss_added_mib"] == 70.0 and row["threads_added"] == 6 and row["slowest_s"] == 2.5
    assert row["nccl_log_rank0"] == {
        "lines": 3,
        "split_share_lines": 1,
        "split_share_first": ["Comm config Split share set to 1"],
        "allocations": 2,
        "allocated_mib": 3.0,
    }
    assert split_share._log_summary(str(tmp_path / "missing.log")) == {"lines": 0}
    assert split_share.worst_case_s(split_share.parse_args([])) == 2 * (150 + split_share.SLACK_S)
    assert split_share.world_env({"NCCL_COMM_SPLIT_SHARE_RESOURCES": "1"}, "gloo", str(tmp_path)) == {
        "NCCL_COMM_SPLIT_SHARE_RESOURCES": "1"
    }
    with pytest.raises(SystemExit):
        split_share.parse_args(["--timeout", "300", "--budget", "480"])
    assert "may take 630 s, over --budget 480 s" in capsys.readouterr().err
