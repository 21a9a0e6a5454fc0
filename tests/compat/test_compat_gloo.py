"""``compat.parallel_state`` on real multi-process gloo worlds of 4 and 8 ranks.

For each configuration, every rank calls ``initialize_model_parallel`` (default
``create_gloo_process_groups=True``), then calls every group getter of the API (gloo twins,
hierarchical, partial, expert, embedding, amax, hybrid, all-gather groups included) and
all-reduces its global rank over each group it gets. In the test process the expected member
lists come from megatron-core's own ``RankGenerator`` plus the derivations MCore's
``initialize_model_parallel`` applies to its output (chunks for partial data parallel,
hierarchical sub-groups, embedding stages, ...). Checked per rank and getter call:

* the all-reduced sum equals the sum of ``dist.get_process_group_ranks(group)``;
* those members are MCore's group containing the rank (``None`` exactly where the rank is in
  no group of that kind, e.g. not an embedding stage);
* two calls return the same object exactly when MCore's would (gloo twins and the separate
  all-gather group are distinct objects; e.g. the amax group is the tp x dp group);
* ``destroy_model_parallel`` between configurations leaves no live group behind.

Several configurations run inside one ``world.run`` call: spawning workers is slow.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng.releases import parallel_state as api
from tests.support import served

# Worker processes import this module: keep megatron out of its module level.


# --------------------------------------------------------------------------- embedding callables
def last_two_stages(ranks):
    """Word embeddings on the last two pipeline stages."""
    return list(ranks[-2:])


def second_stage(ranks):
    """Position embeddings on the second pipeline stage."""
    return [ranks[1]]


# --------------------------------------------------------------------------- getter calls
# (getter, kwargs, kind of the expected group, flavor, applies-to-config predicate).
# Calls that MCore answers with the same object share (kind, flavor).
def _always(kw):
    return True


def _has_gloo(kw):
    return kw.get("create_gloo_process_groups", True)


CALLS = [
    ("get_model_parallel_group", {}, "mp", "main", _always),
    ("get_tensor_model_parallel_group", {}, "tp", "main", _always),
    ("get_pipeline_model_parallel_group", {}, "pp", "main", _always),
    ("get_data_parallel_group", {}, "dp", "main", _always),
    ("get_data_parallel_group", {"with_context_parallel": True}, "dp_cp", "main", _always),
    (
        "get_data_parallel_group",
        {"with_context_parallel": True, "partial_data_parallel": True},
        "intra_dp_cp",
        "main",
        _always,
    ),
    (
        "get_data_parallel_group",
        {"with_context_parallel": True, "independent_all_gather": True},
        "dp_cp",
        "all_gather",
        lambda kw: bool(kw.get("create_all_gather_group")),
    ),
    ("get_data_parallel_group_gloo", {}, "dp", "gloo", _has_gloo),
    ("get_data_parallel_group_gloo", {"with_context_parallel": True}, "dp_cp", "gloo", _has_gloo),
    (
        "get_data_parallel_group_gloo",
        {"with_context_parallel": True, "partial_data_parallel": True},
        "intra_dp_cp",
        "gloo",
        _has_gloo,
    ),
    ("get_context_parallel_group", {}, "cp", "main", _always),
    (
        "get_hierarchical_context_parallel_groups",
        {},
        "hcp",
        "main",
        lambda kw: bool(kw.get("hierarchical_context_parallel_sizes")),
    ),
    ("get_embedding_group", {"check_initialized": False}, "embd", "main", _always),
    ("get_position_embedding_group", {"check_initialized": False}, "pos_embd", "main", _always),
    ("get_amax_reduction_group", {}, "tp_dp", "main", _always),
    ("get_amax_reduction_group", {"with_context_parallel": True}, "tp_dp_cp", "main", _always),
    ("get_amax_reduction_group", {"tp_only_amax_red": True}, "tp", "main", _always),
    ("get_amax_reduction_group", {"with_context_parallel": True, "tp_only_amax_red": True}, "tp_cp", "main", _always),
    ("get_tensor_and_data_parallel_group", {}, "tp_dp", "main", _always),
    ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}, "tp_dp_cp", "main", _always),
    ("get_tensor_and_context_parallel_group", {}, "tp_cp", "main", _always),
    ("get_expert_model_parallel_group", {}, "ep", "main", _always),
    ("get_expert_tensor_parallel_group", {}, "etp", "main", _always),
    ("get_expert_tensor_and_model_parallel_group", {}, "tp_ep", "main", _always),
    ("get_expert_tensor_model_pipeline_parallel_group", {}, "tp_ep_pp", "main", _always),
    ("get_expert_data_parallel_group", {}, "edp", "main", _always),
    ("get_expert_data_parallel_group", {"partial_expert_data_parallel": True}, "intra_edp", "main", _always),
    ("get_data_modulo_expert_parallel_group", {}, "edp", "main", _always),
    ("get_data_modulo_expert_parallel_group", {"partial_expert_data_parallel": True}, "intra_edp", "main", _always),
    ("get_expert_data_parallel_group_gloo", {}, "edp", "gloo", _has_gloo),
    ("get_expert_data_parallel_group_gloo", {"partial_expert_data_parallel": True}, "intra_edp", "gloo", _has_gloo),
    ("get_intra_distributed_optimizer_instance_group", {}, "intra_dist_opt", "main", _always),
    ("get_inter_distributed_optimizer_instance_group", {"check_initialized": False}, "inter_edp", "main", _always),
    (  # 0.12 only; made only with several distributed-optimizer instances
        "get_inter_partial_data_parallel_group",
        {},
        "inter_dp_cp",
        "main",
        lambda kw: kw.get("num_distributed_optimizer_instances", 1) > 1,
    ),
    ("get_gtp_weight_remat_group", {}, "gtp", "main", _always),
    ("get_expert_gtp_weight_remat_group", {}, "egtp", "main", _always),
]

# Called once per hybrid group size, for configurations with hybrid_context_parallel.
HYBRID_CALL = "get_hybrid_data_context_parallel_groups"


def _calls_for(kw: dict) -> list[tuple[str, dict, str, str, bool]]:
    """The getter calls of configuration ``kw`` that the served release has (0.19 adds the GTP
    getters and drops ``get_data_modulo_expert_parallel_group``). A release whose getter lacks
    ``check_initialized`` (0.12's embedding getters) is called without it, and its
    "not initialized" assertion on a rank outside the group then reads as no group (the last
    item, True); a call with another argument the getter lacks is not made.
    """
    release = served.served()
    calls = []
    for name, args, kind, flavor, applies in CALLS:
        if not (applies(kw) and api.has(name, release)):
            continue
        params = {param[0] for param in api.signature(name, release) or ()}
        unchecked = args.get("check_initialized") is False and "check_initialized" not in params
        args = {key: value for key, value in args.items() if key in params or key != "check_initialized"}
        if set(args) <= params:
            calls.append((name, args, kind, flavor, unchecked))
    if kw.get("hybrid_context_parallel"):
        for size in _hybrid_sizes(kw["_world"], kw):
            calls.append((HYBRID_CALL, {"group_size": size}, f"hybrid{size}", "main", False))
    return calls


def _dims(world: int, kw: dict) -> dict[str, int]:
    tp = kw.get("tensor_model_parallel_size", 1)
    pp = kw.get("pipeline_model_parallel_size", 1)
    cp = kw.get("context_parallel_size", 1)
    ep = kw.get("expert_model_parallel_size", 1)
    etp = kw.get("expert_tensor_parallel_size") or tp
    return {
        "tp": tp,
        "pp": pp,
        "cp": cp,
        "ep": ep,
        "etp": etp,
        "dp": world // (tp * pp * cp),
        "edp": world // (etp * ep * pp),
        "n": kw.get("num_distributed_optimizer_instances", 1),
    }


def _hybrid_sizes(world: int, kw: dict) -> list[int]:
    d = _dims(world, kw)
    return [2**i for i in range(1, int(math.log2(d["dp"] * d["cp"])))]


# --------------------------------------------------------------------------- worker side
def _reduce_over_every_getter(configs: list[dict]) -> list[dict]:
    """On every rank, per configuration: init, all-reduce over every getter's group, destroy."""
    import compat.parallel_state as ps

    rank = dist.get_rank()
    out = []
    for kw in configs:
        live_before = len(dist.distributed_c10d._world.pg_map)
        init_kw = {k: v for k, v in kw.items() if not k.startswith("_")}
        ps.initialize_model_parallel(**init_kw)
        if kw.get("_all_gather_after_init"):  # 0.18+: destroy must free these too
            ps.create_all_gather_groups(for_expert_parallelism=True)
        try:
            objects: list = []  # distinct group objects, in first-seen order
            results = []
            for name, args, _kind, _flavor, unchecked in _calls_for(kw):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    try:
                        got = getattr(ps, name)(**args)
                    except AssertionError:
                        if not unchecked:
                            raise
                        got = None
                groups = got if isinstance(got, list) else [got]
                entry = []
                for group in groups:
                    if group is None:
                        entry.append(None)
                        continue
                    if not any(group is o for o in objects):
                        objects.append(group)
                    index = next(i for i, o in enumerate(objects) if o is group)
                    value = torch.tensor([rank], dtype=torch.int64)
                    dist.all_reduce(value, group=group)
                    entry.append((dist.get_process_group_ranks(group), int(value.item()), index))
                results.append(entry if isinstance(got, list) else entry[0])
            created = len(ps.get_state().created)
        finally:
            ps.destroy_model_parallel()
        out.append(
            {
                "results": results,
                "created": created,
                "leaked": len(dist.distributed_c10d._world.pg_map) - live_before,
            }
        )
    return out


# --------------------------------------------------------------------------- expected (MCore)
def _hierarchical(ranks: list[int], sizes: list[int]) -> list[list[list[int]]]:
    """Per level, the sub-groups MCore's create_hierarchical_groups makes of ``ranks``:
    level ``k`` groups ``sizes[k]`` members spaced ``prod(sizes[:k])`` apart.
    """
    levels = []
    for level, size in enumerate(sizes):
        stride = math.prod(sizes[:level])
        outer = math.prod(sizes[level + 1 :])
        levels.append(
            [
                [ranks[block * size * stride + j * stride + offset] for j in range(size)]
                for block in range(outer)
                for offset in range(stride)
            ]
        )
    return levels


def mcore_groups(world: int, kw: dict) -> dict[str, list[list[int]]]:
    """Every group of every kind, as megatron-core lays them out for ``kw`` on ``world`` ranks."""
    from megatron.core.parallel_state import RankGenerator

    d = _dims(world, kw)
    order = kw.get("order", "tp-cp-ep-dp-pp")
    dense = RankGenerator(tp=d["tp"], ep=1, dp=d["dp"], pp=d["pp"], cp=d["cp"], order=order, rank_offset=0)
    expert = RankGenerator(tp=d["etp"], ep=d["ep"], dp=d["edp"], pp=d["pp"], cp=1, order=order, rank_offset=0)
    g = {
        kind: dense.get_ranks(token)
        for kind, token in [
            ("tp", "tp"),
            ("pp", "pp"),
            ("dp", "dp"),
            ("cp", "cp"),
            ("mp", "tp-pp"),
            ("dp_cp", "dp-cp"),
            ("tp_dp", "tp-dp"),
            ("tp_dp_cp", "tp-dp-cp"),
            ("tp_cp", "tp-cp"),
        ]
    }
    g.update(
        {
            kind: expert.get_ranks(token)
            for kind, token in [
                ("ep", "ep"),
                ("etp", "tp"),
                ("tp_ep", "tp-ep"),
                ("tp_ep_pp", "tp-ep-pp"),
                ("edp", "dp"),
            ]
        }
    )
    n = d["n"]
    intra_edp_size = d["edp"] // n
    if n > 1:
        size = d["dp"] * d["cp"] // n
        g["intra_dp_cp"] = [grp[i * size : (i + 1) * size] for grp in g["dp_cp"] for i in range(n)]
        g["inter_dp_cp"] = [grp[i::size] for grp in g["dp_cp"] for i in range(size)]  # 0.12's getter
        levels = [_hierarchical(grp, [intra_edp_size, n]) for grp in g["edp"]]
        g["intra_edp"] = [sub for lv in levels for sub in lv[0]]
        g["inter_edp"] = [sub for lv in levels for sub in lv[1]]
    else:  # MCore hands out the full group object itself
        g["intra_dp_cp"] = g["dp_cp"]
        g["intra_edp"] = g["edp"]
        g["inter_edp"] = g["inter_dp_cp"] = []
    sizes = kw.get("hierarchical_context_parallel_sizes")
    if sizes:
        levels = [_hierarchical(grp, list(sizes)) for grp in g["cp"]]
        for level in range(len(sizes)):
            g[f"hcp{level}"] = [sub for lv in levels for sub in lv[level]]
    embd = kw.get("get_embedding_ranks") or (lambda r: [r[0]] if len(r) == 1 else [r[0], r[-1]])
    pos = kw.get("get_position_embedding_ranks") or (lambda r: [r[0]])
    g["gtp"] = g["egtp"] = [[r] for r in range(world)]  # 0.19's GTP axes, size 1 here
    g["embd"] = [embd(list(r)) for r in g["pp"]]
    g["pos_embd"] = [pos(list(r)) for r in g["pp"]]
    tep = g["tp_ep_pp"]
    g["intra_dist_opt"] = [
        [r for grp in tep[i : i + intra_edp_size] for r in grp] for i in range(0, len(tep), intra_edp_size)
    ]
    if kw.get("hybrid_context_parallel"):
        for s in _hybrid_sizes(world, kw):
            g[f"hybrid{s}"] = [grp[i : i + s] for grp in g["dp_cp"] for i in range(0, len(grp), s)]
    return g


# Kinds MCore serves with one object (the intra/partial kinds when there is one instance).
def _object_kind(kind: str, kw: dict) -> str:
    if kw.get("num_distributed_optimizer_instances", 1) == 1:
        return {"intra_dp_cp": "dp_cp", "intra_edp": "edp"}.get(kind, kind)
    return kind


def _expected_group(groups: dict, kind: str, rank: int):
    containing = [grp for grp in groups[kind] if rank in grp]
    assert len(containing) <= 1, f"{kind}: rank {rank} in several expected groups {containing}"
    return containing[0] if containing else None


def _check_world(world_size: int, configs: list[dict], out: list[list[dict]]) -> int:
    """Assert every rank's results against MCore's layout; return the number of (rank, group) checks."""
    checked = 0
    for c, kw in enumerate(configs):
        expected = mcore_groups(world_size, kw)
        calls = _calls_for(kw)
        for rank in range(world_size):
            res = out[rank][c]
            where = f"config {kw} rank {rank}"
            assert res["leaked"] == 0, f"{where}: {res['leaked']} groups left after destroy_model_parallel"
            assert len(res["results"]) == len(calls)
            owner: dict[tuple[str, str], int] = {}  # (object kind, flavor) -> object index
            for (name, args, kind, flavor, _), got in zip(calls, res["results"]):
                levels = (
                    [f"hcp{i}" for i in range(len(kw["hierarchical_context_parallel_sizes"]))]
                    if kind == "hcp"
                    else [kind]
                )
                gots = got if kind == "hcp" else [got]
                assert len(gots) == len(levels), f"{where}: {name}({args}) gave {len(gots)} groups"
                for level_kind, one in zip(levels, gots):
                    want = _expected_group(expected, level_kind, rank)
                    if want is None:
                        assert one is None, f"{where}: {name}({args}) gave {one}, MCore has no {level_kind} group"
                        continue
                    assert one is not None, f"{where}: {name}({args}) gave None, MCore: {want}"
                    members, total, index = one
                    assert members == sorted(want), f"{where}: {name}({args}) members {members}, MCore {want}"
                    assert total == sum(members), f"{where}: {name}({args}) all-reduce {total} != {sum(members)}"
                    key = (_object_kind(level_kind, kw), flavor)
                    assert owner.setdefault(key, index) == index, f"{where}: {name}({args}) is a different object"
                    checked += 1
            indices = list(owner.values())
            assert len(set(indices)) == len(indices), f"{where}: distinct MCore groups share an object: {owner}"
    return checked


WORLD_4 = [
    {},
    {"tensor_model_parallel_size": 2, "num_distributed_optimizer_instances": 2},
    {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2], "create_all_gather_group": True},
    {"expert_model_parallel_size": 4, "hybrid_context_parallel": True},
    {
        "tensor_model_parallel_size": 2,
        "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": 1,
        "order": "tp-ep-dp-pp",
    },
]
WORLD_8 = [
    {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "context_parallel_size": 2,
        "hierarchical_context_parallel_sizes": [1, 2],
    },
    {
        "tensor_model_parallel_size": 2,
        "expert_model_parallel_size": 4,
        "expert_tensor_parallel_size": 1,
        "num_distributed_optimizer_instances": 2,
    },
    {
        "pipeline_model_parallel_size": 2,
        "context_parallel_size": 2,
        "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": 1,
        "tensor_model_parallel_size": 2,
    },
    {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": 2,
        "order": "tp-pp-dp",
    },
    {
        "context_parallel_size": 4,
        "hierarchical_context_parallel_sizes": [2, 2],
        "hybrid_context_parallel": True,
        "create_all_gather_group": True,
        "num_distributed_optimizer_instances": 2,
    },
    {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 4,
        "order": "pp-tp-cp-ep-dp",
        "get_embedding_ranks": last_two_stages,
        "get_position_embedding_ranks": second_stage,
    },
]


