"""Multi-module topologies in one call: every module's grid, groups and ProcessGroupCollection.

:func:`build_topology` validates a list of
:class:`~parallel_state_ng.layout.topology_spec.ModuleSpec` as a whole, then builds each module
the rank belongs to (its own groups only) with a :class:`~parallel_state_ng.builders.grid.HyperCommGrid`
for Megatron's multi-module code; one :meth:`Topology.destroy` frees everything, a failure leaves
nothing. See docs/engine.md ("Multi-module topologies in one call").
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from parallel_state_ng.builders.collection import MegatronGroups, NoCollectionError, build_megatron_groups
from parallel_state_ng.builders.grid import HyperCommGrid
from parallel_state_ng.groups.creation import sync_world
from parallel_state_ng.groups.liveness import InitWatch
from parallel_state_ng.groups.pipeline import agree, check_nvlink_domains
from parallel_state_ng.layout.kinds import kind_exists, token_kind_dims
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.order import GTP_TOKEN
from parallel_state_ng.layout.topology_spec import ModulePlacement, ModuleSpec, validate_topology
from parallel_state_ng.releases import Release, as_release

__all__ = ["Topology", "build_topology", "EXPERT_VIEW", "module_grid_dims"]

#: Name of the expert view of every module grid.
EXPERT_VIEW = "expert"
_EXPERT_NAMES = {"tp": "etp", "dp": "edp", GTP_TOKEN: f"e{GTP_TOKEN}"}


def module_grid_dims(layout: MegatronLayout) -> tuple[list[str], list[int], list[str], list[int]]:
    """A module grid's base dims and sizes, then its expert view's (first dim varies fastest).

    The layout's tokens without the ones that are always 1 there (``ep`` in the dense layout,
    ``cp`` in the expert one, a GTP axis of size 1); expert ``tp``/``dp``/GTP are renamed
    ``etp``/``edp``/``egtp_remat`` so that only ``pp`` is shared with the base view.
    """
    dense = [(n, s) for n, s in zip(layout.decoder.names, layout.decoder.sizes, strict=True)]
    dense = [(n, s) for n, s in dense if n != "ep" and not (n == GTP_TOKEN and s == 1)]
    expert = [(n, s) for n, s in zip(layout.expert.names, layout.expert.sizes, strict=True)]
    expert = [(_EXPERT_NAMES.get(n, n), s) for n, s in expert if n != "cp" and not (n == GTP_TOKEN and s == 1)]
    return [n for n, _ in dense], [s for _, s in dense], [n for n, _ in expert], [s for _, s in expert]


def _grid_kinds(layout: MegatronLayout, names: list[str], expert_names: list[str]) -> list[tuple[str, list[str], str]]:
    """(kind, grid dims, view) for each token kind of the layout's release that the grid serves."""
    out = []
    for kind, (view, dims) in token_kind_dims(layout.facts.gtp_remat_axis).items():
        if not kind_exists(kind, layout.facts):
            continue
        if view == "expert":
            mapped = [_EXPERT_NAMES.get(d, d) for d in dims]
            mapped = [d for d in mapped if d in expert_names]
        else:
            mapped = [d for d in dims if d in names]
        if mapped:
            out.append((kind, mapped, EXPERT_VIEW if view == "expert" else "base"))
    return out


def _module_grid(placement: ModulePlacement, groups: MegatronGroups) -> HyperCommGrid:
    layout = placement.layout
    names, sizes, expert_names, expert_sizes = module_grid_dims(layout)
    grid = HyperCommGrid(sizes, names, rank_offset=placement.ranks.start)
    grid.register_view(EXPERT_VIEW, expert_sizes, expert_names, shared_dims=["pp"])
    for kind, dims, view in _grid_kinds(layout, names, expert_names):
        where = None if view == "base" else EXPERT_VIEW
        if grid.has_pg(dims, view=where):
            continue  # another kind over the same dims (pp shared by the expert view)
        group = groups.group(kind) if groups.is_member else None
        if groups.is_member and group is None:
            continue  # a kind this configuration does not build (GTP groups at size 1)
        grid.adopt_pg(dims, group, view=where)
    return grid


