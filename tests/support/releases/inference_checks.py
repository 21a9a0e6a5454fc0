"""Megatron 0.19's inference shards against :mod:`parallel_state_ng.builders.inference`, in one release process.

Runs inside a process bound to megatron-core 0.19 (:func:`tests.support.releases.wheels.run_in_release`),
on the fake backend. :func:`run` compares, for each (configuration, rank) pair of :data:`CONFIGS`,
Megatron's own ``build_inference_pg_collection`` / ``build_inference_pg_collections_for_shards``
with ours: every collection field's ranks (in ``get_process_group_ranks`` order), which fields
are set, ``None`` where Megatron's is, the returned ``InferenceShard`` objects; and counts the
``new_group`` calls each makes on the rank. :data:`BAD_CASES` must raise Megatron's exception
types (ours, and our stand-in parser against Megatron's normaliser). Then ``compat.install()``
(plain, on first import of the shards module, and with ``hyper_comm_grid=True``) must serve ours
under Megatron's names, with sizes from compat's ``parallel_state``, and ``uninstall`` restore them.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from parallel_state_ng.testing.calls import NewGroupCalls
from parallel_state_ng.testing.worlds import init_simulated_rank

SIZES = ("tp_size", "pp_size", "cp_size", "ep_size", "expt_tp_size")

#: A single window: (fake world, build_inference_pg_collection arguments, megatron init or None).
#: A shard layout: (total world, shards, use_tp_pp_dp_mapping, spec objects instead of dicts).
SINGLE: list[tuple[int, dict[str, Any], dict[str, int] | None]] = [
    (8, {"world_size": 8, "tp_size": 2, "pp_size": 2, "cp_size": 1, "ep_size": 2, "expt_tp_size": 1}, None),
    (8, {"world_size": 8, "tp_size": 2, "pp_size": 2, "cp_size": 1, "ep_size": 2, "expt_tp_size": 1,
         "use_tp_pp_dp_mapping": True}, None),
    (16, {"world_size": 16, "tp_size": 2, "pp_size": 2, "cp_size": 2, "ep_size": 4, "expt_tp_size": 1}, None),
    (16, {"world_size": 16, "tp_size": 2, "pp_size": 2, "cp_size": 2, "ep_size": 2, "expt_tp_size": 2,
          "use_tp_pp_dp_mapping": True}, None),
    (16, {"world_size": 8, "tp_size": 2, "pp_size": 2, "cp_size": 1, "ep_size": 2, "expt_tp_size": 2,
          "rank_offset": 4}, None),
    (16, {"world_size": 8, "tp_size": 2, "pp_size": 2, "cp_size": 1, "ep_size": 2, "expt_tp_size": 1,
          "use_tp_pp_dp_mapping": True, "rank_offset": 8}, None),
    (12, {"world_size": 6, "tp_size": 3, "pp_size": 2, "cp_size": 1, "ep_size": 1, "expt_tp_size": 1,
          "rank_offset": 6}, None),
    (16, {"world_size": 4, "tp_size": 1, "pp_size": 2, "cp_size": 1, "ep_size": 2, "expt_tp_size": 1,
          "rank_offset": 12}, None),
    (16, {"world_size": 16, "tp_size": 1, "pp_size": 4, "cp_size": 1, "ep_size": 2, "expt_tp_size": 1}, None),
    (4, {"world_size": 4, "tp_size": 2, "pp_size": 1, "cp_size": 1, "ep_size": 2, "expt_tp_size": 1}, None),
    (8, {"world_size": 8}, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                            "expert_model_parallel_size": 2}),
    (8, {"world_size": 4, "tp_size": 1, "rank_offset": 4}, {"tensor_model_parallel_size": 2,
                                                           "pipeline_model_parallel_size": 2}),
]  # fmt: skip
#: The configuration whose sizes all come from ``parallel_state`` (checked again under compat).
DEFAULTS_INDEX = next(i for i, (_, kwargs, _) in enumerate(SINGLE) if set(kwargs) == {"world_size"})
SHARDS: list[tuple[int, Any, bool, bool]] = [
    (8, "tp=2,dp=1+tp=1,dp=2+tp=2,pp=2", False, False),
    (8, [{"tp": 2, "dp": 2}, {"tp": 1, "dp": 4, "ep": 2, "expt_tp": 1}], False, True),
    (16, "tp=2,pp=2,dp=2,ep=2,expt_tp=1,role=prefill;tp=4,dp=2,role=decode", True, False),
    (6, "tp=2 + tp=1,dp=4", True, False),
    (8, [{"tp": 2, "pp": 2, "ep": 2, "expt_tp": 1}, {"tp": 2, "dp": 2, "role": "decode"}], False, False),
]
#: (what, arguments, megatron init or None): each must raise as Megatron raises.
BAD_CASES: list[tuple[str, Any]] = [
    ("shards", (2, "tp2")),
    ("shards", (2, "tp=2,xp=1")),
    ("shards", (1, "tp=1,role=both")),
    ("shards", (1, "tp=1,cp=2")),
    ("shards", (4, "tp=2,dp=1")),
    ("shards", (2, "tp=2,ep=4")),
    ("shards", (4, "")),
    ("shards", (2, [{"tp": 2, "tq": 1}])),
    ("shards", (1, "tp=x")),
    ("shards", (1, [{"tp": 1, "role": "PREFILL"}])),
    ("single", {"world_size": 8, "tp_size": 3, "pp_size": 1, "cp_size": 1, "ep_size": 1, "expt_tp_size": 1}),
    ("single", {"world_size": 8, "tp_size": 2, "pp_size": 1, "cp_size": 1, "ep_size": 3, "expt_tp_size": 1}),
    ("single", {"world_size": 8, "tp_size": 2, "pp_size": 2, "cp_size": 1, "ep_size": 1, "expt_tp_size": 1,
                "use_tp_pp_dp_mapping": True}),
    ("single", {"world_size": 4, "tp_size": 1, "pp_size": 1, "cp_size": 1, "ep_size": 1, "expt_tp_size": 1,
                "rank_offset": -1}),
    ("single", {"world_size": 8, "tp_size": 2, "pp_size": 1, "cp_size": 1, "ep_size": 1, "expt_tp_size": 1,
                "rank_offset": 4}),
    ("single", {"world_size": 8, "tp_size": 0, "pp_size": 1, "cp_size": 1, "ep_size": 1, "expt_tp_size": 1}),
    ("single", {"world_size": 8, "tp_size": -2, "pp_size": 1, "cp_size": 1, "ep_size": 1, "expt_tp_size": 1}),
]  # fmt: skip
BAD_WORLD = 8


def _bind() -> tuple[Any, Any]:
    """Megatron's parallel_state and shards modules (the bare ``megatron.core`` needs ``mpu``)."""
    import megatron.core
    import megatron.core.parallel_state as ps

    if not hasattr(megatron.core, "mpu"):
        megatron.core.mpu = ps  # what megatron/core/__init__.py binds
    import megatron.core.inference.shards as shards

    return ps, shards


