"""Differential check of ``build_megatron_groups(...).collection()`` against one megatron-core release.

Runs inside a process bound to one release (:func:`tests.support.releases.wheels.run_in_release`,
or the installed megatron-core in-process), on the fake backend: for each configuration and
sampled rank, every field of MCore's own ``ProcessGroupCollection.use_mpu_process_groups()``
and of :func:`parallel_state_ng.builders.collection.build_megatron_groups` with the same
arguments must hold the same ranks (:func:`run`).
"""

from __future__ import annotations

import dataclasses
import inspect
import random
from typing import Any

import torch.distributed as dist

from parallel_state_ng.testing.worlds import init_simulated_rank
from tests.support.differential.observe import reset_mcore

_SIZE_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "num_distributed_optimizer_instances",
)


def first_stage_only(pp_ranks: list[int], vp: int | None = None) -> list[int]:
    """A custom embedding-rank rule (the first stage only), as a user would pass one."""
    return [pp_ranks[0]]


HAND_CONFIGS: list[tuple[int, dict[str, Any]]] = [
    (1, {}),
    (8, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
    (8, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "order": "tp-cp-ep-pp-dp"}),
    (
        16,
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "context_parallel_size": 2,
            "expert_model_parallel_size": 2,
        },
    ),
    (8, {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2]}),
    (
        16,
        {
            "tensor_model_parallel_size": 2,
            "expert_model_parallel_size": 4,
            "expert_tensor_parallel_size": 1,
            "num_distributed_optimizer_instances": 2,
        },
    ),
    (
        16,
        {
            "pipeline_model_parallel_size": 4,
            "get_embedding_ranks": first_stage_only,
            "get_position_embedding_ranks": first_stage_only,
        },
    ),
    (12, {"tensor_model_parallel_size": 3, "pipeline_model_parallel_size": 2}),
    (8, {"tensor_model_parallel_size": 3}),  # indivisible: rejected by both
    (16, {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 4, "order": "tp-ep-cp-dp-pp"}),
]

GTP_CONFIGS: list[tuple[int, dict[str, Any]]] = [
    (8, {"tensor_model_parallel_size": 2, "gtp_remat_size": 2}),
    (16, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "gtp_remat_size": 2}),
    (
        16,
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "expert_model_parallel_size": 2,
            "gtp_remat_size": 2,
            "expert_gtp_remat_size": 2,
        },
    ),
    (16, {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "expert_gtp_remat_size": 2}),
]

_ORDERS = ("tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp", "tp-pp-dp-cp-ep", "cp-tp-ep-dp-pp", "tp-dp-cp-ep-pp")


