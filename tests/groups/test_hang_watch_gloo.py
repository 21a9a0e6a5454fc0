"""A hang named live and offline on 8 gloo ranks, in Megatron's tp2 pp2 dp2 and an ep2 MoE layout.

Each case runs one clean training step (tp all-reduce, ep all-to-all in the MoE layout, the
pipeline's batch_isend_irecv, dp's asynchronous gradient reduce) and then a step in which one
rank stalls: before the tp all-reduce, before the pipeline send, before the dp reduce, before
the ep all-to-all, in a sleep outside any collective (the data-loader stand-in), or by issuing
an all-gather where its tp peer issues an all-reduce. The watch (bound 1 s) reports once; the
stalled rank is released when the report is in the store, so every rank finishes (the
mismatch case ends at the groups' 4 s timeout instead). Then ``parallel-state-ng diagnose``
reads the watch's dumps and, where gloo records the collective, torch's own flight-recorder
dumps, and must name the same culprit, kind and coordinates.
"""

from __future__ import annotations

import io
import os
import time

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng.testing.worlds import GlooWorld

BOUND_S = 1.0
#: case -> (MoE layout, culprit rank, stuck kind, its coordinates in the report)
CASES = {
    "tp": (False, 3, "tp", "tp at dp=1 pp=0"),
    "pp": (False, 1, "pp", "pp at tp=1 dp=0"),
    "dp": (False, 6, "dp", "dp at tp=0 pp=1"),
    "loader": (False, 5, "tp", "tp at dp=0 pp=1"),
    "ep": (True, 4, "ep", "ep at tp=0 pp=1"),
    "mismatch": (False, 2, "tp", "tp at dp=1 pp=0"),
}


def _wait_for(watch, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if watch.reported():
            return True
        time.sleep(0.05)
    return False


def _step(ps, watch, moe: bool, stall: str | None, culprit: int, marks: dict) -> None:
    rank = dist.get_rank()

    def hold(where: str) -> None:
        if stall == where and rank == culprit:
            marks["stalled_at"] = time.monotonic()
            marks["released"] = _wait_for(watch, 20)
            marks["report_after"] = time.monotonic() - marks["stalled_at"]

    x = torch.ones(4)
    hold("loader")
    if stall == "mismatch" and rank == culprit:
        marks["stalled_at"] = time.monotonic()
        out = torch.empty(8)
        dist.all_gather_into_tensor(out, x, group=ps.get_tensor_model_parallel_group())
    else:
        hold("tp")
        dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
    if moe:
        hold("ep")
        out = torch.empty(4)
        dist.all_to_all_single(out, x, group=ps.get_expert_model_parallel_group())
    hold("pp")
    pp = ps.get_pipeline_model_parallel_group()
    stage, ranks = ps.get_pipeline_model_parallel_rank(), dist.get_process_group_ranks(pp)
    act = torch.ones(4)
    if stage == 0:
        ops = [dist.P2POp(dist.isend, act, ranks[1], group=pp)]
    else:
        ops = [dist.P2POp(dist.irecv, act, ranks[0], group=pp)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    hold("dp")
    dist.all_reduce(torch.ones(4), group=ps.get_data_parallel_group(), async_op=True).wait()


def _case(case: str, dump_dir: str, fr_dir: str) -> dict:
    import compat.parallel_state as ps
    from parallel_state_ng.groups.hang_watch import HangWatch
    from parallel_state_ng.layout.megatron_layout import MegatronLayout

    moe, culprit, _, _ = CASES[case]
    ep = 2 if moe else 1
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=ep,
        distributed_timeout_minutes=4 / 60,
    )
    layout = MegatronLayout(8, 2, 2, expert_model_parallel_size=ep)
    reports: list[str] = []
    marks: dict = {}
    loader = "data loader" if case == "loader" else ""
    watch = HangWatch(
        BOUND_S, layout=layout, on_report=reports.append, dump_dir=dump_dir, fr_dump_dir=fr_dir, note=lambda: loader
    ).start()
    error = ""
    try:
        _step(ps, watch, moe, None, culprit, marks)
        try:
            _step(ps, watch, moe, case, culprit, marks)
        except Exception as err:  # the mismatch: the groups' timeout ends both sides
            error = type(err).__name__
        _wait_for(watch, 20)
    finally:
        watch.stop()
        ps.destroy_model_parallel()
    return {"report": reports[0] if reports else None, "error": error, **marks}


@pytest.fixture(scope="module")
def world():
    with GlooWorld(8, env={"TORCH_FR_BUFFER_SIZE": "2000"}, timeout=90) as w:
        yield w


def _offline(dump_dir: str, moe: bool) -> str:
    from parallel_state_ng.__main__ import main

    out = io.StringIO()
    argv = ["diagnose", dump_dir, "--world-size", "8", "--tp", "2", "--pp", "2"] + (["--ep", "2"] if moe else [])
    import contextlib

    with contextlib.redirect_stdout(out):
        code = main(argv)
    assert code == 0, out.getvalue()
    return out.getvalue()


@pytest.mark.multiprocess
@pytest.mark.rotating(7, 10)  # end-to-end part 8 of 10 (docs/testing.md, "Rotating parts")
@pytest.mark.parametrize("case", list(CASES))
def test_hang_named_live_and_offline(world, case, tmp_path):
    moe, culprit, kind, where = CASES[case]
    dumps, fr = tmp_path / "watch", tmp_path / "fr"
    dumps.mkdir()
    fr.mkdir()
    results = world.run(_case, case, str(dumps), str(fr), timeout=60)
    reports = [r["report"] for r in results if r["report"]]
    assert len(reports) == 1, reports  # printed once
    first = reports[0].splitlines()[0]
    assert f"likely culprit rank {culprit} " in first and f"stuck group {where}" in first, reports[0]
    if case == "mismatch":
        assert "issued all_gather" in first and results[culprit]["error"], reports[0]
    else:
        assert results[culprit]["released"] and results[culprit]["report_after"] < 3 * BOUND_S + 1.5
    if case == "loader":
        assert "in no collective (data loader)" in first
    offline = _offline(str(dumps), moe).splitlines()[0]
    assert f"likely culprit rank {culprit} " in offline and f"stuck group {where}" in offline, offline
    if case != "pp":  # gloo's flight recorder does not record p2p (docs/reliability.md)
        assert len(os.listdir(fr)) == 8
        torch_fr = _offline(str(fr), moe).splitlines()[0]
        assert f"likely culprit rank {culprit} " in torch_fr and f"stuck group {kind} " in torch_fr, torch_fr
