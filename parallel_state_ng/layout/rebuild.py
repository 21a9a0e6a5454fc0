"""Rebuilding a Megatron layout over the ranks that survived a failure (pure math).

:func:`plan_rebuild` gives the new world (survivors renumbered, the data-parallel size shrunk
to the complete model replicas that survived, or kept with spares) and where each new rank's
state is, vectorized over ranks with torch integer tensors. See docs/reliability.md
("Rebuild over the survivors").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.named_layout import Layout

__all__ = ["RebuildError", "RebuildPlan", "plan_rebuild"]


class RebuildError(ValueError):
    """The layout cannot be rebuilt over the survivors (the message says why, with the ranks)."""


@dataclass(frozen=True)
class RebuildPlan:
    """The new world and layout after a failure (docs/reliability.md: "Rebuild over the survivors").

    Attributes:
        old_world_size: ranks of the old job.
        failed: the old ranks that died (sorted).
        world_size: ranks of the new job (the new default group).
        new_rank: old rank -> new rank (``-1``: dead, or left out of the new world).
        source: new rank -> the old rank whose state it needs (``-1``: a spare outside the layout).
        replica: new rank -> the old data-parallel index of ``source`` (``-1`` for spares).
        layout_world_size: ranks the new layout covers, from new rank 0.
        data_parallel_size: the new data-parallel size.
        unit_size: data-parallel indices per replica unit.
        kept_units: old replica units kept, in new order (``shrink``), or the unit the
            spares copy from (``keep_data_parallel``).
        initialize_kwargs: ``initialize_model_parallel`` arguments of the new layout
            (``local_world_size`` only when spares stay in the new world); ``build_kwargs``
            are the same for ``build_megatron_groups``.
    """

    old_world_size: int
    failed: tuple[int, ...]
    world_size: int
    new_rank: torch.Tensor
    source: torch.Tensor
    replica: torch.Tensor
    layout_world_size: int
    data_parallel_size: int
    unit_size: int
    kept_units: tuple[int, ...]
    initialize_kwargs: dict[str, Any]

    @property
    def build_kwargs(self) -> dict[str, Any]:
        """:func:`~parallel_state_ng.build_megatron_groups` arguments of the new layout.

        ``initialize_kwargs`` with ``local_world_size`` (spares kept after the layout) given as
        the module's ``world_size``.
        """
        kwargs = dict(self.initialize_kwargs)
        if "local_world_size" in kwargs:
            kwargs["world_size"] = kwargs.pop("local_world_size")
        return kwargs

    def new_rank_of(self, old_rank: int) -> int | None:
        """The new rank of ``old_rank`` (``None``: dead, or not in the new world)."""
        value = int(self.new_rank[old_rank])
        return None if value < 0 else value

    def source_of(self, new_rank: int) -> int | None:
        """The old rank holding the state ``new_rank`` needs (``None`` for a spare)."""
        value = int(self.source[new_rank])
        return None if value < 0 else value

    def moves(self) -> int:
        """How many new ranks need state from another process (0 in ``shrink`` mode)."""
        inside = torch.arange(self.layout_world_size)
        old_of_new = torch.full((self.world_size,), -1, dtype=torch.int64)
        alive = self.new_rank >= 0
        old_of_new[self.new_rank[alive]] = torch.nonzero(alive).flatten()
        return int((self.source[inside] != old_of_new[inside]).sum())


def _coords(layout: Layout, local: torch.Tensor) -> dict[str, torch.Tensor]:
    """Coordinates of local indices (0-based in the layout) per dim, first dim fastest."""
    out: dict[str, torch.Tensor] = {}
    stride = 1
    for name, size in zip(layout.dim_names, layout.shape, strict=True):
        out[name] = (local // stride) % size
        stride *= size
    return out


def _local(layout: Layout, coords: dict[str, torch.Tensor], sizes: dict[str, int]) -> torch.Tensor:
    """Local index of ``coords`` in a layout with ``layout``'s dims and ``sizes``."""
    index = torch.zeros_like(next(iter(coords.values())))
    stride = 1
    for name in layout.dim_names:
        index += coords[name] * stride
        stride *= sizes[name]
    return index


