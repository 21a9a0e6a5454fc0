"""The GPU check's N-rank plan and report, without starting a world: which worlds the options
select, their worst-case time, the training layouts, and the rows made from ranks' results.

The worlds themselves run on gloo in tests/integration/test_gpu_check.py (docs/gpus.md).
"""

from __future__ import annotations

import pytest

from scripts.gpu import check
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
        (8, "bound", "death (nonblocking)", 100),
        (8, "bound", "death (blocking)", 100),
        (16, "lazy", "groups", 100),
        (16, "lazy", "training", 200),
        (16, "bound", "groups", 100),
        (16, "bound", "training", 200),
    ]
    assert worst_case_s(plan, "nccl") == 6 * 100 + 4 * 200 + 10 * WORLD_SLACK_S
    # gloo has no NCCL setting to vary: one death world
    assert [w for w in plan.worlds("gloo") if w[2].startswith("death")] == [(8, "bound", "death (blocking)", 100)]
    assert WorldPlan((8,), ("bound",), ("builders",)).worlds("nccl") == [(8, "bound", "groups", 110.0)]


def test_default_limits_are_twice_the_measured_8_rank_worlds_per_size():
    # 2 x 51.6 s (groups) and 2 x 58.2 s (training) at 8 ranks on the H200, times size / 8, up to 10 s
    assert MEASURED_8_RANKS_S == {"groups": 51.6, "training": 58.2} and LIMIT_MARGIN == 2.0
    plan = WorldPlan((4, 8, 16), ("bound",), ("groups", "training", "death"))
    assert plan.worlds("nccl") == [
        (4, "bound", "groups", 110.0),
        (4, "bound", "training", 120.0),
        (4, "bound", "death (nonblocking)", 110.0),
        (4, "bound", "death (blocking)", 110.0),
        (8, "bound", "groups", 110.0),
        (8, "bound", "training", 120.0),
        (16, "bound", "groups", 210.0),
        (16, "bound", "training", 240.0),
    ]
    for size, *_, limit in plan.worlds("nccl"):
        what = "training" if limit in (120.0, 240.0) else "groups"
        assert limit >= LIMIT_MARGIN * MEASURED_8_RANKS_S[what] * max(size, 8) / 8
    # the dry run (gloo on CPUs) has 8-rank limits of its own, scaled alike; a given limit wins everywhere
    assert [(w[0], w[2], w[3]) for w in plan.worlds("gloo")] == [
        (4, "groups", 150.0),
        (4, "training", 300.0),
        (4, "death (blocking)", 150.0),
        (8, "groups", 150.0),
        (8, "training", 300.0),
        (16, "groups", 300.0),
        (16, "training", 600.0),
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
