"""The prepared GPU call's parts (docs/results/gpus.md, "The prepared call"): recovery in place, the scale
ladder and the sharing policies, without a GPU.

The pure parts (the plan and its worst case, the ladder's stop rule and projection, NCCL's
``Init timings`` lines, the rows made from ranks' results) run in every CI run; the whole call's
dry run on 4 gloo ranks (and the ladder at 4 and 8) rotates. What only the GPU proves: NCCL's
``shrink_group`` and splits from a shrunk group, device memory, NCCL's timings, CUDA training.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from scripts.gpu import check
from scripts.gpu.world_ladder import does_not_fit, projection, projection_lines
from scripts.gpu.world_recovery import recovery_config, recovery_rows, victim_of
from scripts.gpu.world_report import WORLD_SLACK_S
from scripts.gpu.world_sharing import cases
from scripts.gpu.world_usable import parse_init_timings, summary, usable_sizes
from tests.integration.test_gpu_check import _world_dry_run

#: Three lines of the H200 run's NCCL log (../shared/gpu-runs/2026-11-28-h200/nccl_info_split_share.txt).
NCCL_LINES = """\
[0] NCCL INFO Comm config Split share set to 1
[0] NCCL INFO Init timings - ncclCommInitRankConfig: rank 0 nranks 8 total 0.83 (kernels 0.59, alloc 0.00, bootstrap 0.22, allgathers 0.00, topo 0.01, graphs 0.00, connections 0.01, rest 0.00)
[0] NCCL INFO Init timings - ncclCommSplit: rank 0 nranks 1 total 0.11 (kernels 0.00, alloc 0.00, bootstrap 0.00, allgathers 0.00, topo 0.01, graphs 0.00, connections 0.10, rest 0.00)
[0] NCCL INFO Init timings - ncclCommSplit: rank 0 nranks 2 total 0.02 (kernels 0.00, alloc 0.00, bootstrap 0.00, allgathers 0.00, topo 0.00, graphs 0.00, connections 0.01, rest 0.01)
"""
PREPARED = [
    "--world-only",
    "--no-tests",
    "--world",
    "8",
    "--world-modes",
    "bound",
    "--world-checks",
    "recovery,death-nonblocking,ladder,sharing",
    "--world-timeout",
    "75",
    "--budget",
    "480",
]


def test_the_prepared_call_fits_its_budget_in_priority_order():
    args = check.parse_args(PREPARED)
    assert check.world_plan(args).worlds("nccl") == [
        (8, "bound", "recovery", 90.0),
        (8, "bound", "death-nonblocking (nonblocking)", 75.0),
        (64, "bound", "ladder", 150.0),
        (8, "bound", "sharing", 90.0),
    ]
    # exactly the budget, in priority order a, b, c, d (docs/results/gpus.md, "The prepared call")
    assert check.worst_case(args) == check.START_S + 90 + 75 + 150 + 90 + 4 * WORLD_SLACK_S == 480
    assert check.budget_text(args) == (
        "start 15 s, 8 bound recovery 105 s, 8 bound death-nonblocking (nonblocking) 90 s, "
        "64 bound ladder 165 s, 8 bound sharing 105 s"
    )
    # the order given is the order run; the default checks stay the per-size ones and the deaths
    args = check.parse_args([*PREPARED[:7], "sharing,recovery"])
    assert [w[2] for w in check.world_plan(args).worlds("nccl")] == ["sharing", "recovery"]
    assert check.parse_args(["--world", "8"]).world_checks == (
        "groups",
        "builders",
        "training",
        "death",
        "death-nonblocking",
    )
    assert (args.sharing_values, args.sharing_training, args.ladder_sizes) == (
        ("0", "safe", "1"),
        "safe",
        (8, 16, 32, 48, 64),
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--world", "8", "--world-checks", "ladder", "--ladder-sizes", "8,12"], "multiples of 8"),
        (["--world", "6", "--world-checks", "recovery"], "first --world size of 4 or 8k"),
        (["--cpu-dry-run", "--world-checks", "ladder"], "give --world"),
        (["--world", "8", "--world-checks", "sharing", "--sharing-values", ","], "--sharing-values is empty"),
        ([*PREPARED[:-1], "300"], "over --budget 300 s: start 15 s, 8 bound recovery 105 s"),
    ],
)
def test_bad_options_of_the_parts_are_refused(capsys, options, message):
    with pytest.raises(SystemExit):
        check.parse_args(options)
    assert message in capsys.readouterr().err


def test_layouts_of_the_parts():
    assert usable_sizes(8)["tensor_model_parallel_size"] == 2 and usable_sizes(4)["tensor_model_parallel_size"] == 1
    with pytest.raises(ValueError, match="multiple of 8 ranks .* got 12"):
        usable_sizes(12)
    cfg = recovery_config(8)
    assert (cfg.tp, cfg.pp, cfg.dp, victim_of(8)) == (2, 2, 2, 5)
    assert (recovery_config(4).tp, recovery_config(4).dp, victim_of(4)) == (1, 2, 3)
    with pytest.raises(ValueError, match="multiple of 4 ranks"):
        recovery_config(6)
    assert cases(("unset", "1")) == [
        ("MCore", "mcore", {"PSNG_SHARE_GROUPS": None}),
        ("compat PSNG_SHARE_GROUPS=unset", "compat", {"PSNG_SHARE_GROUPS": None}),
        ("compat PSNG_SHARE_GROUPS=1", "compat", {"PSNG_SHARE_GROUPS": "1"}),
    ]


def test_nccl_init_timings_are_parsed():
    assert parse_init_timings(NCCL_LINES) == [
        {"call": "ncclCommInitRankConfig", "nranks": 8, "total_s": 0.83},
        {"call": "ncclCommSplit", "nranks": 1, "total_s": 0.11},
        {"call": "ncclCommSplit", "nranks": 2, "total_s": 0.02},
    ]
    assert parse_init_timings("[0] NCCL INFO Comm config Split share set to 1\n") == []


def test_the_ladder_stops_before_a_size_that_would_not_fit():
    assert does_not_fit(8, [], 150.0, None) is None
    assert does_not_fit(8, [], 0.0, None) == "no time left"
    # time: 40 s at 16 ranks predicts 40 * 2**1.5 = 113 s at 32
    assert does_not_fit(32, [(16, 40.0, None)], 120.0, None) is None
    assert does_not_fit(32, [(16, 40.0, None)], 100.0, None) == "predicted 113 s (from 40 s at 16 ranks), 100 s left"
    # two sizes: the growth measured between them (30 s to 45 s: power 0.58, taken as 1), within 1 and 2
    assert does_not_fit(32, [(8, 30.0, None), (16, 45.0, None)], 91.0, None) is None
    assert (
        does_not_fit(32, [(8, 30.0, None), (16, 45.0, None)], 89.0, None)
        == "predicted 90 s (from 45 s at 16 ranks), 89 s left"
    )
    assert does_not_fit(32, [(8, 10.0, None), (16, 45.0, None)], 179.0, None).startswith("predicted 180 s")
    # memory: 26,000 MiB at 16 ranks, per-rank use grew 1.25x from 8 to 16: 65,000 MiB predicted at 32
    done = [(8, 10.0, 10_400), (16, 20.0, 26_000)]
    assert does_not_fit(32, done, 1000.0, 143_000) is None
    why = does_not_fit(32, done, 1000.0, 60_000)
    assert why == "predicted 65000 MiB of device memory (from 26000 MiB at 16 ranks), over 92% of 60000 MiB"


def _summary(calls: int, init_s: float, nccl_split_s: float | None = None) -> dict:
    return {"calls": calls, "init_s": init_s, "nccl_split_s": nccl_split_s}


def test_the_projection_is_calls_times_cost_per_call():
    # MCore: 95 calls at 8 ranks, 153 at 16 (the H200 run); cost per call 0.01 + 0.001 * W
    by_size = {
        8: {"MCore": _summary(95, 95 * 0.018, 0.02), "compat": _summary(20, 20 * 0.018, 0.02)},
        16: {"MCore": _summary(153, 153 * 0.026, 0.03), "compat": _summary(20, 20 * 0.026, 0.03)},
    }
    model = projection(by_size)
    mcore, ours = model["MCore"][1024], model["compat"][1024]
    assert mcore["calls"] == pytest.approx(37 + 7.25 * 1024)
    assert mcore["per_call_s"] == pytest.approx(0.01 + 0.001 * 1024)
    assert mcore["create_s"] == pytest.approx(mcore["calls"] * mcore["per_call_s"])
    assert ours["calls"] == 20 and ours["create_s"] == pytest.approx(20 * 1.034)
    assert model["compat"][65536]["nccl_split_s"] == pytest.approx(0.01 + 0.00125 * 65536)
    # a cost that falls with the world (noise) is projected flat at its mean, never below zero
    by_size[16]["compat"] = _summary(20, 20 * 0.010, 0.01)
    assert projection(by_size)["compat"][65536]["per_call_s"] == pytest.approx(0.014)
    lines = projection_lines(model)
    assert "  MCore at 1,024 ranks: 7,461 calls x 1.0340 s = 7,714.7 s, NCCL per split 1.290 s" in lines


def _case(rank: int, **over) -> dict:
    case = {
        "init_s": 1.0 + rank,
        "usable_s": 2.0 + rank,
        "new_group": 3,
        "split_group": 17,
        "groups": 20,
        "touched": 14,
        "sums_ok": True,
        "leaked": 0,
        "creation_path": "split",
        "free_mib": (100_000, 96_000, 99_500) if rank == 0 else (None, None, None),
        "nccl": [{"call": "ncclCommSplit", "nranks": 2, "total_s": t} for t in (0.02, 0.03, 0.5)] if rank == 0 else [],
    }
    return {**case, **over}


def test_a_case_is_summarized_over_the_ranks():
    results = [{"rank": r, "total_mib": 143_000 if r == 0 else None, "cases": {"compat": _case(r)}} for r in range(4)]
    s = summary(results, "compat")
    assert (s["init_s"], s["usable_s"], s["calls"], s["ok"], s["paths"]) == (4.0, 5.0, 20, True, ["split"])
    assert (s["held_mib"], s["kept_mib"], s["used_mib"]) == (4000, 500, 47_000)
    assert (s["nccl_splits"], s["nccl_split_s"], s["nccl_split_total_s"]) == (3, 0.03, 0.55)
    results[2]["cases"]["compat"]["sums_ok"] = False
    assert not summary(results, "compat")["ok"]


def _survivor(rank: int, new_rank: int | None, fresh: list[float] | None = None) -> dict:
    out = {"rank": rank, "dead": [5], "detect_s": 5.1, "new_rank": new_rank, "method": "shrink", "rejoin_s": 0.4}
    out["reason"] = "shrink_group: the default group shrinks in place"
    if new_rank is None:
        return {**out, "initialized": False}
    usable = {"init_s": 0.5, "touch_s": 0.2, "touched": 14, "sums_ok": True, "path": "split", "total_s": 1.2}
    losses = [4.9, 4.8] if rank in (6, 7) else []
    return {
        **out,
        "source": rank,
        "layout": "tp2 pp2 dp1",
        "shrink": usable,
        "reinit": {**usable, "total_s": 3.0},
        "losses_before": [5.0, 4.95],
        "losses_shrink": losses,
        "losses_fresh": fresh if fresh is not None and losses else losses,
        "digest_shrink": "d",
        "digest_fresh": "d",
        "groups_left": 0,
    }


def test_recovery_rows_pass_only_when_training_after_the_shrink_equals_a_fresh_run():
    kept = {2: 0, 3: 1, 6: 2, 7: 3}
    results = [None if r == 5 else _survivor(r, kept.get(r)) for r in range(8)]
    rows = recovery_rows("8 ranks nccl bound", 5, "split", results)
    assert [ok for _, ok, _ in rows] == [True, True, True, True]
    assert "kept (old, new): [(2, 0), (3, 1), (6, 2), (7, 3)]; left out [0, 1, 4]" in rows[1][2]
    assert "shrink 1.20 s (rejoin 0.40 s" in rows[3][2] and "against re-init 3.00 s" in rows[3][2]
    results = [None if r == 5 else _survivor(r, kept.get(r), fresh=[4.9, 4.7]) for r in range(8)]
    rows = recovery_rows("t", 5, "split", results)
    assert not rows[2][1] and "fresh run [4.9, 4.7]" in rows[2][2]
    assert not recovery_rows("t", 5, "member", results)[1][1]  # the creation path after the shrink
    for r in results:
        if r is not None and r["new_rank"] is not None:
            r.update(method="reinit", reason="re-initializing over a new store prefix: cannot shrink")
    ok, detail = recovery_rows("t", 5, "split", results)[1][1:]
    assert not ok and "rejoined by ['reinit (re-initializing over a new store prefix: cannot shrink)']" in detail


needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)


@pytest.mark.slow
@pytest.mark.multiprocess
@needs_megatron
@pytest.mark.rotating(8, 10)  # end-to-end part 9 of 10 (docs/testing.md, "Rotating parts")
def test_dry_run_of_recovery_in_place(tmp_path):
    # 4 gloo ranks, tp1 pp2 dp2, bound (the split path through the gloo stand-in), rank 3 killed:
    # shrink through the gloo stand-in of shrink_group, the plan's layout split, training on
    options = ["--world-modes", "bound", "--world-checks", "recovery", "--recovery-timeout", "200", "--budget", "480"]
    text, checks = _world_dry_run(tmp_path, *options)  # 200 s: 4 processes training on 2 loaded cores
    assert len(checks) == 4 and all(line.startswith("PASS") for line in checks), checks
    assert "worst case 230 s: start 15 s, 4 bound recovery 215 s" in text
    assert "kept (old, new): [(0, 0), (2, 1)]; left out [1], holding no group: True" in text
    assert "creation path ['split'] (expected split)" in text
    assert re.search(r"after the shrink (\[[^]]+\]); fresh run \1; parameters equal on every kept rank: True", text)


@pytest.mark.slow
@pytest.mark.multiprocess
@needs_megatron
@pytest.mark.rotating(9, 10)  # end-to-end part 10 of 10 (docs/testing.md, "Rotating parts")
def test_dry_run_of_the_ladder_and_the_sharing_policies(tmp_path):
    # the ladder at 4 and 8 gloo ranks (two sizes: the projection), the sharing world at 4 with the
    # prepared call's values (0, safe and 1), training under safe
    options = ["--world-modes", "bound", "--world-checks", "ladder,sharing", "--ladder-sizes", "4,8"]
    options += ["--ladder-timeout", "300"]  # starting 8 processes on 2 loaded cores takes a while
    options += ["--sharing-values", "0,safe,1", "--sharing-training", "safe", "--budget", "480"]
    text, checks = _world_dry_run(tmp_path, *options)
    assert checks and all(line.startswith("PASS") for line in checks), checks
    assert "PASS  gloo bound ladder: every size ran: sizes run [4, 8]" in text
    # 19 per rank: 17 splits and 2 gloo groups (under safe, the split path's default, two gloo twins share one)
    assert "  MCore at 65,536 ranks: " in text and "  compat at 65,536 ranks: 19 calls x " in text
    for label in (
        "MCore",
        "compat PSNG_SHARE_GROUPS=0",
        "compat PSNG_SHARE_GROUPS=safe",
        "compat PSNG_SHARE_GROUPS=1",
    ):
        assert f"PASS  4 ranks gloo bound sharing {label}: every getter's group all-reduced" in text
    assert "PASS  4 ranks gloo bound PSNG_SHARE_GROUPS=safe training tp2 pp2 dp1: bit-identical to MCore" in text


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_phases_benchmark_runs_on_the_one_gpu_world_launcher():
    # scripts/bench/phases.py --launcher gpu: scripts/gpu/world.py's ranks (here its gloo dry run)
    import torch.distributed as dist

    from scripts.bench.phases import gpu_world

    assert gpu_world(2, dist.get_world_size, (), 120, backend="gloo") == [2, 2]
