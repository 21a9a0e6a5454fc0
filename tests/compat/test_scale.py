"""Per-rank work of compat's ``initialize_model_parallel`` does not grow with the world.

One rank of a large simulated world (torch's fake backend) initializes; every
``torch.distributed.new_group`` call is recorded. The rank must ask torch for exactly the groups
it belongs to — one call per group kind it is a member of, plus one per extra group an option
adds (the all-gather twin of the dp×cp group, the hybrid dp×cp groups) — each with
``use_local_synchronization=True`` and with itself as a member. MCore instead calls
``new_group`` for every group of the world (114,285 calls at 65,536 ranks for tp 8 pp 4 cp 2
ep 8).

The expected groups are computed here from :class:`MegatronLayout`, not from compat's state,
for the served release: the kinds it has come from its release facts (0.19's GTP kinds exist
with size 1), and an option it lacks is asked for its own way (0.18+: the all-gather group from
``create_all_gather_groups()`` after init) or the case is skipped with the reason.
No timing is asserted (``python -m scripts.bench init`` measures time and memory).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from compat import parallel_state as ps
from parallel_state_ng.layout.kinds import kind_exists
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from tests.support import served

BENCH = {
    "tensor_model_parallel_size": 8,
    "pipeline_model_parallel_size": 4,
    "context_parallel_size": 2,
    "expert_model_parallel_size": 8,
}

# (id, world size, rank, initialize_model_parallel keyword arguments)
CASES: list[tuple[str, int, int, dict[str, Any]]] = [
    ("bench-65536-mid", 65536, 65536 // 2 + 3, BENCH),
    ("bench-65536-first", 65536, 0, BENCH),  # first stage: word and position embedding
    ("bench-65536-last", 65536, 65535, BENCH),  # last stage: word embedding only
    ("bench-4096-mid", 4096, 2051, BENCH),
    (
        "dopt4-allgather-65536",
        65536,
        40000,
        {**BENCH, "num_distributed_optimizer_instances": 4, "create_all_gather_group": True},
    ),
    (
        "hcp-2x4-16384",
        16384,
        9999,
        {
            "tensor_model_parallel_size": 4,
            "pipeline_model_parallel_size": 2,
            "context_parallel_size": 8,
            "hierarchical_context_parallel_sizes": [2, 4],
            "expert_model_parallel_size": 4,
        },
    ),
    (
        "hcp-dopt2-allgather-32768",
        32768,
        32767,
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 8,
            "context_parallel_size": 4,
            "hierarchical_context_parallel_sizes": [4, 1],
            "num_distributed_optimizer_instances": 2,
            "create_all_gather_group": True,
        },
    ),
    (
        "etp1-order-tp-cp-ep-pp-dp-8192",
        8192,
        5000,
        {
            "tensor_model_parallel_size": 4,
            "pipeline_model_parallel_size": 4,
            "expert_model_parallel_size": 4,
            "expert_tensor_parallel_size": 1,
            "order": "tp-cp-ep-pp-dp",
        },
    ),
    (
        "hybrid-cp-4096",
        4096,
        1234,
        {"tensor_model_parallel_size": 2, "context_parallel_size": 4, "hybrid_context_parallel": True},
    ),
    ("pp1-world-1024", 1024, 511, {"tensor_model_parallel_size": 8}),
]

# Group kinds every rank is in (the embedding kinds: its stages only), in MCore's creation order;
# those a release lacks are left out by its facts (``kind_exists``).
_BASE_KINDS = ["gtp_remat", "dp_cp", "dp", "cp", "mp", "tp", "pp", "embd", "pos_embd", "tp_dp_cp", "tp_dp", "tp_cp"]
_EXPERT_KINDS = ["expt_gtp_remat", "ep", "ep_tp", "tp_ep_mp", "tp_ep_pp", "tp_ep_gtp_remat_pp", "ep_dp"]
_PARTIAL_KINDS = ["intra_dp_cp", "inter_dp_cp", "intra_ep_dp", "inter_ep_dp"]


def _expected_groups(world: int, rank: int, kwargs: dict[str, Any]) -> list[list[int]]:
    """Rank lists of every group ``rank`` must create, from MegatronLayout alone."""
    layout = MegatronLayout(
        world_size=world,
        tensor_model_parallel_size=kwargs.get("tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=kwargs.get("pipeline_model_parallel_size", 1),
        context_parallel_size=kwargs.get("context_parallel_size", 1),
        expert_model_parallel_size=kwargs.get("expert_model_parallel_size", 1),
        expert_tensor_parallel_size=kwargs.get("expert_tensor_parallel_size"),
        order=kwargs.get("order", "tp-cp-ep-dp-pp"),
        num_distributed_optimizer_instances=kwargs.get("num_distributed_optimizer_instances", 1),
        hierarchical_context_parallel_sizes=kwargs.get("hierarchical_context_parallel_sizes"),
    )
    partial = kwargs.get("num_distributed_optimizer_instances", 1) > 1
    levels = len(kwargs.get("hierarchical_context_parallel_sizes") or [])
    kinds = list(_BASE_KINDS) + list(_EXPERT_KINDS) + ["intra_dist_opt_instance"] + (_PARTIAL_KINDS if partial else [])
    kinds = [k for k in kinds if kind_exists(k, layout.facts)] + [f"hcp{i}" for i in range(levels)]
    groups = []
    for kind in kinds:
        ranks = layout.group(kind, rank)
        if ranks is None:
            assert kind in ("embd", "pos_embd"), f"rank {rank} is in no {kind} group"
            continue
        assert rank in ranks, (kind, rank)
        groups.append(ranks)
    if kwargs.get("create_all_gather_group"):  # 0.16-0.17 in init, 0.18+ create_all_gather_groups()
        groups.append(layout.group("dp_cp_ag", rank))
    if kwargs.get("hybrid_context_parallel"):
        dp_cp = layout.group("dp_cp", rank)
        size = 2
        while size < len(dp_cp):  # powers of two from 2 below dp x cp
            start = dp_cp.index(rank) // size * size
            groups.append(dp_cp[start : start + size])
            size *= 2
    return groups


@pytest.fixture
def new_group_calls(monkeypatch):
    """Keyword arguments of every ``torch.distributed.new_group`` call during the test."""
    calls: list[dict[str, Any]] = []
    original = dist.new_group

    def recording_new_group(*args, **kwargs):
        bound = dict(zip(["ranks", "timeout", "backend", "pg_options", "use_local_synchronization"], args))
        bound.update(kwargs)
        calls.append(bound)
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording_new_group)
    return calls


@pytest.fixture
def compat_state():
    """Make sure compat starts and ends uninitialized."""
    ps.destroy_model_parallel()
    yield
    ps.destroy_model_parallel()


@pytest.mark.parametrize("world,rank,kwargs", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_one_new_group_call_per_group_of_the_rank(world, rank, kwargs, fake_world, compat_state, new_group_calls):
    fake_world(rank, world)
    served.initialize(ps, dict(kwargs, create_gloo_process_groups=False))
    expected = _expected_groups(world, rank, kwargs)

    assert len(new_group_calls) == len(expected), (
        f"rank {rank} of {world}: {len(new_group_calls)} new_group calls, but it belongs to {len(expected)} groups"
    )
    for call in new_group_calls:
        assert call.get("use_local_synchronization") is True, call.get("group_desc")
        assert rank in call["ranks"], call.get("group_desc")
    made = sorted(sorted(call["ranks"]) for call in new_group_calls)
    assert made == sorted(sorted(g) for g in expected)


@pytest.mark.parametrize("world", [4096, 65536, 1048576])
def test_call_count_is_the_same_at_every_world_size(world, fake_world, compat_state, new_group_calls):
    """Tp 8 pp 4 cp 2 ep 8 on a middle rank: as many groups at 1,048,576 ranks as at 4,096 (15 on
    0.16; 18 on 0.19, whose three GTP kinds exist with size 1).
    """
    expected = len(_expected_groups(4096, 4096 // 2 + 3, BENCH))
    fake_world(world // 2 + 3, world)
    ps.initialize_model_parallel(create_gloo_process_groups=False, **BENCH)
    assert len(new_group_calls) == expected
    assert all(call.get("use_local_synchronization") is True for call in new_group_calls)
