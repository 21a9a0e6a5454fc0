"""Carrying out a rank's group plan: the process groups of one Megatron layout on this rank.

:func:`create_model_groups` executes :func:`parallel_state_ng.layout.plan.group_plan` (only this
rank's groups, member-named, in the release's creation order, atomic); its
:class:`ModelParallelGroups` touches no module global. :func:`global_values` says what every
Megatron module global would hold for one; compat and
:class:`~parallel_state_ng.builders.collection.MegatronGroups` read it. See docs/architecture.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from parallel_state_ng.groups.creation import creation_round, destroy_groups, sync_world
from parallel_state_ng.groups.factory import GroupFactory
from parallel_state_ng.groups.handles import GroupHandle
from parallel_state_ng.groups.liveness import CreationContext, InitWatch
from parallel_state_ng.groups.nccl_config import LEGACY_NCCL_DEFAULTS
from parallel_state_ng.groups.registry import Lease
from parallel_state_ng.groups.split import CreationPath
from parallel_state_ng.layout.kinds import GROUP_KINDS, Fill, fills
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.plan import (
    PlanOptions,
    SetCollnet,
    SharpBarrier,
    SplitOut,
    Step,
    group_plan,
)

__all__ = [
    "ModelParallelGroups",
    "create_model_groups",
    "add_group",
    "destroy_model_groups",
    "global_values",
    "nccl_options_from_config",
]


@dataclass
class ModelParallelGroups:
    """Every group and rank list one layout's plan produced for this rank.

    ``groups`` and ``ranks`` are keyed by group kind (see
    :data:`parallel_state_ng.layout.kinds.GROUP_KINDS`; gloo companions end in ``_gloo``).
    A kind whose key is missing from ``groups`` was not built (option off, or the rank is in
    no group of that kind).
    """

    layout: MegatronLayout
    rank: int
    groups: dict[str, Any] = field(default_factory=dict)
    ranks: dict[str, list[Any]] = field(default_factory=dict)
    hierarchical_cp_groups: list[Any] | None = None
    hybrid_dp_cp_groups: dict[int, Any] = field(default_factory=dict)
    # [None] (the default group) + every group this rank is a member of, in creation order.
    process_group_list: list[Any] = field(default_factory=lambda: [None])
    created: list[Any] = field(default_factory=list)
    handles: dict[str, GroupHandle] = field(default_factory=dict)
    #: How the groups were made (:mod:`parallel_state_ng.groups.split`); groups made on request
    #: later follow it.
    creation_path: CreationPath = "member"
    #: This layout's hold on the process-wide communicator registry (``PSNG_SHARE_GROUPS=process``):
    #: its groups made now and on request later; given back once by the destroy.
    lease: Lease = field(default_factory=Lease, repr=False, compare=False)

    def keep(self, key: str, ranks: list[int], group: Any, several: str = "last") -> None:
        """Record ``group`` (members ``ranks``) under ``key``.

        A rank in several groups of one kind (a 0.12/0.13 encoder rank in several pipelines)
        keeps them all in lists with ``several="list"``, else the last one (as MCore does).
        """
        if several == "list" and key in self.groups:
            if not isinstance(self.groups[key], list):
                self.groups[key], self.ranks[key] = [self.groups[key]], [self.ranks[key]]
            self.groups[key].append(group)
            self.ranks[key].append(ranks)
            return
        self.groups[key] = group
        if not key.endswith("_gloo"):
            self.ranks[key] = ranks

    def group(self, kind: str) -> Any:
        """The group of ``kind`` or ``None``."""
        return self.groups.get(kind)

    def handle(self, kind: str) -> GroupHandle:
        """A :class:`~parallel_state_ng.groups.handles.GroupHandle` for this rank's group of ``kind``.

        Ranks are in MCore's order for the kind (e.g. pipeline stages for ``"pp"``); the
        gloo twin, when one was created (``dp``, ``dp_cp``, ``ep_dp``, ...), is the handle's
        CPU group. Handles are cached; a handle-created CPU group is destroyed with the groups.

        Raises:
            KeyError: this rank has no group of ``kind`` (unknown kind, option off, or e.g.
                not an embedding stage).
        """
        handle = self.handles.get(kind)
        if handle is None:
            group = self.groups.get(kind)
            if group is None or kind not in self.ranks:
                raise KeyError(f"rank {self.rank} has no group of kind {kind!r}; its groups: {sorted(self.ranks)}")
            if isinstance(group, list):
                raise KeyError(
                    f"rank {self.rank} is in several {kind!r} groups (a 0.12/0.13 encoder rank in several "
                    f"pipelines: {self.ranks[kind]}); a handle needs one group"
                )
            handle = self.handles[kind] = GroupHandle(
                self.ranks[kind], group, self.groups.get(f"{kind}_gloo"), rank=self.rank, name=kind
            )
        return handle


def destroy_model_groups(state: ModelParallelGroups) -> int:
    """Destroy every group ``state`` created, its handles' CPU groups included; the count destroyed.

    A group another live layout still holds through the process-wide registry stays (it is
    counted by the destroy that frees it); a second call destroys nothing.
    """
    for handle in state.handles.values():
        handle.destroy()
    state.handles.clear()
    return destroy_groups(state.created, lease=state.lease)


def nccl_options_from_config(pg_name: str, nccl_comm_cfgs: dict[str, Any], *, legacy_defaults: bool = False) -> Any:
    """NCCL options for group ``pg_name`` from a parsed communicator config, or ``None``.

    Recognised keys per group: ``is_high_priority_stream``, ``cga_cluster_size``, ``max_ctas``,
    ``min_ctas`` and ``net_name`` (``IB`` or ``socket``, else ``RuntimeError``), as MCore reads
    its ``nccl_communicator_config_path`` file. ``legacy_defaults`` reads it as 0.12 does
    (release fact ``nccl_config_defaults``): ``cga_cluster_size`` 4, ``max_ctas`` 32 and
    ``min_ctas`` 1 where the group leaves them out, ``is_high_priority_stream`` ignored.
    """
    if pg_name not in nccl_comm_cfgs:
        return None
    cfg = nccl_comm_cfgs[pg_name]
    # Any: torch's stub of NCCLConfig (options.config) lacks net_name
    options: Any
    if legacy_defaults:
        options = torch.distributed.ProcessGroupNCCL.Options()
        cfg = {**LEGACY_NCCL_DEFAULTS, **cfg}
    else:
        options = torch.distributed.ProcessGroupNCCL.Options(
            is_high_priority_stream=cfg.get("is_high_priority_stream", False)
        )
    for key in ("cga_cluster_size", "max_ctas", "min_ctas", "net_name"):
        if key in cfg:
            setattr(options.config, key, cfg[key])
    if "net_name" in cfg and options.config.net_name.lower() not in ("ib", "socket"):
        raise RuntimeError(
            f"net_name ({options.config.net_name}) of group {pg_name!r} is not supported; use 'IB' or 'socket'"
        )
    return options


class _Creator:
    """The plan executor's side of one build: the build's factory, and the groups it listed.

    Every group comes from the build's :class:`~parallel_state_ng.groups.factory.GroupFactory`;
    a group new to the build is listed once in ``state.created`` (rollback, destroy) and in
    ``state.process_group_list`` (``update_pg_timeout``), a shared answer is not.
    """

    def __init__(self, state: ModelParallelGroups, timeout: timedelta, context: CreationContext | None = None) -> None:
        self.state = state
        self.timeout = timeout
        if context is None:  # one group made on request: its own context, in the current world
            sync_world()
            context = CreationContext.current()
        self.factory = GroupFactory(path=state.creation_path, lease=state.lease, context=context)

    def make(
        self,
        ranks: list[int] | None,
        desc: str,
        *,
        backend: str | None = None,
        pg_options: Any = None,
        timeout: Any = "default",
    ) -> Any:
        """This rank's group of one plan step (``ranks=None``: none; on the split path it joins the split)."""
        pg, new = self.factory.group(
            ranks,
            backend=backend,
            pg_options=pg_options,
            timeout=self.timeout if timeout == "default" else timeout,
            group_desc=desc,
        )
        if new:  # a shared group is listed (and destroyed) once
            self.state.created.append(pg)
            self.state.process_group_list.append(pg)
        return pg