def random_configs(seed: int, count: int) -> list[tuple[int, dict[str, Any]]]:
    """Seeded configurations: sizes from small powers of two, any of several orders."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        tp, pp, cp, dp = (rng.choice(v) for v in ((1, 2, 4), (1, 2, 4), (1, 2), (1, 2, 4)))
        world = tp * pp * cp * dp
        kwargs: dict[str, Any] = {
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "context_parallel_size": cp,
            "order": rng.choice(_ORDERS),
        }
        etp = rng.choice((None, 1, tp))
        if rng.random() < 0.6:
            kwargs["expert_model_parallel_size"] = rng.choice((1, 2, 4))
            kwargs["expert_tensor_parallel_size"] = etp
        if rng.random() < 0.3:
            kwargs["num_distributed_optimizer_instances"] = 2
        if cp == 2 and rng.random() < 0.3:
            kwargs["hierarchical_context_parallel_sizes"] = [1, 2]
        out.append((world, kwargs))
    return out


def _ranks(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [_ranks(v) for v in value]
    return list(dist.get_process_group_ranks(value))


def _snapshot(collection: Any) -> dict[str, Any]:
    return {f.name: _ranks(getattr(collection, f.name)) for f in dataclasses.fields(collection)}


def _reference(world: int, rank: int, kwargs: dict[str, Any]) -> Any:
    import megatron.core.parallel_state as mps
    from megatron.core.process_groups_config import ProcessGroupCollection

    init_simulated_rank(rank, world, replace=True)
    reset_mcore()  # MCore's destroy leaves globals behind; a failed init leaves more
    try:
        mps.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
        return _snapshot(ProcessGroupCollection.use_mpu_process_groups())
    except Exception as err:  # noqa: BLE001 - a rejected configuration is a result
        return err
    finally:
        mps.destroy_model_parallel()


def _ours(world: int, rank: int, kwargs: dict[str, Any]) -> Any:
    from parallel_state_ng.builders.collection import build_megatron_groups

    init_simulated_rank(rank, world, replace=True)
    ours = dict(kwargs)
    if "local_world_size" in ours:
        ours["world_size"] = ours.pop("local_world_size")
    try:
        groups = build_megatron_groups(**ours)
    except Exception as err:  # noqa: BLE001
        return err
    try:
        if not groups.is_member:
            return "not a member"
        return _snapshot(groups.collection())
    finally:
        groups.destroy()


def _with_offset(world: int, kwargs: dict[str, Any], rng: random.Random) -> tuple[int, dict[str, Any]]:
    """The configuration placed on part of a larger world (0.17+: rank_offset / local_world_size)."""
    offset = rng.choice((1, 2, 4))
    extra = rng.choice((0, 3))
    return world + offset + extra, {**kwargs, "rank_offset": offset, "local_world_size": world}


def run(seed: int = 0, random_count: int = 24) -> dict[str, Any]:
    """Compare every configuration's sampled ranks; returns totals and the mismatches.

    MCore's own ``initialize_model_parallel`` then ``use_mpu_process_groups()`` gives the
    reference (the ranks of every field), destroyed again; then ``build_megatron_groups`` with
    the same arguments gives ours. Every field of every rank must hold the same ranks (or be
    ``None`` on both). Arguments MCore rejects must be rejected by ours too.
    """
    import megatron.core.parallel_state as mps

    params = inspect.signature(mps.initialize_model_parallel).parameters
    rng = random.Random(seed + 1)
    configs = HAND_CONFIGS + random_configs(seed, random_count)
    if "rank_offset" in params:
        configs += [_with_offset(w, k, rng) for w, k in configs[1:8]]
    if "gtp_remat_size" in params:  # 0.19: the GTP weight-rematerialization axes
        configs += GTP_CONFIGS
    totals: dict[str, Any] = {"configs": 0, "rejected_by_both": 0, "ranks": 0, "fields": 0, "mismatches": []}
    totals["outside_ranks"] = 0
    totals["gtp_configs"] = sum(
        1 for _, kwargs in configs if "gtp_remat_size" in kwargs or "expert_gtp_remat_size" in kwargs
    )
    totals["offset_configs"] = sum(1 for _, kwargs in configs if "rank_offset" in kwargs)
    for world, kwargs in configs:
        offset = kwargs.get("rank_offset", 0)
        members = range(offset, offset + kwargs.get("local_world_size", world - offset))
        sample = sorted({0, world - 1, members[0], members[-1], rng.randrange(world), rng.randrange(world)})
        totals["configs"] += 1
        for rank in sample:
            ref, got = _reference(world, rank, kwargs), _ours(world, rank, kwargs)
            what = f"world {world} rank {rank} { ({k: getattr(v, '__name__', v) for k, v in kwargs.items()}) }"
            if rank not in members and not isinstance(got, Exception):
                # A rank outside the module: MCore builds nothing for it (its collection getters
                # then fail or return None); ours holds no group and says so.
                totals["outside_ranks"] += 1
                if got != "not a member":
                    totals["mismatches"].append(f"{what}: outside rank got {got!r}")
                continue
            if isinstance(ref, Exception) or isinstance(got, Exception):
                if isinstance(ref, Exception) and isinstance(got, Exception):
                    totals["rejected_by_both"] += 1
                    totals.setdefault("rejections", []).append(f"{what}: mcore {ref!r}; ours {got!r}")
                    break
                totals["mismatches"].append(f"{what}: mcore {ref!r} vs ours {got!r}")
                continue
            totals["ranks"] += 1
            totals["fields"] += len(ref)
            if ref != got:
                diff = {k: (ref.get(k), got.get(k)) for k in ref.keys() | got.keys() if ref.get(k) != got.get(k)}
                totals["mismatches"].append(f"{what}: {diff}")
    return totals
