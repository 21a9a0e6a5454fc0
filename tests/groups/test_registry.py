"""The process-wide communicator registry (``PSNG_SHARE_GROUPS=process``): several layouts, one communicator per key.

Simulated ranks (fake backend) count communicators and check the reference counting: every
kind of layout (compat's state, ``build_megatron_groups``, a grid, an inference collection)
shares through the registry; each destroy gives its layout's hold back once; the last holder
destroys; abort aborts each communicator once; off by default nothing is shared across
layouts. Real gloo worlds check that the surviving layout's groups still reduce correctly,
that ranks disagreeing on the setting all fail, and that members of a shared group all reuse
it. The split path is played rank by rank (:mod:`tests.support.worlds.split_recorder`). The
failure-case table is in docs/compat.md ("Several layouts in one process").
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import compat.parallel_state as ps
from parallel_state_ng import HyperCommGrid, build_megatron_groups
from parallel_state_ng.builders.inference import build_inference_collection, destroy_inference_collection
from parallel_state_ng.groups import creation, registry, sharing
from parallel_state_ng.groups.factory import GroupFactory

_WORLD = dist.distributed_c10d._world


class _CountingNewGroup:
    """Stands in for ``torch.distributed.new_group``: records each call's (ranks, backend, timeout)."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, *args, **kwargs):
        self.calls.append((tuple(kwargs["ranks"]), kwargs.get("backend"), kwargs.get("timeout")))
        return self.real(*args, **kwargs)


@pytest.fixture
def counted(monkeypatch):
    counter = _CountingNewGroup(dist.new_group)
    monkeypatch.setattr(dist, "new_group", counter)
    return counter


def _mode(monkeypatch, mode):
    monkeypatch.setattr(sharing, "_override", mode)


def _groups(built) -> list:
    """Every process group a layout object holds on this rank."""
    if isinstance(built, HyperCommGrid):
        return [pg for pg in built._pgs.values() if pg is not None]
    if hasattr(built, "state"):
        return list(built.state.created)
    return [pg for pg in vars(built).values() if pg is not None]