def _snapshot(collection: Any) -> dict[str, Any] | None:
    """Which fields are set, and each field's ranks (``None`` for an unset or ``None`` field)."""
    if collection is None:
        return None
    ranks = {}
    for name, value in vars(collection).items():
        ranks[name] = None if value is None else list(dist.get_process_group_ranks(value))
    return {"class": type(collection).__qualname__, "set": sorted(vars(collection)), "ranks": ranks}


def _shards_view(shards: list[Any]) -> list[Any]:
    return [
        {
            "class": f"{type(s).__module__}.{type(s).__qualname__}",
            "spec": repr(s.spec),
            "spec_fields": dataclasses.asdict(s.spec),
            "rank_offset": s.rank_offset,
            "world_size": s.world_size,
            "collection": _snapshot(s.pg_collection),
        }
        for s in shards
    ]


def _counted(world: int, rank: int, init: dict[str, int] | None, ps: Any, call: Callable[[], Any]) -> tuple[Any, int]:
    """``call()`` on a fresh fake world as ``rank`` (after Megatron's init, if any); its new_group calls."""
    from tests.support.differential.observe import reset_mcore

    init_simulated_rank(rank, world, replace=True)
    reset_mcore()
    if init is not None:
        ps.initialize_model_parallel(create_gloo_process_groups=False, **init)
    try:
        with NewGroupCalls() as count:
            result = call()
        return result, count.calls
    finally:
        if init is not None:
            ps.destroy_model_parallel()