def create_model_groups(
    layout: MegatronLayout,
    rank: int,
    *,
    timeout: timedelta,
    nccl_options: Callable[[str], Any],
    options: PlanOptions,
    name: str = "create_model_groups",
    path: CreationPath = "member",
) -> ModelParallelGroups:
    """Create ``rank``'s groups for ``layout`` and ``options``; atomic.

    If anything fails, every group created so far is destroyed before the error propagates.

    ``nccl_options(key)`` gives the ``pg_options`` of a group whose kind has NCCL-config key
    ``key``; ``timeout`` is the timeout of the groups whose rule is ``"init"``. ``name`` (the
    caller's function) appears in errors. Every rank of the layout ends with one closing
    round (:class:`~parallel_state_ng.groups.liveness.InitWatch`): if any of them died, stopped
    or failed while creating its groups, every survivor raises
    :class:`~parallel_state_ng.groups.liveness.RankFailureError` within the failure bound and
    rolls back.

    ``path="split"`` (a world that splits, :mod:`parallel_state_ng.groups.split`): every rank of
    the world calls it, outside the layout too, and makes one split per group kind made by
    splitting; the closing round then covers the whole world.
    """
    state = ModelParallelGroups(layout=layout, rank=rank, creation_path=path)
    sync_world()
    creator = _Creator(state, timeout, CreationContext.current())
    if path == "split":
        participants: Sequence[int] = range(dist.get_world_size())
    else:
        participants = range(layout.rank_offset, layout.rank_offset + layout.layout_world_size)
    watch = InitWatch(name, participants if rank in participants else [rank])
    try:
        # The closing round (watch.finish) covers early destroys: no readiness marks needed.
        with creation_round(watch.active):
            for index, step in enumerate(group_plan(layout, rank, options, every_split=path == "split")):
                if not isinstance(step, SetCollnet):
                    watch.step = f"step {index + 1} of its group plan ({getattr(step, 'key', 'SHARP barrier')!r})"
                _execute(step, state, creator, nccl_options)
        watch.finish()
    except BaseException as exc:
        error = watch.fail(exc)
        creator.factory.destroy(state.created)
        if error is exc:
            raise
        raise error from exc
    return state