def _build_four(rank_offset_grid: int = 0):
    """Training (tp 2 pp 2), evaluation (tp 2 pp 1), a grid (tp x dp) and an inference collection (tp 2), world 8."""
    train = build_megatron_groups(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    evaluation = build_megatron_groups(tensor_model_parallel_size=2)
    grid = HyperCommGrid([2, 4], ["tp", "dp"], rank_offset_grid)
    grid.create_pg("tp")
    grid.create_pg("dp")
    inference = build_inference_collection(8, tp_size=2, pp_size=1, cp_size=1, ep_size=1, expt_tp_size=2)
    return {"train": train, "eval": evaluation, "grid": grid, "inference": inference}


def _destroy(name: str, built) -> int:
    if name == "grid":
        built.destroy()
        return 0
    if name == "inference":
        return destroy_inference_collection(built)
    return built.destroy()


# --------------------------------------------------------------------------- switch
def test_switch_values_and_errors(monkeypatch):
    monkeypatch.delenv(sharing.ENV_SHARE, raising=False)
    assert sharing.group_sharing_mode() == "off"
    for text, mode in (("process", "process"), ("1", "build"), ("0", "off"), ("PROCESS", "process")):
        monkeypatch.setenv(sharing.ENV_SHARE, text)
        assert sharing.group_sharing_mode() == mode
    monkeypatch.setenv(sharing.ENV_SHARE, "processes")
    with pytest.raises(ValueError, match=r"PSNG_SHARE_GROUPS must be 0, safe, 1 or process, got 'processes'"):
        sharing.group_sharing_mode()
    with pytest.raises(ValueError, match="enabled must be 0, safe, 1 or process"):
        sharing.set_group_sharing("everywhere")
    with pytest.raises(TypeError, match="enabled must be a bool"):
        sharing.set_group_sharing(2)
    previous = sharing.set_group_sharing("process")
    try:
        assert sharing.group_sharing_mode() == "process" and sharing.group_sharing_enabled()
    finally:
        sharing.set_group_sharing(previous)


# --------------------------------------------------------------------------- simulated ranks
@pytest.mark.parametrize("rank", [0, 5])
def test_layouts_share_one_communicator_per_key_and_free_it_with_the_last(fake_world, monkeypatch, counted, rank):
    fake_world(rank, 8)
    baseline = set(_WORLD.pg_map)
    _mode(monkeypatch, "off")
    built = _build_four()
    unshared = len(counted.calls)
    assert unshared == len(set(_WORLD.pg_map) - baseline)
    for name, obj in built.items():
        _destroy(name, obj)
    assert set(_WORLD.pg_map) == baseline and not registry.entries()

    counted.calls.clear()
    _mode(monkeypatch, "process")
    built = _build_four()
    keys = [key for key, _, _ in registry.entries()]
    assert len(counted.calls) == len(set(counted.calls)) == len(keys) < unshared  # one creation per key
    tp, grid_tp = built["train"].group("tp"), built["grid"].get_pg("tp")
    assert built["eval"].group("tp") is tp and built["inference"].tp is grid_tp
    assert grid_tp is not tp  # torch's default timeout (grids) is not the init's 30 minutes: another key
    assert {id(g) for g in creation.live_groups()} == {id(g) for _, g, _ in registry.entries()}
    assert registry.holders(tp) == registry.holders(grid_tp) == 2

    # destroy in another order than built; each destroy twice: the second changes nothing
    order = ["eval", "inference", "train", "grid"]
    for step, name in enumerate(order):
        _destroy(name, built[name])
        left = {id(g) for _, g, _ in registry.entries()}
        _destroy(name, built[name])
        assert {id(g) for _, g, _ in registry.entries()} == left, name
        for other in order[step + 1 :]:
            for group in _groups(built[other]):
                assert group in _WORLD.pg_map and registry.held(group), (name, other)
    assert tp not in _WORLD.pg_map and grid_tp not in _WORLD.pg_map
    assert set(_WORLD.pg_map) == baseline and not registry.entries() and not creation.live_groups()


def test_off_by_default_and_build_sharing_stay_inside_one_build(fake_world, monkeypatch, counted):
    monkeypatch.delenv(sharing.ENV_SHARE, raising=False)
    fake_world(0, 8)
    for mode in (None, "build"):
        _mode(monkeypatch, mode)
        first = build_megatron_groups(tensor_model_parallel_size=2)
        second = build_megatron_groups(tensor_model_parallel_size=2)
        assert not registry.entries()
        assert not {id(g) for g in first.state.created} & {id(g) for g in second.state.created}
        first.destroy()
        assert all(g in _WORLD.pg_map for g in second.state.created)  # today's behaviour: nothing shared
        second.destroy()


def test_compat_states_share_and_destroy_state_keeps_the_other(fake_world, monkeypatch):
    fake_world(3, 8)
    _mode(monkeypatch, "process")
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    train = ps.detach_state()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2, context_parallel_size=2, create_gloo_process_groups=False
    )
    assert ps.get_tensor_model_parallel_group() is train.groups["tp"]
    ps.destroy_state(train)
    ps.destroy_state(train)  # twice: no second release
    assert ps.get_tensor_model_parallel_group() in _WORLD.pg_map
    assert registry.holders(ps.get_tensor_model_parallel_group()) == 1
    ps.destroy_model_parallel()
    assert not registry.entries() and not creation.live_groups()


def test_a_topology_shares_with_a_layout_and_its_destroy_keeps_it(fake_world, monkeypatch):
    from parallel_state_ng import ModuleSpec, build_topology

    fake_world(1, 4)
    _mode(monkeypatch, "process")
    whole = build_megatron_groups(tensor_model_parallel_size=2)
    topology = build_topology(
        [
            ModuleSpec("vision", ranks=range(0, 2), tensor_model_parallel_size=2),
            ModuleSpec("language", ranks=range(2, 4), tensor_model_parallel_size=2, language=True),
        ],
        release="0.19",
    )
    tp = whole.group("tp")
    assert topology.groups("vision").group("tp") is tp and topology.grid("vision").get_pg("tp") is tp
    assert registry.holders(tp) == 2
    topology.destroy()
    topology.destroy()
    assert tp in _WORLD.pg_map and registry.holders(tp) == 1
    whole.destroy()
    assert not registry.entries() and not creation.live_groups()


