"""The stated side of :func:`~parallel_state_ng.builders.verify.verify_groups`: what MCore gives one rank.

:func:`stated_layout` makes the :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout`
of the stated arguments (:func:`check_config` rejects unknown ones), :func:`expected_globals`
every Megatron global's value on one rank as member tuples (from its group plan: O(its own
groups), never a loop over the world), and :func:`fit_hint` says which layout a wrong group
fits (another kind of this layout, or this kind under a nearby order). Pure: no collective,
no group.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any

from parallel_state_ng.groups.megatron_groups import ModelParallelGroups, global_values
from parallel_state_ng.layout.kinds import GROUP_KINDS
from parallel_state_ng.layout.megatron_layout import SHAPE_ARGUMENTS, MegatronLayout
from parallel_state_ng.layout.plan import CreateGroup, PlanOptions, group_plan
from parallel_state_ng.releases import Release
from parallel_state_ng.releases import parallel_state as api

__all__ = ["stated_layout", "check_config", "expected_globals", "fit_hint"]

#: Layout arguments besides SHAPE_ARGUMENTS: 0.12/0.13's encoder block ...
_LAYOUT_EXTRAS = (
    "encoder_tensor_model_parallel_size",
    "encoder_pipeline_model_parallel_size",
    "pipeline_model_parallel_split_rank",
)
#: ... and the layout's rank range (``world_size``: build_megatron_groups' name for its ranks).
_RANGE_ARGUMENTS = ("rank_offset", "world_size", "local_world_size", "create_embedding_groups")


def stated_layout(config: Mapping[str, Any], release: Release, world: int, **override: Any) -> MegatronLayout:
    """The :class:`MegatronLayout` of ``config`` (``override``: e.g. another ``order``)."""
    args = {k: config[k] for k in (*SHAPE_ARGUMENTS, *_LAYOUT_EXTRAS) if k in config}
    args.update(override)
    sizes = [config[k] for k in ("world_size", "local_world_size") if config.get(k) is not None]
    if len(set(sizes)) > 1:
        raise ValueError(f"world_size ({sizes[0]}) and local_world_size ({sizes[1]}) are both stated and differ")
    offset, local = config.get("rank_offset", 0), (sizes or [None])[0]
    if offset or (local is not None and local != world):
        return MegatronLayout(
            world_size=world, rank_offset=offset, local_world_size=local, release=release.series, **args
        )
    return MegatronLayout(world_size=world, release=release.series, **args)


def check_config(config: Mapping[str, Any], release: Release) -> None:
    """Raise ``TypeError`` naming every argument of ``config`` that ``release`` does not take."""
    accepted = set(SHAPE_ARGUMENTS) | set(_RANGE_ARGUMENTS) | set(_LAYOUT_EXTRAS)
    accepted |= {name for name, _ in api.signature("initialize_model_parallel", release) or ()}
    unknown = sorted(set(config) - accepted)
    if unknown:
        raise TypeError(
            f"verify_groups got unknown configuration argument(s) {unknown}; it takes megatron-core "
            f"{release.series}'s initialize_model_parallel arguments, rank_offset and world_size"
        )


def expected_globals(layout: MegatronLayout, rank: int, config: Mapping[str, Any]) -> dict[str, Any]:
    """Every Megatron global's value on ``rank`` for ``layout``, groups as member tuples (O(own groups))."""
    options = PlanOptions(
        create_gloo_process_groups=True,
        create_all_gather_group=bool(config.get("create_all_gather_group", False)),
        embedding_groups=bool(config.get("create_embedding_groups", True)),
    )
    state = ModelParallelGroups(layout=layout, rank=rank)
    for step in group_plan(layout, rank, options):
        if not isinstance(step, CreateGroup) or step.kind == "hybrid_dp_cp":
            continue
        members = tuple(step.ranks)
        if step.kind == "hcp":
            state.hierarchical_cp_groups = [*(state.hierarchical_cp_groups or []), members]
        state.keep(step.key, list(step.ranks), members, several=GROUP_KINDS[step.kind].several)
    return global_values(state, {})


def _group_or_none(layout: MegatronLayout, kind: str, rank: int) -> list[int] | None:
    try:
        return layout.group(kind, rank)
    except KeyError:
        return None


def _nearby_orders(layout: MegatronLayout) -> list[str]:
    """Other orders that move only dims of size > 1, the fewest moved first (at most 5! of them)."""
    sizes = {
        "tp": layout.tensor_model_parallel_size,
        "cp": layout.context_parallel_size,
        "ep": layout.expert_model_parallel_size,
        "dp": layout.data_parallel_size,
        "pp": layout.pipeline_model_parallel_size,
    }
    tokens = layout.order.split("-")
    places = [i for i, t in enumerate(tokens) if sizes.get(t, 2) > 1]
    found = []
    for perm in itertools.permutations([tokens[i] for i in places]):
        order = list(tokens)
        for i, token in zip(places, perm, strict=True):
            order[i] = token
        moved = sum(a != b for a, b in zip(order, tokens, strict=True))
        if moved:
            found.append((moved, "-".join(order)))
    return [order for _, order in sorted(found)]


def _fewest_dims(kind: str) -> tuple[int, int]:
    """Sort key: kinds read off a rank-generator token first, those over fewer dims first."""
    dims = GROUP_KINDS[kind].dims if kind in GROUP_KINDS else ()
    return (0 if dims else 1, len(dims))


def fit_hint(layout: MegatronLayout, other: Callable[[str], MegatronLayout | None], rank: int) -> Callable:
    """``hint(kind, members)``: which group of which layout ``members`` is, where cheap to tell."""

    def hint(kind: str, members: tuple[int, ...]) -> str:
        want, notes = sorted(members), []
        same = [k for k in layout.kinds() if k != kind and sorted(_group_or_none(layout, k, rank) or ()) == want]
        if same:  # the kind over the fewest dims (dp before dp_cp when cp is 1; pp before embd)
            name = min(same, key=_fewest_dims)
            notes.append(f"this layout's {name!r} group")
        for order in _nearby_orders(layout):
            alt = other(order)
            if alt is not None and sorted(_group_or_none(alt, kind, rank) or ()) == want:
                notes.append(f"the {kind!r} group under order={order!r}")
                break
        if not notes:
            return "it fits neither another kind of this layout nor this kind under another order"
        return "that is " + " and ".join(notes)

    return hint
