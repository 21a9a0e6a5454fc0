"""Which module globals hold one group object, with sharing unset and under ``safe``: one release.

:func:`run` is called by ``tests/compat/test_identity_invariance.py`` through
``wheels.run_in_release``, one process per release (compat serves the release the process is
bound to). On simulated ranks it initializes compat twice per configuration and rank: sharing
unset, then ``PSNG_SHARE_GROUPS=safe``; each time it records which pairs of group globals (and
so which ``ProcessGroupCollection`` fields, filled from them) are one object. Every pair that
``safe`` joins must be explained by the policy (:func:`~parallel_state_ng.layout.sharing_policy.merge_rule`)
and cross no audited tie; ``safe`` must never split a pair sharing unset joins (MCore's own
aliases). The child returns counts, the explained merges and the problems.
"""

from __future__ import annotations

import inspect
import random
import warnings
from typing import Any

import torch.distributed as dist

from parallel_state_ng.groups import sharing
from parallel_state_ng.layout import sharing_policy as policy
from parallel_state_ng.layout.kinds import fills
from parallel_state_ng.testing.worlds import init_simulated_rank

# Configurations that make groups of size 1 coincide, always run: (world, kwargs).
CORNERS: list[tuple[int, dict[str, Any]]] = [
    (1, {}),  # a single rank: every group has size 1
    (4, {}),  # tp = pp = cp = ep = etp = 1: dp only
    (8, {"expert_tensor_parallel_size": 1}),
    (8, {"num_distributed_optimizer_instances": 2}),  # tp = pp = ep = 1, two optimizer instances
    (8, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4}),  # dp x cp = 1
    (8, {"tensor_model_parallel_size": 8}),  # dp x cp = 1, pp = 1
    (4, {"pipeline_model_parallel_size": 4}),  # tp = 1, dp = 1
    (8, {"tensor_model_parallel_size": 2, "context_parallel_size": 4}),  # dp = 1, cp > 1
    (8, {"expert_model_parallel_size": 8}),  # tp = pp = 1, ep = the world
    (8, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}),
    (16, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4, "expert_model_parallel_size": 2}),
    (2, {"pipeline_model_parallel_size": 2}),  # embd = pp
]
WORLDS = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def random_configs(seed: int, count: int) -> list[tuple[int, dict[str, Any]]]:
    """``count`` configurations of world sizes 2 ... 64 (sizes that divide; options at random)."""
    rng = random.Random(seed)
    out: list[tuple[int, dict[str, Any]]] = []
    while len(out) < count:
        world = rng.choice(WORLDS)
        tp, pp, cp = rng.choice((1, 2, 4)), rng.choice((1, 2, 4)), rng.choice((1, 1, 2))
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        kwargs: dict[str, Any] = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
        kwargs["context_parallel_size"] = cp
        kwargs["order"] = rng.choice(("tp-cp-ep-dp-pp", "tp-pp-dp"))
        ep = rng.choice((1, 2, 4))
        etp = rng.choice((None, 1, tp))
        if (world // pp) % (ep * (tp if etp is None else etp)) == 0:
            kwargs["expert_model_parallel_size"] = ep
            kwargs["expert_tensor_parallel_size"] = etp
        if dp * cp % 2 == 0 and rng.random() < 0.3:
            kwargs["num_distributed_optimizer_instances"] = 2
        out.append((world, kwargs))
    return out


def _objects(ps: Any) -> dict[str, tuple[str, Any, str | None]]:
    """Global name -> (kind, group object, backend) for every group global holding a group now."""
    out: dict[str, tuple[str, Any, str | None]] = {}
    for kind, fill in fills():
        if fill.value not in ("group", "gloo", "levels", "by_size") or fill.name not in vars(ps):
            continue
        value = vars(ps)[fill.name]
        backend = "gloo" if fill.value == "gloo" else None
        if isinstance(value, list):
            for i, group in enumerate(value):
                out[f"{fill.name}[{i}]"] = (kind.name, group, backend)
        elif isinstance(value, dict):
            for size, group in value.items():
                out[f"{fill.name}[{size}]"] = (kind.name, group, backend)
        elif value is not None:
            out[fill.name] = (kind.name, value, backend)
    return out


def _pairs(objects: dict[str, tuple[str, Any, str | None]]) -> set[tuple[str, str]]:
    names = sorted(objects)
    by_id: dict[int, list[str]] = {}
    for name in names:
        by_id.setdefault(id(objects[name][1]), []).append(name)
    return {(a, b) for same in by_id.values() for i, a in enumerate(same) for b in same[i + 1 :]}


def _observe(ps: Any, world: int, rank: int, kwargs: dict[str, Any], mode: str) -> Any:
    init_simulated_rank(rank, world, replace=True)
    previous = sharing.set_group_sharing(mode)
    try:
        try:
            ps.initialize_model_parallel(**kwargs)
        except Exception as err:  # noqa: BLE001 - a rejected configuration is a result
            return f"{type(err).__name__}: {err}"
        objects = _objects(ps)
        return objects, _pairs(objects)
    finally:
        ps.destroy_model_parallel()
        sharing.set_group_sharing(previous)


def run(part: int, parts: int, seed: int = 0, random_count: int = 48) -> dict[str, Any]:
    """The corners and part ``part`` of ``parts`` of the random configurations; see the module docstring."""
    import compat.parallel_state as ps
    from compat.pg_collection import FIELD_GLOBALS, FIELDS

    warnings.simplefilter("ignore")
    params = inspect.signature(ps.initialize_model_parallel).parameters
    configs = CORNERS + random_configs(seed, random_count)[part::parts]
    fields_of: dict[str, list[str]] = {}
    for field, global_name in FIELD_GLOBALS.items():
        if field in FIELDS:
            fields_of.setdefault(global_name, []).append(field)
    totals: dict[str, Any] = {"release": ps.MEGATRON_VERSION, "configs": 0, "ranks": 0, "pairs_compared": 0}
    totals.update(rejected=0, merges={}, problems=[])
    for world, kwargs in configs:
        kwargs = {k: v for k, v in kwargs.items() if k in params}
        totals["configs"] += 1
        for rank in sorted({0, world // 2, world - 1}):
            off = _observe(ps, world, rank, kwargs, "off")
            safe = _observe(ps, world, rank, kwargs, "safe")
            where = f"world {world} rank {rank} {kwargs}"
            if isinstance(off, str) or isinstance(safe, str):
                if off != safe:
                    totals["problems"].append(f"{where}: unset gives {off!r}, safe {safe!r}")
                totals["rejected"] += 1
                continue
            totals["ranks"] += 1
            (objects, off_pairs), (safe_objects, safe_pairs) = off, safe
            totals["pairs_compared"] += len(objects) * (len(objects) - 1) // 2
            if set(objects) != set(safe_objects):
                totals["problems"].append(f"{where}: other globals hold groups under safe")
            for a, b in sorted(off_pairs - safe_pairs):
                totals["problems"].append(f"{where}: safe splits {a} / {b}, one object unset (an alias MCore makes)")
            for a, b in sorted(safe_pairs - off_pairs):
                (kind_a, group, backend), kind_b = safe_objects[a], safe_objects[b][0]
                size = dist.get_world_size(group)
                rule = policy.merge_rule(kind_a, kind_b, size, backend)
                if kind_a != kind_b and rule is None:
                    tie = policy.tie_between(kind_a, kind_b)
                    why = f"crosses the audited tie {tie.name}" if tie else "no rule of the policy allows it"
                    totals["problems"].append(f"{where}: safe joins {a} ({kind_a}) and {b} ({kind_b}): {why}")
                    continue
                name = "same kind" if rule is None else rule.name
                key = f"{a} / {b}"
                entry = totals["merges"].setdefault(key, {"kinds": [kind_a, kind_b], "rule": name, "count": 0})
                entry["fields"] = sorted(fields_of.get(a, []) + fields_of.get(b, []))
                entry["count"] += 1
    return totals