class Topology:
    """This rank's view of a multi-module job: per module its grid, groups and collection.

    Made by :func:`build_topology`. ``placements`` holds the validated modules (spec, ranks,
    layout, colocated modules), ``language_module`` the language module's name, ``rank`` this
    process's rank and ``release`` the megatron-core release followed.
    """

    def __init__(
        self, placements: list[ModulePlacement], groups: dict[str, MegatronGroups], grids: dict[str, HyperCommGrid]
    ) -> None:
        self.placements = {p.name: p for p in placements}
        self._groups = groups
        self._grids = grids
        self.language_module = next(p.name for p in placements if p.spec.language)
        self.rank = dist.get_rank()
        self.release: Release = as_release(placements[0].layout.release)

    def _placement(self, name: str) -> ModulePlacement:
        if name not in self.placements:
            raise KeyError(f"no module named {name!r} in this topology; modules: {list(self.placements)}")
        return self.placements[name]

    @property
    def modules_of_rank(self) -> list[str]:
        """The modules this rank runs, in spec order."""
        return [name for name, p in self.placements.items() if self.rank in p.ranks]

    def groups(self, name: str) -> MegatronGroups:
        """Module ``name``'s :class:`~parallel_state_ng.builders.collection.MegatronGroups` on this rank."""
        self._placement(name)
        return self._groups[name]

    def grid(self, name: str) -> HyperCommGrid:
        """Module ``name``'s grid (every rank has every module's grid; groups only where it is a member)."""
        self._placement(name)
        return self._grids[name]

    def module_to_grid_map(self) -> dict[str, HyperCommGrid]:
        """Module name -> grid, as Megatron's MiMo code takes it (``RankRole.build``, ``MimoModelConfig``)."""
        return dict(self._grids)

    def collection(self, name: str) -> Any:
        """Module ``name``'s ``ProcessGroupCollection`` (this rank must be one of its ranks)."""
        return self.groups(name).collection()

    def multi_module_collection(self) -> Any:
        """Megatron's ``MultiModuleProcessGroupCollection`` for this rank: the collections of its modules.

        Raises:
            NoCollectionError: the release has no ``MultiModuleProcessGroupCollection`` (before 0.19).
        """
        try:
            module = importlib.import_module("megatron.core.process_groups_config")
        except ImportError as err:
            raise NoCollectionError(f"megatron-core is not importable ({err})") from err
        cls = getattr(module, "MultiModuleProcessGroupCollection", None)
        if cls is None or self.release.before("0.19"):
            raise NoCollectionError(
                f"megatron-core {self.release.series} has no MultiModuleProcessGroupCollection (added in 0.19); "
                f"use Topology.collection(name) per module"
            )
        mine = self.modules_of_rank
        return cls(
            module_pgs={name: self.collection(name) for name in mine},
            language_model_module_name=self.language_module if self.language_module in mine else None,
        )

    def destroy(self) -> int:
        """Destroy every group of every module on this rank; returns how many. Idempotent."""
        total = 0
        for grid in self._grids.values():
            grid.destroy()  # adopted groups are the modules': destroyed below
        for groups in self._groups.values():
            total += groups.destroy()
        return total

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        parts = [f"{n}@{p.ranks.start}..{p.ranks.stop - 1}" for n, p in self.placements.items()]
        return f"Topology({', '.join(parts)}; language={self.language_module!r}; rank {self.rank})"


def _agreement_fields(modules: Sequence[ModuleSpec], series: str) -> dict[str, Any]:
    fields: dict[str, Any] = {"release": series}
    for spec in modules:
        ranks = spec.ranks if isinstance(spec.ranks, range) else range(*spec.ranks)
        fields[f"module {spec.name}"] = {
            "ranks": [ranks.start, ranks.stop],
            "language": spec.language,
            **spec.sizes(),
            **dict(spec.options),
        }
    return fields


def build_topology(
    modules: Sequence[ModuleSpec],
    *,
    release: str | Release | None = None,
    check_agreement_across_ranks: bool | None = None,
    creation_path: str | None = None,
) -> Topology:
    """Validate ``modules`` and build this rank's part of the topology (call it on every rank).

    Args:
        modules: the modules (:class:`~parallel_state_ng.layout.topology_spec.ModuleSpec`); their
            ranges must cover torch.distributed's world exactly, each disjoint from the others
            or identical to them (colocated); exactly one is the language module.
        release: the megatron-core release followed (default: the one compat serves).
        check_agreement_across_ranks: compare the spec across all ranks first (default: on
            unless ``PSNG_AGREEMENT_CHECK=0``), so a rank with another spec makes all raise.
        creation_path: ``"auto"``, ``"member"`` or ``"split"`` (default ``$PSNG_CREATION_PATH``,
            else ``"auto"``), as for :func:`~parallel_state_ng.build_megatron_groups`.

    Raises:
        TopologySpecError: the spec is invalid (names the module and the numbers); nothing created.
        ParallelConfigMismatchError: ranks passed different specs.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_topology needs torch.distributed: call init_process_group() first")
    series = as_release(release).series
    placements = validate_topology(modules, dist.get_world_size(), series)
    # the pipeline's agreement step over the whole spec; each module's own build skips it
    agreed = agree(
        _agreement_fields(modules, series),
        name="build_topology",
        enabled=check_agreement_across_ranks,
        creation=creation_path,
    )
    rank = dist.get_rank()
    check_nvlink_domains(agreed, {p.name: p.layout for p in placements}, name="build_topology", rank=rank)
    built: dict[str, MegatronGroups] = {}
    grids: dict[str, HyperCommGrid] = {}
    sync_world()
    watch = InitWatch("build_topology", range(dist.get_world_size()))  # every rank raises if one failed
    try:
        for p in placements:
            watch.step = f"building module {p.name!r}"
            built[p.name] = build_megatron_groups(
                **p.spec.sizes(),
                **dict(p.spec.options),
                create_embedding_groups=p.spec.language,
                rank_offset=p.ranks.start,
                world_size=len(p.ranks),
                release=series,
                check_agreement_across_ranks=False,
                creation_path=creation_path,
            )
            assert built[p.name].is_member == (rank in p.ranks)
            grids[p.name] = _module_grid(p, built[p.name])
        watch.finish()
    except BaseException as exc:
        error = watch.fail(exc)
        for grid in grids.values():
            grid.destroy()
        for groups in built.values():
            groups.destroy()
        if error is exc:
            raise
        raise error from exc
    return Topology(placements, built, grids)