def add_group(
    state: ModelParallelGroups, ranks: list[int] | None, desc: str, *, timeout: Any, pg_options: Any = None
) -> Any:
    """Create one more group over ``ranks`` for ``state`` (destroyed with it): the groups made on request after init.

    On the split path every rank of the world calls it; a rank in no group of the kind passes
    ``ranks=None`` and gets ``None``. On the member path only members call it.
    """
    return _Creator(state, timeout).make(ranks, desc, pg_options=pg_options)


def _execute(step: Step, state: ModelParallelGroups, creator: _Creator, nccl_options: Callable[[str], Any]) -> None:
    """Carry out one plan step on this rank."""
    if isinstance(step, SetCollnet):
        os.environ["NCCL_COLLNET_ENABLE"] = step.value
        return
    if isinstance(step, SharpBarrier):
        _sharp_barrier(state.groups[step.key], step.legacy)
        return
    if isinstance(step, SplitOut):
        creator.make(
            None,
            step.desc,
            pg_options=None if step.nccl_key is None else nccl_options(step.nccl_key),
            timeout="default" if step.timeout == "init" else None,
        )
        return
    group = creator.make(
        step.ranks,
        step.desc,
        backend=step.backend,
        pg_options=None if step.nccl_key is None else nccl_options(step.nccl_key),
        timeout="default" if step.timeout == "init" else None,
    )
    if step.kind == "hybrid_dp_cp":
        state.hybrid_dp_cp_groups[step.slot] = group  # type: ignore[index]
        return
    if step.kind == "hcp":
        if state.hierarchical_cp_groups is None:
            state.hierarchical_cp_groups = []
        state.hierarchical_cp_groups.append(group)
    state.keep(step.key, step.ranks, group, several=GROUP_KINDS[step.kind].several)


def _sharp_barrier(group: Any, legacy: bool) -> None:
    """Force the lazily created communicator into existence so SHARP applies to it.

    ``legacy`` (0.12–0.13): no CUDA synchronize, and NCCL_COLLNET_ENABLE is set to "0" after it
    (later releases remove the variable).
    """
    dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    if legacy:
        os.environ["NCCL_COLLNET_ENABLE"] = "0"
        return
    torch.cuda.synchronize()
    os.environ.pop("NCCL_COLLNET_ENABLE", None)


_UNBUILT = object()


def _fill_value(state: ModelParallelGroups, kind: str, fill: Fill) -> Any:
    """What ``fill`` holds for ``state`` (``_UNBUILT`` when the rank did not build ``kind``)."""
    if fill.value == "levels":
        return state.hierarchical_cp_groups
    if fill.value == "by_size":
        return dict(state.hybrid_dp_cp_groups)
    key = f"{kind}_gloo" if fill.value == "gloo" else kind
    table = state.ranks if fill.value == "ranks" else state.groups
    return table[key] if key in table else _UNBUILT


def global_values(state: ModelParallelGroups | None, initial: dict[str, Any]) -> dict[str, Any]:
    """Every Megatron module global's value for ``state`` (``None``: the import-time values ``initial``).

    Each global of the group-kind table takes its kind's group, rank list or gloo twin; for a
    kind this rank did not build it takes the value of the global it falls back to (MCore's
    aliases), else ``None``. The hierarchical context-parallel list keeps its value in
    ``initial`` when no hierarchy is configured.
    """
    values = dict(initial)
    if state is None:
        return values
    fallbacks: dict[str, str] = {}
    for kind, fill in fills():
        value = _fill_value(state, kind.name, fill)
        if value is None and fill.value == "levels":
            continue
        if value is _UNBUILT and fill.fallback is not None:
            fallbacks[fill.name] = fill.fallback
        else:
            values[fill.name] = None if value is _UNBUILT else value

    # A loop, not a recursive closure: a closure that refers to itself is a reference cycle,
    # which would keep ``values`` (and every group in it) alive until the garbage collector
    # runs, and a gloo group freed then blocks whatever this rank is doing at that moment.
    for name in fallbacks:
        target = name
        while target in fallbacks:
            target = fallbacks[target]
        values[name] = values.get(target)
    # 0.12-0.13: the first decoder stage of a pipeline that starts with an encoder
    values["_PIPELINE_MODEL_PARALLEL_DECODER_START"] = state.layout.encoder_pipeline_model_parallel_size or None
    values["_global_process_group_list"] = state.process_group_list
    return values