def _unit_size(layout: MegatronLayout, local: torch.Tensor, dense: dict[str, torch.Tensor]) -> int:
    """Smallest divisor u of dp such that a rank's expert shard depends on dp only through dp mod u."""
    dp = layout.data_parallel_size
    expert = _coords(layout.expert, local)
    shard = expert["tp"] + layout.expert.size_of("tp") * (expert["ep"] + layout.expert.size_of("ep") * expert["pp"])
    sizes = {n: layout.decoder.size_of(n) for n in layout.decoder.dim_names}
    for u in (d for d in range(1, dp + 1) if dp % d == 0):
        twin = _local(layout.decoder, {**dense, "dp": dense["dp"] % u}, sizes)
        if bool((shard[twin] == shard).all()):
            return u
    return dp  # unreachable: u = dp maps every rank to itself


def _refuse_unsupported(layout: MegatronLayout) -> None:
    if getattr(layout, "encoder_block", None) is not None:
        raise RebuildError("plan_rebuild does not cover layouts with an encoder block (megatron-core 0.12/0.13)")
    if layout.gtp_remat_size != 1 or layout.expert_gtp_remat_size != 1:
        raise RebuildError(
            f"plan_rebuild does not cover GTP weight rematerialization (gtp_remat_size={layout.gtp_remat_size}, "
            f"expert_gtp_remat_size={layout.expert_gtp_remat_size})"
        )


def _kwargs(layout: MegatronLayout, dp: int, local_world_size: int | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "tensor_model_parallel_size": layout.tensor_model_parallel_size,
        "pipeline_model_parallel_size": layout.pipeline_model_parallel_size,
        "context_parallel_size": layout.context_parallel_size,
        "expert_model_parallel_size": layout.expert_model_parallel_size,
        "expert_tensor_parallel_size": layout.expert_tensor_parallel_size,
        "order": layout.order,
        "num_distributed_optimizer_instances": layout.num_distributed_optimizer_instances,
    }
    if layout.hierarchical_context_parallel_sizes is not None:
        kwargs["hierarchical_context_parallel_sizes"] = list(layout.hierarchical_context_parallel_sizes)
    if local_world_size is not None:
        kwargs["local_world_size"] = local_world_size
    return kwargs


def plan_rebuild(
    layout: MegatronLayout,
    failed: Iterable[int],
    *,
    keep_data_parallel: bool = False,
    keep_spares: bool = True,
) -> RebuildPlan:
    """Plan the layout over the survivors of ``layout``'s job after ``failed`` ranks died.

    Args:
        layout: the old layout (its ``world_size`` is the old job's).
        failed: old ranks that died (in or outside the layout).
        keep_data_parallel: keep the data-parallel size by moving spare ranks (survivors
            outside the old layout) into the dead ranks' places; otherwise shrink it to the
            complete replicas that survived.
        keep_spares: survivors outside the new layout stay in the new world, after it (the
            new layout is then a ``local_world_size`` sub-world, 0.17+); else they leave.

    Raises:
        RebuildError: no complete replica survives (every replica lost a member of some
            tp/cp/pp slice); the distributed-optimizer instances do not divide the new
            data-parallel size; an encoder block (0.12/0.13) or a GTP axis (0.19); not
            enough spares to keep the data-parallel size.
    """
    _refuse_unsupported(layout)
    world, start, size = layout.world_size, layout.rank_offset, layout.layout_world_size
    dead = sorted({int(r) for r in failed})
    bad = [r for r in dead if not 0 <= r < world]
    if bad:
        raise RebuildError(f"failed ranks {bad[:16]} are outside the old world of {world} ranks")
    alive = torch.ones(world, dtype=torch.bool)
    alive[torch.tensor(dead, dtype=torch.int64)] = False
    local = torch.arange(size, dtype=torch.int64)
    dense = _coords(layout.decoder, local)
    unit = _unit_size(layout, local, dense)
    dp = layout.data_parallel_size
    units = dp // unit
    unit_of = dense["dp"] // unit
    lost = torch.zeros(units, dtype=torch.bool)
    lost[unit_of[~alive[start : start + size]]] = True
    intact = torch.nonzero(~lost).flatten()
    if len(intact) == 0:
        raise RebuildError(
            f"no complete model replica survives: failed ranks {dead[:16]}{' ...' if len(dead) > 16 else ''} "
            f"hit every one of the {units} data-parallel replica unit(s) of {unit} replica(s) "
            f"(tp={layout.tensor_model_parallel_size}, cp={layout.context_parallel_size}, "
            f"pp={layout.pipeline_model_parallel_size}, ep={layout.expert_model_parallel_size}, dp={dp})"
        )
    if keep_data_parallel:
        return _keep(layout, dead, alive, dense, unit, int(intact[0]), keep_spares)
    return _shrink(layout, dead, alive, dense, unit, unit_of, intact, keep_spares)


