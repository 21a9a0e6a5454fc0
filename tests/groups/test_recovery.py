"""Recovery in place (parallel_state_ng/groups/recovery.py): the choice, and the survivors rejoining.

Decision (simulated ranks): ``PSNG_RECOVERY`` and the argument, bad values, a backend that cannot
shrink (logged), a plan that renumbers the survivors. Plumbing (4 gloo processes, tp 2 x dp 2,
rank 3 dies): the survivors agree on the dead, plan the new layout and rejoin, once through a
stand-in for ``torch.distributed.shrink_group`` (tests/support/worlds/shrink_stand_in.py) and
once by the re-initialization gloo falls back to; the kept replica builds the plan's layout,
all-reduces over it, destroys it, and no group is left.
"""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from parallel_state_ng.groups.recovery import ENV_RECOVERY, choose_recovery, keeps_order, shrink_support
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.rebuild import plan_rebuild
from tests.support import rotation
from tests.support.worlds.failure import RESTART_CASE, kept_after_shrink, lose_rank, run_world


def test_a_backend_that_cannot_shrink_falls_back_to_reinit_and_says_why(psng_simulated_rank, caplog, monkeypatch):
    psng_simulated_rank(0, 4)
    monkeypatch.delenv(ENV_RECOVERY, raising=False)
    # Why depends on the torch at hand: before shrink_group (TORCH_FACTS) torch has none; with
    # it, the fake backend of the simulated rank cannot shrink.
    why = "cannot shrink" if hasattr(dist, "shrink_group") else "has no torch.distributed.shrink_group"
    assert why in (shrink_support() or "")
    with caplog.at_level(logging.INFO, logger="parallel_state_ng.groups.recovery"):
        choice = choose_recovery()
    assert choice.method == "reinit" and why in choice.reason
    assert "recovery over the survivors: reinit" in caplog.text
    assert choose_recovery(shrink=lambda *a, **k: None).method == "shrink"
    assert choose_recovery("reinit", shrink=lambda *a, **k: None).method == "reinit"
    with pytest.raises(RuntimeError, match=f"method=shrink, but the default group cannot be shrunk here: .*{why}"):
        choose_recovery("shrink")
    monkeypatch.setenv(ENV_RECOVERY, "shrink")
    with pytest.raises(RuntimeError, match="PSNG_RECOVERY=shrink"):
        choose_recovery()
    monkeypatch.setenv(ENV_RECOVERY, "later")
    with pytest.raises(ValueError, match="PSNG_RECOVERY must be one of auto, shrink, reinit, got 'later'"):
        choose_recovery()
    with pytest.raises(ValueError, match="method must be one of auto, shrink, reinit, got 'x'"):
        choose_recovery("x")


def test_a_plan_that_renumbers_the_survivors_is_not_shrunk():
    layout = MegatronLayout(world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    dropped = plan_rebuild(layout, [5], keep_spares=False)  # replica 1 (ranks 2, 3, 6, 7) goes on
    kept = plan_rebuild(layout, [5], keep_spares=True)  # ranks 0, 1, 4 follow it as spares
    assert keeps_order(dropped) and not keeps_order(kept)
    stand_in = lambda *a, **k: None  # noqa: E731
    assert choose_recovery(shrink=stand_in, keeps_order=keeps_order(dropped)).method == "shrink"
    choice = choose_recovery(shrink=stand_in, keeps_order=keeps_order(kept))
    assert choice.method == "reinit" and "out of their old order" in choice.reason


WORLD, LOST, DETECT_S, AGREE_S = RESTART_CASE


def recover(rank: int, directory: str, method: str) -> dict:
    import torch
    import torch.distributed as dist

    from parallel_state_ng import build_megatron_groups
    from parallel_state_ng.groups.recovery import rejoin
    from tests.support.worlds import shrink_stand_in

    groups = build_megatron_groups(tensor_model_parallel_size=2)
    layout = groups.layout
    out = lose_rank(rank, WORLD, LOST, DETECT_S, AGREE_S)
    plan = plan_rebuild(layout, out["dead"], keep_spares=False)
    shrink = shrink_stand_in.gloo_shrink if method == "shrink" else None
    done = rejoin(plan, rank=rank, epoch=1, shrink=shrink)
    out.update(abort_s=0.0, new_rank=done.rank, method=done.method, reason=done.reason)
    out["shrinks"] = len(shrink_stand_in.calls)
    if done.rank is None:
        out["initialized"] = dist.is_initialized()
        return out
    new = build_megatron_groups(**plan.build_kwargs)
    x = torch.tensor([float(done.rank + 1)])
    dist.all_reduce(x, group=new.group("tp"))
    out.update(tp=new.layout.tensor_model_parallel_size, dp=new.layout.data_parallel_size, tp_sum=x.item())
    out["source"] = plan.source_of(done.rank)
    out["destroyed"] = new.destroy()
    out["left"] = len(dist.distributed_c10d._world.pg_map)
    dist.destroy_process_group()
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
# shrink in every run, auto (which picks shrink or re-init itself) every other (docs/testing.md, "Rotating parts")
@pytest.mark.parametrize("method", rotation.sample(["shrink", "auto"], keep={"shrink"}, parts=2))
def test_survivors_rejoin_and_build_the_plan(tmp_path, method):
    results = run_world(WORLD, str(tmp_path), recover, method, expect=WORLD - 1, timeout=120)
    kept = kept_after_shrink(results, LOST)
    for rank, r in results.items():
        want = "shrink" if method == "shrink" else "reinit"
        assert r["method"] == want, r
        if method == "auto":
            assert "cannot shrink" in r["reason"], r
        if rank not in kept:
            assert r["initialized"] is False and r["shrinks"] == 0, r
    for r in kept.values():
        assert (r["tp"], r["dp"], r["tp_sum"]) == (2, 1, 3.0), r
        assert r["left"] == 1, r  # only the new default group
        assert r["shrinks"] == (1 if method == "shrink" else 0), r
