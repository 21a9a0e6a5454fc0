"""The prepared GPU measurement of sleep and wake (``scripts/gpu/world_sleep.py``, issue 51), without a GPU.

Every CI run: the call's plan and budget, and the rows made from ranks' results (the native
path measured or skipped with its reason, device memory or "not measured"). The dry run of the
whole call (4 gloo ranks, bound and lazy: the same code with CPU tensors) rotates (part 8).
What only the GPU proves: device memory freed or kept, NCCL's ``memory_stats``, the native
suspend, the times.
"""

from __future__ import annotations

import importlib.util

import pytest

from scripts.gpu import check, world_sleep
from tests.integration.test_gpu_check import _world_dry_run

#: The sleep measurement's line of the prepared call (docs/results/gpus.md, "The prepared call").
PREPARED = ["--world-only", "--no-tests", "--world", "8", "--world-modes", "bound,lazy", "--world-checks", "sleep"]


def test_the_sleep_call_runs_bound_then_lazy_within_its_budget():
    args = check.parse_args([*PREPARED, "--budget", "225"])
    assert check.world_plan(args).worlds("nccl") == [(8, "bound", "sleep", 90.0), (8, "lazy", "sleep", 90.0)]
    assert check.budget_text(args) == "start 15 s, 8 bound sleep 105 s, 8 lazy sleep 105 s"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--world", "6", "--world-checks", "sleep"], "needs a first --world size of 4 or 8k"),
        ([*PREPARED, "--budget", "200"], "over --budget 200 s: start 15 s, 8 bound sleep 105 s"),
    ],
)
def test_bad_options_of_the_sleep_call_are_refused(capsys, options, message):
    with pytest.raises(SystemExit):
        check.parse_args(options)
    assert message in capsys.readouterr().err


def _rank(rank: int, native: int = 0, device: bool = True) -> dict:
    run = {"losses": [4.9, 4.8] if rank == 3 else None, "grad_norms": [1.0, 0.9], "digest": f"d{rank}", "params": 7}
    mechanisms = {"native": native, "fenced": 2} if native else {"fenced": 14}
    return {
        "rank": rank,
        "touched": 14,
        "nccl": "2.29.7" if native else "2.28.9",
        "free_mib": {"awake": 90_000, "asleep": 96_000, "woken": 90_100} if device and rank == 0 else
                    {"awake": None, "asleep": None, "woken": None},
        "stats": {"awake": {"bytes": 10} if native else None, "asleep": None, "woken": None},
        "sleep_s": 0.5 + rank,
        "wake_s": 0.25,
        "sums_ok": True,
        "mechanisms": mechanisms,
        "bytes_freed": 6_000 if native else None,
        "fenced_reason": "backend nccl cannot suspend and torch cannot release ...",
        "training": {"plain": dict(run), "sleep": dict(run)},
    }  # fmt: skip


def test_rows_of_the_fallback_skip_the_native_path_with_its_reason():
    lines, rows = world_sleep.sleep_rows("8 ranks nccl bound", [_rank(r) for r in range(4)])
    assert all(ok for _, ok, _ in rows) and len(rows) == 3
    assert "awake 90000 MiB free, asleep 96000 MiB free, awake again 90100 MiB free" in lines[0]
    assert "sleep 3.5000 s, wake 0.2500 s" in lines[2]  # the slowest rank
    assert lines[-1] == (
        "  native suspend: skipped: NCCL 2.28.9; backend nccl cannot suspend and torch cannot release ..."
    )
    assert rows[1][2].startswith("56 groups over the ranks; memory 90000 MiB free -> 96000 MiB free")
    assert "losses [4.9, 4.8]; differs (rank, field): none" in rows[2][2]


def test_rows_of_the_native_path_and_of_a_step_that_differs():
    results = [_rank(r, native=12, device=False) for r in range(4)]
    results[2]["training"]["sleep"]["digest"] = "other"
    lines, rows = world_sleep.sleep_rows("t", results)
    assert "not measured (no device)" in lines[0] and "{'bytes': 10}" in lines[1]
    native = (
        "t sleep: native suspend (Backend.suspend)",
        True,
        "48 groups over the ranks; bytes freed on rank 0: 6000",
    )
    assert rows[2] == native and not any("native suspend: skipped" in line for line in lines)
    assert not rows[3][1] and "differs (rank, field): [(2, 'digest')]" in rows[3][2]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
@pytest.mark.rotating(7, 10)  # end-to-end part 8 of 10 (docs/testing.md, "Rotating parts")
def test_dry_run_of_sleep_and_wake(tmp_path):
    # 4 gloo ranks, bound (the split path through the gloo stand-in) then lazy: the GPU call's code
    # with CPU tensors; device memory not measured, the native path skipped with gloo's reason
    options = ["--world-modes", "bound,lazy", "--world-checks", "sleep", "--sleep-timeout", "240"]
    text, checks = _world_dry_run(tmp_path, *options)
    assert len(checks) == 6 and all(line.startswith("PASS") for line in checks), checks
    for mode in ("bound", "lazy"):
        tag = f"4 ranks gloo {mode} sleep"
        assert f"PASS  {tag}: every getter's group all-reduced before and after the sleep: 14 groups per rank" in text
        assert f"PASS  {tag}: the step after wake bit-identical to a run without sleep: 2 steps" in text
    assert text.count("awake not measured (no device), asleep not measured (no device)") == 2
    assert text.count("  native suspend: skipped: NCCL none; backend gloo cannot suspend") == 2