def test_different_timeouts_or_options_get_different_communicators(fake_world, monkeypatch):
    fake_world(0, 4)
    _mode(monkeypatch, "process")
    short = build_megatron_groups(tensor_model_parallel_size=2, distributed_timeout_minutes=5)
    long = build_megatron_groups(tensor_model_parallel_size=2, distributed_timeout_minutes=6)
    assert short.group("tp") is not long.group("tp")
    pools = [GroupFactory(), GroupFactory()]
    a, _ = pools[0].group([0, 1], timeout=timedelta(minutes=1))
    b, _ = pools[1].group([0, 1], timeout=timedelta(minutes=2))
    c, new = pools[1].group([0, 1], timeout=timedelta(minutes=1))
    assert a is not b and c is a and new and registry.holders(a) == 2
    assert sharing.sharing_key([0, 1], "gloo", None, None) != sharing.sharing_key([0, 1], None, None, None)
    for pool in pools:
        creation.destroy_groups([a, b, c], lease=pool.lease)
    short.destroy()
    long.destroy()
    assert not registry.entries() and not creation.live_groups()


def test_destroyed_then_rebuilt_reuses_nothing_stale(fake_world, monkeypatch, counted):
    fake_world(1, 8)
    _mode(monkeypatch, "process")
    first = _build_four()
    old = {id(g): g for obj in first.values() for g in _groups(obj)}  # kept alive: ids stay unique
    for name, obj in first.items():
        _destroy(name, obj)
    made = len(counted.calls)
    again = _build_four()
    assert len(counted.calls) == 2 * made  # every communicator created again
    assert not {id(g) for obj in again.values() for g in _groups(obj)} & set(old)
    assert all(holders >= 1 for _, _, holders in registry.entries())
    for name, obj in again.items():
        _destroy(name, obj)
    assert not registry.entries()


def test_abort_aborts_each_shared_communicator_once(fake_world, monkeypatch):
    fake_world(2, 8)
    _mode(monkeypatch, "process")
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    built = _build_four()
    shared = [g for _, g, _ in registry.entries()]
    assert registry.holders(ps.get_tensor_model_parallel_group()) == 3  # compat, train and eval
    calls: list[int] = []
    # torch before _abort_process_group (TORCH_FACTS "abort_process_group"): the engine's call
    # fails as it does there (AttributeError) and the engine unregisters the group itself.
    real = getattr(dist.distributed_c10d, "_abort_process_group", None)

    def recording(group=None):
        calls.append(id(group))
        if real is None:
            raise AttributeError("_abort_process_group")
        return real(group)

    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", recording, raising=False)
    result = ps.abort_model_parallel()
    assert sorted(calls) == sorted(id(g) for g in shared) and result.aborted == len(shared)
    assert not registry.entries() and not creation.live_groups()
    for name, obj in built.items():  # the holders' destroys find nothing left
        assert _destroy(name, obj) == 0
    assert not calls[len(shared) :]