def _served_config(kw: dict, world_size: int) -> dict:
    """``kw`` as the served release takes it (without the hybrid groups before 0.16; the
    all-gather groups in init on 0.16-0.17, after it on 0.18+, none before), tagged with the world.
    """
    init_kw, after = served.init_call(kw, optional=("hybrid_context_parallel", "create_all_gather_group"))
    return dict(init_kw, _world=world_size, _all_gather_after_init=after)


def test_call_table_covers_every_group_getter():
    """Every group getter of megatron-core's API is called above (a new one fails here)."""
    mcore_ps = pytest.importorskip("megatron.core.parallel_state")
    import inspect

    getters = {
        name
        for name, fn in vars(mcore_ps).items()
        if inspect.isfunction(fn)
        and fn.__module__ == mcore_ps.__name__
        and name.startswith("get_")
        and (name.endswith("_group") or name.endswith("_groups") or name.endswith("_group_gloo"))
    }
    covered = {name for name, *_ in CALLS} | {HYBRID_CALL}
    assert getters and getters <= covered, f"group getters not exercised: {sorted(getters - covered)}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size,configs", [(4, WORLD_4), (8, WORLD_8)], ids=["world4", "world8"])
def test_every_getter_group_all_reduces_over_mcore_members(world_size, configs, gloo_world):
    pytest.importorskip("megatron.core.parallel_state")
    world = gloo_world(world_size)
    tagged = [_served_config(kw, world_size) for kw in configs]
    out = world.run(_reduce_over_every_getter, tagged, timeout=300)
    checked = _check_world(world_size, tagged, out)
    # every rank checked at least the always-present kinds of every configuration
    assert checked >= world_size * len(configs) * 20
