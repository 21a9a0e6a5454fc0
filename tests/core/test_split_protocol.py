"""The split path's protocol on simulated worlds (fake backend; torch's split_group recorded).

On a world whose default group splits, every rank of the world must join the same sequence of
splits; members' colours must agree within a group and differ across groups; and each rank
must end with exactly the groups the member path gives it. Every rank of each world is played
in turn in this process; ``torch.distributed.split_group`` is replaced by a recorder that
creates the member's group on the fake backend (``PSNG_CREATION_PATH=split`` chooses the path:
the fake backend cannot split).
"""

from __future__ import annotations

import os
from collections import defaultdict
from contextlib import contextmanager
from typing import Any

import pytest
import torch.distributed as dist

import compat.parallel_state as ps
from parallel_state_ng import build_megatron_groups
from parallel_state_ng.groups.split import ENV_CREATION_PATH, creation_path
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.plan import CreateGroup, SplitOut, group_plan
from tests.support.worlds.fake import fake_world


class SplitRecorder:
    """Stands in for ``torch.distributed.split_group``: records each call, makes the member's group."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, **kw):
        assert parent_pg is None and split_ranks, "every split is of the default group, with a split given"
        rank = dist.get_rank()
        mine = next((sorted(g) for g in split_ranks if rank in g), None)
        assert len(split_ranks) == 1, f"a rank hands torch only its own group, got {len(split_ranks)} lists"
        self.calls.append(
            (group_desc, str(timeout), pg_options, kw.get("backend"), None if mine is None else tuple(mine))
        )
        if mine is None:
            return None
        return dist.new_group(mine, use_local_synchronization=True)


@contextmanager
def creation_env(path: str):
    old = os.environ.get(ENV_CREATION_PATH)
    os.environ[ENV_CREATION_PATH] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV_CREATION_PATH, None)
        else:
            os.environ[ENV_CREATION_PATH] = old


def play_world(world: int, build, monkeypatch) -> tuple[dict[int, list], dict[int, dict]]:
    """Run ``build()`` on every rank of a ``world``-rank fake world, split path and member path.

    Returns each rank's recorded splits and each rank's group ranks on both paths.
    """
    calls: dict[int, list] = {}
    ranks: dict[int, dict] = {}
    for rank in range(world):
        fake_world(rank, world)
        recorder = SplitRecorder()
        monkeypatch.setattr(dist, "split_group", recorder)
        with creation_env("split"):
            split_ranks = build()
        with creation_env("member"):
            member_ranks = build()
        monkeypatch.undo()
        calls[rank] = recorder.calls
        ranks[rank] = {"split": split_ranks, "member": member_ranks}
    dist.destroy_process_group()
    return calls, ranks


def check_protocol(calls: dict[int, list], world: int) -> int:
    """Identical split sequences on every rank; colours agree within a group and differ across groups."""
    sequences = {rank: [c[:4] for c in seq] for rank, seq in calls.items()}
    first = sequences[0]
    for rank, seq in sequences.items():
        assert seq == first, f"rank {rank}'s split sequence differs from rank 0's"
    for position in range(len(first)):
        members: dict[tuple, list[int]] = defaultdict(list)
        for rank in range(world):
            group = calls[rank][position][4]
            if group is not None:
                assert rank in group
                members[group].append(rank)
        seen: set[int] = set()
        for group, who in members.items():
            assert sorted(who) == list(group), f"split {position}: group {group} joined by {who}"
            assert not seen & set(group), f"split {position}: groups overlap"
            seen |= set(group)
    return len(first)


def compat_build(**kwargs):
    def build():
        ps.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
        try:
            return dict(ps.get_state().ranks)
        finally:
            ps.destroy_model_parallel()

    return build


COMPAT_CONFIGS = [
    (8, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
    (16, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "context_parallel_size": 2}),
    (16, {"tensor_model_parallel_size": 2, "context_parallel_size": 2, "expert_model_parallel_size": 2}),
    (16, {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2]}),
    (16, {"tensor_model_parallel_size": 2, "num_distributed_optimizer_instances": 2, "order": "tp-cp-ep-pp-dp"}),
    (32, {"pipeline_model_parallel_size": 4, "expert_model_parallel_size": 4, "expert_tensor_parallel_size": 2}),
]


@pytest.mark.parametrize("world,kwargs", COMPAT_CONFIGS)
def test_compat_init_splits_the_same_on_every_rank(world, kwargs, monkeypatch):
    calls, ranks = play_world(world, compat_build(**kwargs), monkeypatch)
    splits = check_protocol(calls, world)
    for rank in range(world):
        assert ranks[rank]["split"] == ranks[rank]["member"], f"rank {rank}: the paths give other groups"
    kinds = {key for r in ranks.values() for key in r["member"]}
    assert splits <= len(kinds), "at most one split per group kind"


def test_the_split_count_does_not_grow_with_the_world(monkeypatch):
    counts = []
    for world in (8, 64):
        calls, _ = play_world(
            world, compat_build(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), monkeypatch
        )
        counts.append(check_protocol(calls, world))
    assert counts[0] == counts[1]


def test_a_module_on_part_of_the_world_splits_on_every_rank(monkeypatch):
    def build():
        groups = build_megatron_groups(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, rank_offset=4, world_size=8, release="0.19"
        )
        try:
            return dict(groups.state.ranks) if groups.is_member else {}
        finally:
            groups.destroy()

    calls, ranks = play_world(16, build, monkeypatch)
    check_protocol(calls, 16)
    assert all(calls[r] and all(c[4] is None for c in calls[r]) for r in (0, 3, 12, 15)), "outside: no colour"
    for rank in range(16):
        assert ranks[rank]["split"] == ranks[rank]["member"]


@pytest.mark.parametrize("world", [8, 512, 4096])
def test_the_plan_lists_the_same_splits_for_every_rank(world):
    """Plan level, every rank of worlds up to 4,096: the same kinds in the same order, disjoint groups."""
    layout = MegatronLayout(
        world_size=world,
        tensor_model_parallel_size=8 if world >= 512 else 2,
        pipeline_model_parallel_size=4 if world >= 512 else 2,
        context_parallel_size=2,
        expert_model_parallel_size=8 if world >= 512 else 2,
        release="0.19",
    )
    reference = None
    members: dict[int, dict[tuple, int]] = defaultdict(dict)
    for rank in range(world):
        steps = [s for s in group_plan(layout, rank, every_split=True) if isinstance(s, (CreateGroup, SplitOut))]
        split = [s for s in steps if getattr(s, "backend", None) is None]
        shape = [(s.key, s.desc, s.nccl_key, s.timeout) for s in split]
        if reference is None:
            reference = shape
        assert shape == reference, f"rank {rank}"
        for position, step in enumerate(split):
            if isinstance(step, CreateGroup):
                group = tuple(sorted(step.ranks))
                owner = members[position].setdefault(group, len(members[position]))
                assert rank in group and owner >= 0
    for position, groups in members.items():
        covered = [r for g in groups for r in g]
        assert len(covered) == len(set(covered)), f"split {position}: overlapping groups"


def test_creation_path_choice_and_bad_values(monkeypatch, fake_world):
    fake_world(0, 4)
    assert creation_path() == "member"  # the fake backend has no bound device
    assert creation_path("split") == "split"
    monkeypatch.setenv(ENV_CREATION_PATH, "split")
    assert creation_path() == "split" and creation_path("member") == "member"
    monkeypatch.setenv(ENV_CREATION_PATH, "eager")
    with pytest.raises(ValueError, match=r"PSNG_CREATION_PATH must be one of auto, member, split, got 'eager'"):
        creation_path()
    with pytest.raises(ValueError, match=r"creation_path must be one of auto, member, split, got 'both'"):
        creation_path("both")


def test_an_encoder_layout_is_refused_on_the_split_path():
    layout = MegatronLayout(  # the encoder (tp 1) feeds two decoder pipelines (tp 2)
        world_size=4,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1,
        encoder_tensor_model_parallel_size=1,
        encoder_pipeline_model_parallel_size=2,
        release="0.13",
    )
    several = next(r for r in range(4) if len(layout.groups("pp", r)) > 1)
    with pytest.raises(ValueError, match="pipelines .* one split per group kind"):
        group_plan(layout, several, every_split=True)