def _ranks_to_check(world: int, first: int, size: int) -> list[int]:
    inside = {first, first + size - 1, first + size // 2 + 1 if size > 2 else first}
    outside = [r for r in (0, world - 1, first - 1, first + size) if 0 <= r < world and not first <= r < first + size]
    return sorted(inside | set(outside[:1]))


def _pairs() -> list[tuple[str, int, int, Any]]:
    """Every (kind, configuration index, rank, arguments) pair of the table."""
    pairs = []
    for index, (world, kwargs, _init) in enumerate(SINGLE):
        for rank in _ranks_to_check(world, kwargs.get("rank_offset", 0), kwargs["world_size"]):
            pairs.append(("single", index, rank, kwargs))
    for index, (total, _spec, _mapping, _objects) in enumerate(SHARDS):
        for rank in sorted({0, 1, total // 2, total - 2, total - 1}):
            pairs.append(("shards", index, rank, None))
    return pairs


def _compare_table(ps: Any, shards_mod: Any, totals: dict[str, Any]) -> dict[tuple[str, int, int], Any]:
    from megatron.core.inference.shards_spec import InferenceShardSpec

    from parallel_state_ng.builders import inference

    references: dict[tuple[str, int, int], Any] = {}
    for kind, index, rank, _ in _pairs():
        if kind == "single":
            world, kwargs, init = SINGLE[index]
            theirs_call: Callable[[], Any] = lambda: shards_mod.build_inference_pg_collection(**kwargs)  # noqa: E731
            ours_call: Callable[[], Any] = lambda: inference.build_inference_collection(**kwargs)  # noqa: E731
            view: Callable[[Any], Any] = _snapshot
        else:
            world, spec, mapping, objects = SHARDS[index]
            init = None
            if objects:
                spec = [InferenceShardSpec(**item) for item in spec]
            theirs_call = lambda: shards_mod.build_inference_pg_collections_for_shards(world, spec, mapping)  # noqa: E731
            ours_call = lambda: inference.build_inference_collections_for_shards(world, spec, mapping)  # noqa: E731
            view = _shards_view
        theirs, theirs_calls = _counted(world, rank, init, ps, theirs_call)
        theirs_view = view(theirs)
        ours, ours_calls = _counted(world, rank, init, ps, ours_call)
        ours_view = view(ours)
        totals["pairs"] += 1
        totals[f"{kind}_pairs"] += 1
        totals["megatron_calls"] += theirs_calls
        totals["our_calls"] += ours_calls
        totals["max_our_calls"] = max(totals["max_our_calls"], ours_calls)
        totals["max_megatron_calls"] = max(totals["max_megatron_calls"], theirs_calls)
        collections = [theirs_view] if kind == "single" else [s["collection"] for s in theirs_view]
        totals["fields"] += sum(len(c["ranks"]) for c in collections if c is not None)
        outside = all(c is None or all(v is None for v in c["ranks"].values()) for c in collections)
        totals["outside_pairs"] += int(outside)
        if kind == "shards":
            totals["shards_types_same"] += int(
                all(type(a) is type(b) and a.spec == b.spec for a, b in zip(ours, theirs)) and len(ours) == len(theirs)
            )
        references[(kind, index, rank)] = theirs_view
        if theirs_view != ours_view:
            totals["mismatches"].append(f"{kind} {index} rank {rank}: megatron {theirs_view} vs ours {ours_view}")
    return references


def _exception(call: Callable[[], Any]) -> BaseException | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the exception is the outcome
        return exc
    return None


def _compare_bad(shards_mod: Any, totals: dict[str, Any]) -> None:
    from megatron.core.inference.shards_spec import normalize_shard_specs

    from parallel_state_ng.builders import inference
    from parallel_state_ng.layout.shard_spec import parse_shard_specs

    for what, args in BAD_CASES:
        calls: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = []
        if what == "shards":
            total, spec = args
            calls.append(
                (
                    "build",
                    lambda: shards_mod.build_inference_pg_collections_for_shards(total, spec),
                    lambda: inference.build_inference_collections_for_shards(total, spec),
                )
            )
            calls.append(
                ("stand-in parser", lambda: normalize_shard_specs(spec, total), lambda: parse_shard_specs(spec, total))
            )
        else:
            calls.append(
                (
                    "build",
                    lambda: shards_mod.build_inference_pg_collection(**args),
                    lambda: inference.build_inference_collection(**args),
                )
            )
        for label, theirs_call, ours_call in calls:
            init_simulated_rank(0, BAD_WORLD if what == "single" else max(args[0], 1), replace=True)
            theirs = _exception(theirs_call)
            init_simulated_rank(0, BAD_WORLD if what == "single" else max(args[0], 1), replace=True)
            with NewGroupCalls() as count:
                ours = _exception(ours_call)
            totals["bad_checks"] += 1
            if theirs is None or ours is None or not isinstance(ours, type(theirs)):
                totals["mismatches"].append(f"bad {what} {args!r} ({label}): megatron {theirs!r} vs ours {ours!r}")
            elif label == "build" and count.calls:
                totals["mismatches"].append(f"bad {what} {args!r}: ours created {count.calls} groups before raising")
            else:
                totals["bad_messages"].append(f"{type(theirs).__name__} / ours {type(ours).__name__}: {ours}")
        totals["bad_cases"] += 1


def _check_install(
    shards_mod: Any, ps: Any, references: dict[tuple[str, int, int], Any], totals: dict[str, Any]
) -> None:
    """``compat.install()`` (plain and with ``hyper_comm_grid=True``) serves ours; uninstall restores."""
    import compat
    from parallel_state_ng.builders.inference import SERVED_AS

    names = list(SERVED_AS)
    originals = {name: getattr(shards_mod, name) for name in names}
    world, kwargs, init = SINGLE[DEFAULTS_INDEX]  # sizes from parallel_state
    assert init is not None
    for hyper_comm_grid in (False, True):
        compat.install(hyper_comm_grid=hyper_comm_grid)
        try:
            served = all(getattr(shards_mod, n) is SERVED_AS[n] for n in names)
            totals["install_checks"] += 1
            if not served:
                totals["mismatches"].append(f"install(hyper_comm_grid={hyper_comm_grid}) left Megatron's functions")
            import megatron.core.parallel_state as served_ps

            for rank in (0, 5):
                init_simulated_rank(rank, world, replace=True)
                served_ps.initialize_model_parallel(create_gloo_process_groups=False, **init)
                try:
                    got = _snapshot(shards_mod.build_inference_pg_collection(**kwargs))
                finally:
                    served_ps.destroy_model_parallel()
                totals["install_checks"] += 1
                if got != references[("single", DEFAULTS_INDEX, rank)]:
                    totals["mismatches"].append(
                        f"installed, rank {rank}: {got} vs megatron {references[('single', DEFAULTS_INDEX, rank)]}"
                    )
        finally:
            compat.uninstall()
        restored = all(getattr(shards_mod, n) is originals[n] for n in names) and shards_mod.mpu is ps
        totals["install_checks"] += 1
        if not restored:
            totals["mismatches"].append(f"uninstall after install(hyper_comm_grid={hyper_comm_grid}) did not restore")


def _check_install_before_import(totals: dict[str, Any]) -> Any:
    """Installed before the shards module is first imported: the import gets ours, uninstall Megatron's."""
    import megatron.core.parallel_state  # noqa: F401  (loaded, as Megatron's __init__ would)

    import compat
    from parallel_state_ng.builders.inference import SERVED_AS

    assert "megatron.core.inference.shards" not in sys.modules
    compat.install()
    try:
        ps, shards_mod = _bind()
        ok = all(getattr(shards_mod, n) is f for n, f in SERVED_AS.items())
    finally:
        compat.uninstall()
    ps, shards_mod = _bind()
    ok = ok and all(getattr(shards_mod, n).__module__ == shards_mod.__name__ for n in SERVED_AS)
    totals["install_checks"] += 1
    if not ok:
        totals["mismatches"].append("install before the shards module's import: not served, or not restored")
    return shards_mod


def _without_classes(view: list[Any]) -> list[Any]:
    """A shard view without its class names (Megatron's spec class and the stand-in's compare by fields)."""
    return [{k: v for k, v in entry.items() if k not in ("class", "spec")} for entry in view]


def _check_stand_in(references: dict[tuple[str, int, int], Any], totals: dict[str, Any]) -> None:
    """Without Megatron's parser (the stand-in spec and shard classes): the same shards and groups."""
    from parallel_state_ng.builders import inference

    megatron_module = inference._megatron_module
    inference._megatron_module = lambda name: None  # type: ignore[assignment]
    try:
        for kind, index, rank in [key for key in references if key[0] == "shards"]:
            total, spec, mapping, objects = SHARDS[index]
            if objects:
                continue
            init_simulated_rank(rank, total, replace=True)
            ours = inference.build_inference_collections_for_shards(total, spec, mapping)
            totals["stand_in_pairs"] += 1
            if any(type(s) is not inference.InferenceShard for s in ours):
                totals["mismatches"].append(f"stand-in {index} rank {rank}: not the stand-in's shards")
            theirs, got = _without_classes(references[(kind, index, rank)]), _without_classes(_shards_view(ours))
            if got != theirs:
                totals["mismatches"].append(f"stand-in {index} rank {rank}: megatron {theirs} vs ours {got}")
    finally:
        inference._megatron_module = megatron_module  # type: ignore[assignment]


def _check_split_path(totals: dict[str, Any]) -> None:
    """Every rank of each string-spec shard layout on the split and the member path: same groups, one protocol."""
    from parallel_state_ng.builders import inference
    from tests.support.worlds.split_recorder import check_protocol, compare_paths, play_world

    for total, spec, mapping, objects in SHARDS:
        if objects:
            continue
        calls, results = play_world(
            total, lambda: _shards_view(inference.build_inference_collections_for_shards(total, spec, mapping))
        )
        try:
            totals["splits_per_rank"] = max(totals["splits_per_rank"], check_protocol(calls, total))
        except AssertionError as err:
            totals["mismatches"].append(f"split path, shards {spec!r}: {err}")
        totals["mismatches"] += [f"split path, shards {spec!r}: {line[:600]}" for line in compare_paths(results)]
        totals["split_ranks"] += total


def run() -> dict[str, Any]:
    """Every check above; returns the totals and the mismatches (none expected)."""
    totals: dict[str, Any] = {"mismatches": [], "bad_messages": []}
    for key in ("pairs", "single_pairs", "shards_pairs", "outside_pairs", "fields", "shards_types_same"):
        totals[key] = 0
    for key in ("megatron_calls", "our_calls", "max_our_calls", "max_megatron_calls"):
        totals[key] = 0
    for key in ("bad_cases", "bad_checks", "install_checks", "stand_in_pairs", "split_ranks", "splits_per_rank"):
        totals[key] = 0
    shards_mod = _check_install_before_import(totals)
    ps = sys.modules["megatron.core.parallel_state"]
    references = _compare_table(ps, shards_mod, totals)
    _compare_bad(shards_mod, totals)
    _check_install(shards_mod, ps, references, totals)
    _check_stand_in(references, totals)
    _check_split_path(totals)
    if dist.is_initialized():
        dist.destroy_process_group()
    return totals
