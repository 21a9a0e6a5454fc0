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

import os

import pytest

from parallel_state_ng.testing.worlds import GlooWorld
from scripts.examples.hang import CASES, names_case, offline, stall_case

BOUND_S = 1.0


@pytest.fixture(scope="module")
def world():
    with GlooWorld(8, env={"TORCH_FR_BUFFER_SIZE": "2000"}, timeout=90) as w:
        yield w


def _first_line(dump_dir: str, case: str) -> str:
    code, out = offline(dump_dir, case)
    assert code == 0, out
    return out.splitlines()[0]


@pytest.mark.multiprocess
@pytest.mark.rotating(2, 10)  # end-to-end part 3 of 10 (docs/testing.md, "Rotating parts")
@pytest.mark.parametrize("case", list(CASES))
def test_hang_named_live_and_offline(world, case, tmp_path):
    _, culprit, kind, _ = CASES[case]
    dumps, fr = tmp_path / "watch", tmp_path / "fr"
    dumps.mkdir()
    fr.mkdir()
    results = world.run(stall_case, case, str(dumps), str(fr), BOUND_S, timeout=60)
    reports = [r["report"] for r in results if r["report"]]
    assert len(reports) == 1, reports  # printed once
    first = reports[0].splitlines()[0]
    assert names_case(first, case), reports[0]
    if case == "mismatch":
        assert "issued all_gather" in first and results[culprit]["error"], reports[0]
    else:
        assert results[culprit]["released"] and results[culprit]["report_after_s"] < 3 * BOUND_S + 1.5
    if case == "loader":
        assert "in no collective (data loader)" in first
    watched = _first_line(str(dumps), case)
    assert names_case(watched, case), watched
    if case != "pp":  # gloo's flight recorder does not record p2p (docs/reliability.md)
        assert len(os.listdir(fr)) == 8
        torch_fr = _first_line(str(fr), case)
        assert f"likely culprit rank {culprit} " in torch_fr and f"stuck group {kind} " in torch_fr, torch_fr