def _spare_ranks(alive: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    """Old ranks alive and not placed in the new layout, in old order."""
    return torch.nonzero(alive & ~taken).flatten()


def _finish(
    layout: MegatronLayout,
    dead: list[int],
    alive: torch.Tensor,
    placed_old: torch.Tensor,
    source: torch.Tensor,
    data_parallel: int,
    unit: int,
    kept: tuple[int, ...],
    keep_spares: bool,
) -> RebuildPlan:
    """Number the placed ranks 0.., then the spares; fill the per-new-rank tables."""
    world = layout.world_size
    taken = torch.zeros(world, dtype=torch.bool)
    taken[placed_old] = True
    spares = _spare_ranks(alive, taken) if keep_spares else torch.empty(0, dtype=torch.int64)
    inside = len(placed_old)
    new_world = inside + len(spares)
    new_rank = torch.full((world,), -1, dtype=torch.int64)
    new_rank[placed_old] = torch.arange(inside)
    new_rank[spares] = torch.arange(inside, new_world)
    full_source = torch.full((new_world,), -1, dtype=torch.int64)
    full_source[:inside] = source
    replica = torch.full((new_world,), -1, dtype=torch.int64)
    replica[:inside] = _coords(layout.decoder, source - layout.rank_offset)["dp"]
    n = layout.num_distributed_optimizer_instances
    if data_parallel % n:
        raise RebuildError(
            f"num_distributed_optimizer_instances={n} does not divide the new data-parallel size {data_parallel}"
        )
    return RebuildPlan(
        old_world_size=world,
        failed=tuple(dead),
        world_size=new_world,
        new_rank=new_rank,
        source=full_source,
        replica=replica,
        layout_world_size=inside,
        data_parallel_size=data_parallel,
        unit_size=unit,
        kept_units=kept,
        initialize_kwargs=_kwargs(layout, data_parallel, inside if new_world != inside else None),
    )


def _shrink(
    layout: MegatronLayout,
    dead: list[int],
    alive: torch.Tensor,
    dense: dict[str, torch.Tensor],
    unit: int,
    unit_of: torch.Tensor,
    intact: torch.Tensor,
    keep_spares: bool,
) -> RebuildPlan:
    """Keep the complete units, renumbered in order; every kept rank keeps its own state."""
    new_unit = torch.full((int(unit_of.max()) + 1,), -1, dtype=torch.int64)
    new_unit[intact] = torch.arange(len(intact))
    keep = new_unit[unit_of] >= 0
    dp_new = len(intact) * unit
    sizes = {n: layout.decoder.size_of(n) for n in layout.decoder.dim_names}
    sizes["dp"] = dp_new
    coords = {name: value[keep] for name, value in dense.items()}
    coords["dp"] = new_unit[unit_of[keep]] * unit + coords["dp"] % unit
    position = _local(layout.decoder, coords, sizes)
    old = torch.nonzero(keep).flatten() + layout.rank_offset
    placed_old = torch.empty_like(old)
    placed_old[position] = old
    return _finish(
        layout, dead, alive, placed_old, placed_old.clone(), dp_new, unit, tuple(intact.tolist()), keep_spares
    )


def _keep(
    layout: MegatronLayout,
    dead: list[int],
    alive: torch.Tensor,
    dense: dict[str, torch.Tensor],
    unit: int,
    donor: int,
    keep_spares: bool,
) -> RebuildPlan:
    """Keep every position; spares take the dead ranks' places and copy the donor unit's state."""
    start, size = layout.rank_offset, layout.layout_world_size
    in_layout = torch.arange(start, start + size)
    holes = torch.nonzero(~alive[in_layout]).flatten()
    outside = alive.clone()
    outside[in_layout] = False
    spares = torch.nonzero(outside).flatten()
    if len(spares) < len(holes):
        raise RebuildError(
            f"keep_data_parallel needs {len(holes)} spare rank(s) for the dead ranks of the layout, "
            f"only {len(spares)} survivor(s) lie outside it (ranks {start}..{start + size - 1} are the layout)"
        )
    placed_old = in_layout.clone()
    placed_old[holes] = spares[: len(holes)]
    sizes = {n: layout.decoder.size_of(n) for n in layout.decoder.dim_names}
    twin = _local(layout.decoder, {**dense, "dp": donor * unit + dense["dp"] % unit}, sizes) + start
    source = in_layout.clone()
    source[holes] = twin[holes]
    return _finish(layout, dead, alive, placed_old, source, layout.data_parallel_size, unit, (donor,), keep_spares)