def test_split_path_reuse_keeps_every_rank_in_the_same_splits(monkeypatch):
    """Three layouts on the split path: members of a reused group all join without a colour."""
    from tests.support.worlds.split_recorder import check_protocol, compare_paths, play_world

    def two_layouts():
        train = build_megatron_groups(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        evaluation = build_megatron_groups(tensor_model_parallel_size=2)
        inference = build_inference_collection(8, tp_size=2, pp_size=2, cp_size=1, ep_size=1, expt_tp_size=2)
        try:
            fields = {k: None if v is None else dist.get_process_group_ranks(v) for k, v in vars(inference).items()}
            return {"train": dict(train.state.ranks), "eval": dict(evaluation.state.ranks), "inference": fields}
        finally:
            train.destroy()
            evaluation.destroy()
            destroy_inference_collection(inference)
            assert not registry.entries()

    colourless = {}
    for mode in ("build", "process"):
        monkeypatch.setenv(sharing.ENV_SHARE, {"build": "1", "process": "process"}[mode])
        calls, results = play_world(8, two_layouts)
        assert check_protocol(calls, 8) == len(calls[0])
        assert compare_paths(results) == []
        colourless[mode] = sum(c[4] is None for c in calls[0])
    assert colourless["process"] > colourless["build"]  # eval's groups reused from train


# --------------------------------------------------------------------------- gloo worlds
def _two_layouts_destroy_one(first: str) -> dict:
    sharing.set_group_sharing("process")
    before = set(_WORLD.pg_map)
    try:
        train = build_megatron_groups(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        evaluation = build_megatron_groups(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
        shared = train.group("tp") is evaluation.group("tp") and train.group("dp") is not evaluation.group("dp")
        gone, kept = (train, evaluation) if first == "train" else (evaluation, train)
        gone.destroy()
        gone.destroy()
        sums = {}
        for kind in ("tp", "dp", "mp", "tp_dp"):
            x = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(x, group=kept.group(kind))
            sums[kind] = (kept.ranks(kind), x.item())
        kept.destroy()
        return {
            "shared": shared,
            "sums": sums,
            "left": len(set(_WORLD.pg_map) - before),
            "live": len(creation.live_groups()),
        }
    finally:
        sharing.set_group_sharing(None)


@pytest.mark.parametrize("first", ["train", "eval"])
def test_destroying_one_layout_leaves_the_other_working_on_gloo(gloo_world, first):
    for rank, result in enumerate(gloo_world(4).run(_two_layouts_destroy_one, first)):
        assert result["shared"], rank
        for kind, (ranks, total) in result["sums"].items():
            assert total == sum(ranks), (rank, kind)
        assert result["left"] == result["live"] == 0, rank


def _switch_on_rank_zero_only() -> str:
    sharing.set_group_sharing("process" if dist.get_rank() == 0 else "build")
    try:
        build_megatron_groups(tensor_model_parallel_size=2).destroy()
    except RuntimeError as exc:
        return type(exc).__name__ + ": " + str(exc)
    finally:
        sharing.set_group_sharing(None)
    return "built"


def test_the_switch_on_some_ranks_only_fails_on_every_rank(gloo_world):
    for outcome in gloo_world(4).run(_switch_on_rank_zero_only):
        assert outcome.startswith("ParallelConfigMismatchError") and "group sharing" in outcome
        assert "'process'" in outcome and "'build'" in outcome


def _a_group_of_a_wider_layout_reused_by_its_members() -> dict:
    """Layout A (ranks 0-3, tp 2) makes [0, 1] and [2, 3]; grid B over ranks 0-1 asks for [0, 1]."""
    sharing.set_group_sharing("process")
    counter = _CountingNewGroup(dist.new_group)
    dist.new_group = counter
    try:
        wide = build_megatron_groups(tensor_model_parallel_size=2)
        made = len(counter.calls)
        narrow = HyperCommGrid([2], ["tp"], 0)
        group = narrow.create_pg("tp", timeout=timedelta(minutes=30))  # the init's timeout: the same key
        reused = group is not None and group is wide.group("tp")
        out = {"new_calls": len(counter.calls) - made, "reused": reused}
        if group is not None:
            x = torch.tensor([1.0])
            dist.all_reduce(x, group=group)
            out["sum"] = x.item()
        narrow.destroy()
        wide.destroy()
        return out
    finally:
        dist.new_group = counter.real
        sharing.set_group_sharing(None)


def test_members_of_a_shared_group_all_reuse_it(gloo_world):
    results = gloo_world(4).run(_a_group_of_a_wider_layout_reused_by_its_members)
    assert results[:2] == [{"new_calls": 0, "reused": True, "sum": 2.0}] * 2  # ranks 0 and 1 both reuse
    assert results[2:] == [{"new_calls": 0, "reused": False}] * 2  # outside the grid: no call at all


# --------------------------------------------------------------------------- a rank dies
def _second_layout_with_a_death(rank: int, directory: str) -> dict:
    """Layout A (tp 2) is built; rank 3 dies in its first new_group of layout B (tp 2 pp 2, another
    timeout: B shares only A's groups made with torch's default timeout, and creates the rest).
    """
    import time

    from parallel_state_ng.groups.liveness import RankFailureError

    sharing.set_group_sharing("process")
    first = build_megatron_groups(tensor_model_parallel_size=2)
    before = len(_WORLD.pg_map)
    if rank == 3:
        dist.new_group = lambda *args, **kwargs: __import__("os")._exit(1)
    start = time.monotonic()
    try:
        build_megatron_groups(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, distributed_timeout_minutes=20
        )
        outcome: dict = {"error": None}
    except RankFailureError as err:
        outcome = {"error": "RankFailureError", "dead": err.dead}
    outcome["seconds"] = time.monotonic() - start
    outcome["kept"] = len(_WORLD.pg_map) == before and registry.holders(first.group("tp")) == 1
    sums = {}
    for kind in ("tp", "dp"):
        if 3 not in first.ranks(kind):  # a group with the dead rank cannot reduce
            x = torch.tensor([float(rank)])
            dist.all_reduce(x, group=first.group(kind))
            sums[kind] = x.item()
    outcome["sums"] = sums
    return outcome


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_rank_dying_in_a_second_build_leaves_the_first_layout_working(tmp_path):
    from tests.support.worlds.failure import run_world

    bound = 4.0
    results = run_world(4, str(tmp_path), _second_layout_with_a_death, expect=3, timeout=90,
                        env={"PSNG_FAILURE_TIMEOUT": str(bound)})  # fmt: skip
    assert sorted(results) == [0, 1, 2], results
    for outcome in results.values():
        assert outcome["error"] == "RankFailureError" and outcome["dead"] == [3], outcome
        assert outcome["seconds"] < 4 * bound, outcome  # the failure bound, not the group timeout
        assert outcome["kept"], outcome  # the rollback left the first layout's groups, held once
    assert results[0]["sums"] == {"tp": 1.0, "dp": 2.0}
    assert results[1]["sums"] == {"tp": 1.0} and results[2]["sums"] == {"dp": 2.0}


# --------------------------------------------------------------------------- the layout tool
def test_layout_tool_counts_several_layouts_as_built(fake_world, monkeypatch, capsys):
    """``layout --share --with-layout``: each setting's count is what the builds create on the rank."""
    import json

    from parallel_state_ng.__main__ import main as cli_main

    argv = ["layout", "--world-size", "16", "--tp", "2", "--pp", "2", "--share", "--no-gloo-twins"]
    assert cli_main([*argv, "--with-layout", "tp=2,cp=2", "--with-layout", "tp=4", "--format", "json"]) == 0
    info = json.loads(capsys.readouterr().out)["report"]["layouts"]
    assert len(info["layouts"]) == 3
    for rank in (0, 15):
        fake_world(rank, 16)
        for mode in ("off", "build", "process"):
            _mode(monkeypatch, mode)
            counter = _CountingNewGroup(dist.new_group)
            monkeypatch.setattr(dist, "new_group", counter)
            built = [
                build_megatron_groups(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                build_megatron_groups(tensor_model_parallel_size=2, context_parallel_size=2),
                build_megatron_groups(tensor_model_parallel_size=4),
            ]
            monkeypatch.setattr(dist, "new_group", counter.real)
            assert len(counter.calls) == info["ranks"][str(rank)][mode], (rank, mode)
            for layout in built:
                layout.destroy()
    counts = info["ranks"]["0"]
    assert counts["process"] < counts["build"] < counts["off"]
    for bad, message in (("tp=2,xx=1", "bad part"), ("tp=0", "int >= 1"), ("tp=2,tp=2", "twice"), ("tp=3", "invalid")):
        assert cli_main([*argv, "--with-layout", bad]) == 2
        err = capsys.readouterr().err
        assert "argument --with-layout" in err and message in err, err


def _histories_differ(rank: int, directory: str) -> dict:
    """Both ranks build A (tp 2: [0, 1]); rank 0 alone destroys it; both then ask a grid for [0, 1]."""
    import time

    from parallel_state_ng.groups.liveness import RankFailureError

    sharing.set_group_sharing("process")
    first = build_megatron_groups(tensor_model_parallel_size=2)
    if rank == 0:
        first.destroy()
    start = time.monotonic()
    try:
        group = HyperCommGrid([2], ["tp"]).create_pg("tp", timeout=timedelta(minutes=30))
        outcome: dict = {"error": None, "reused": group is first.group("tp")}
    except RankFailureError as err:
        outcome = {"error": "RankFailureError", "dead": err.dead}
    outcome["seconds"] = time.monotonic() - start
    return outcome


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ranks_with_different_histories_fail_within_the_bound(tmp_path):
    """Outside the assumption (same builds and destroys on every rank): the creating rank raises."""
    from tests.support.worlds.failure import run_world

    bound = 2.0
    results = run_world(2, str(tmp_path), _histories_differ, timeout=60, env={"PSNG_FAILURE_TIMEOUT": str(bound)})
    assert results[1]["error"] is None and results[1]["reused"], results  # rank 1 still held A's group
    assert results[0]["error"] == "RankFailureError" and results[0]["dead"] == [1], results
    assert results[0]["seconds"] < 4 * bound, results
