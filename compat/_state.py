"""The one state object behind ``compat.parallel_state``.

:func:`build_state` turns a :class:`~parallel_state_ng.mcore.layout.MegatronLayout` into the
process groups of ONE rank: it computes only that rank's groups (closed form, no loop over the
world) and creates each with ``new_group(..., use_local_synchronization=True)`` under a name
that depends only on its members (:mod:`parallel_state_ng.core.naming`), in the creation order of
the layout's release. Steps that only some releases take read as conditions on the layout
(``lay.facts``: the release's layout facts, e.g. the 0.19 GTP axis) or on the release data
(:mod:`parallel_state_ng.mcore.releases.parallel_state`). If anything fails, every group created so
far is destroyed before the error propagates (atomic initialization).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from parallel_state_ng.core.handles import GroupHandle
from parallel_state_ng.mcore.layout import MegatronLayout
from parallel_state_ng.core.naming import destroy_groups
from parallel_state_ng.mcore.releases import parallel_state as api
from parallel_state_ng.core.sharing import GroupPool

__all__ = ["ParallelState", "build_state", "destroy_state", "destroy_groups"]


@dataclass
class ParallelState:
    """Every group and rank list one ``initialize_model_parallel`` produced for this rank.

    ``groups`` and ``ranks`` are keyed by group kind (see
    :data:`parallel_state_ng.mcore.layout.GROUP_KINDS`; gloo companions end in ``_gloo``).
    A kind whose key is missing from ``groups`` was not built (option off, or the rank is in
    no group of that kind).
    """

    layout: MegatronLayout
    rank: int
    groups: dict[str, Any] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)
    hierarchical_cp_groups: Optional[list[Any]] = None
    hybrid_dp_cp_groups: dict[int, Any] = field(default_factory=dict)
    # [None] (the default group) + every group this rank is a member of, in creation order.
    process_group_list: list[Any] = field(default_factory=lambda: [None])
    created: list[Any] = field(default_factory=list)
    handles: dict[str, GroupHandle] = field(default_factory=dict)

    def group(self, kind: str) -> Any:
        """The group of ``kind`` or ``None``."""
        return self.groups.get(kind)

    def handle(self, kind: str) -> "GroupHandle":
        """A :class:`~parallel_state_ng.core.handles.GroupHandle` for this rank's group of ``kind``.

        Ranks are in MCore's order for the kind (e.g. pipeline stages for ``"pp"``); the
        gloo twin, when one was created (``dp``, ``dp_cp``, ``ep_dp``, ...), is the handle's
        CPU group. Handles are cached; a handle-created CPU group is destroyed with the state.

        Raises:
            KeyError: this rank has no group of ``kind`` (unknown kind, option off, or e.g.
                not an embedding stage).
        """
        handle = self.handles.get(kind)
        if handle is None:
            group = self.groups.get(kind)
            if group is None or kind not in self.ranks:
                raise KeyError(
                    f"rank {self.rank} has no group of kind {kind!r}; its groups: {sorted(self.ranks)}"
                )
            if isinstance(group, list):
                raise KeyError(
                    f"rank {self.rank} is in several {kind!r} groups (a 0.12/0.13 encoder rank in several "
                    f"pipelines: {self.ranks[kind]}); a handle needs one group"
                )
            handle = self.handles[kind] = GroupHandle(
                self.ranks[kind], group, self.groups.get(f"{kind}_gloo"), rank=self.rank, name=kind
            )
        return handle


def destroy_state(state: ParallelState) -> int:
    """Destroy every group ``state`` created, its handles' CPU groups included."""
    for handle in state.handles.values():
        handle.destroy()
    state.handles.clear()
    return destroy_groups(state.created)


class _Creator:
    """Creates this rank's groups and records them for rollback and ``update_pg_timeout``."""

    def __init__(self, state: ParallelState, timeout: timedelta) -> None:
        self.state = state
        self.timeout = timeout
        self.pool = GroupPool()  # shares a group between kinds only when sharing is on

    def make(
        self,
        ranks: list[int],
        desc: str,
        *,
        backend: Optional[str] = None,
        pg_options: Any = None,
        timeout: Any = "default",
    ) -> Any:
        pg, new = self.pool.get(
            ranks,
            timeout=self.timeout if timeout == "default" else timeout,
            backend=backend,
            pg_options=pg_options,
            group_desc=desc,
        )
        if new:  # a shared group is listed (and destroyed) once
            self.state.created.append(pg)
            self.state.process_group_list.append(pg)
        return pg


def build_state(
    layout: MegatronLayout,
    rank: int,
    *,
    timeout: timedelta,
    nccl_options: Callable[[str], Any],
    create_gloo_process_groups: bool,
    create_all_gather_group: bool,
    pipeline_model_parallel_comm_backend: Optional[str],
    sharp_enabled_group: Optional[str],
    hybrid_context_parallel: bool,
) -> ParallelState:
    """Create this rank's groups for ``layout``; atomic (see module docstring)."""
    state = ParallelState(layout=layout, rank=rank)
    if not layout.contains(rank):
        return state  # outside [rank_offset, rank_offset + local_world_size): in no group
    try:
        _create_all(
            state,
            _Creator(state, timeout),
            nccl_options,
            create_gloo_process_groups,
            create_all_gather_group,
            pipeline_model_parallel_comm_backend,
            sharp_enabled_group,
            hybrid_context_parallel,
        )
    except BaseException:
        destroy_groups(state.created)
        raise
    return state


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


def _create_all(
    state: ParallelState,
    make: _Creator,
    opts: Callable[[str], Any],
    gloo: bool,
    all_gather: bool,
    pp_backend: Optional[str],
    sharp: Optional[str],
    hybrid: bool,
) -> None:
    lay, rank = state.layout, state.rank
    g, r = state.groups, state.ranks
    facts = lay.facts
    n_instances = lay.num_distributed_optimizer_instances
    gtp_axis = facts.gtp_remat_axis  # 0.19: the GTP weight-rematerialization kinds exist
    # the expert-parallel group gets the init timeout from 0.16 on (torch's default before)
    ep_timeout = {} if api.has("expert_group_timeout", lay.release) else {"timeout": None}
    hcp_timeout = {"timeout": None} if api.has("hierarchical_cp_default_timeout", lay.release) else {}
    legacy_sharp = api.has("sharp_collnet_zero", lay.release)

    def kind(name: str, desc: str, option_key: Optional[str] = None, **kw: Any) -> Any:
        ranks = lay.group(name, rank)
        r[name] = ranks
        g[name] = make.make(ranks, desc, pg_options=opts(option_key or name), **kw)
        return g[name]

    def gloo_twin(name: str, desc: str, **kw: Any) -> None:
        if gloo:
            g[f"{name}_gloo"] = make.make(r[name], desc, backend="gloo", **kw)

    if gtp_axis:
        kind("gtp_remat", "GTP_WEIGHT_REMAT_GROUP")
        gloo = gloo and lay.gtp_remat_size == 1  # 0.19: no gloo groups under GTP

    def data_parallel() -> None:
        kind("dp", "DATA_PARALLEL_GROUP")
        gloo_twin("dp", "DATA_PARALLEL_GROUP_GLOO")

    if facts.dp_before_dp_cp:  # 0.12
        data_parallel()
    # Data parallel with context parallel first: with SHARP it must be the first communicator.
    if sharp == "dp" and not legacy_sharp:
        os.environ["NCCL_COLLNET_ENABLE"] = "1"
    kind("dp_cp", "DATA_PARALLEL_GROUP_WITH_CP")
    if all_gather:  # 0.16-0.17 init argument
        g["dp_cp_ag"] = make.make(r["dp_cp"], "DATA_PARALLEL_GROUP_WITH_CP_AG", pg_options=opts("dp_cp"))
    gloo_twin("dp_cp", "DATA_PARALLEL_GROUP_WITH_CP_GLOO")
    if n_instances > 1:
        kind("intra_dp_cp", "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP")
        gloo_twin("intra_dp_cp", "INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO")
        if facts.inter_partial_dp:  # 0.12
            kind("inter_dp_cp", "INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP")
    if sharp == "dp":
        _sharp_barrier(g["dp_cp"], legacy_sharp)

    if hybrid:
        for size in lay.hybrid_group_sizes():
            state.hybrid_dp_cp_groups[size] = make.make(
                lay.hybrid_group(rank, size), f"HYBRID_DP_CP_GROUP_{size}", pg_options=opts("dp_cp"), timeout=None
            )

    if not facts.dp_before_dp_cp:
        data_parallel()
    if gtp_axis and lay.gtp_remat_size > 1:  # else these alias dp / dp_cp
        kind("gtp_remat_dp", "DATA_PARALLEL_GROUP_WITH_GTP_REMAT")
        kind("gtp_remat_dp_cp", "DATA_PARALLEL_GROUP_WITH_CP_WITH_GTP_REMAT")

    kind("cp", "CONTEXT_PARALLEL_GROUP")
    if lay.hierarchical_levels:
        state.hierarchical_cp_groups = []
        for level in range(lay.hierarchical_levels):
            ranks = lay.group(f"hcp{level}", rank)
            if ranks is None:  # 0.12: sizes that do not cover the cp group leave ranks out
                continue
            r[f"hcp{level}"] = ranks
            pg = make.make(ranks, f"HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L{level}", pg_options=opts("hcp"), **hcp_timeout)
            g[f"hcp{level}"] = pg
            state.hierarchical_cp_groups.append(pg)

    kind("mp", "MODEL_PARALLEL_GROUP")
    kind("tp", "TENSOR_MODEL_PARALLEL_GROUP")

    # A 0.12/0.13 encoder rank can be in several stitched pipelines: MCore then keeps lists
    # of their groups and ranks, and the embedding groups of the last pipeline holding it.
    pipelines, pp_groups = lay.groups("pp", rank), []
    for pipeline in pipelines:
        pp_groups.append(make.make(
            pipeline,
            "PIPELINE_MODEL_PARALLEL_GROUP",
            backend=pp_backend,
            pg_options=None if pp_backend == "ucc" else opts("pp"),
        ))
        for name, desc in (("embd", "EMBEDDING_GROUP"), ("pos_embd", "POSITION_EMBEDDING_GROUP")):
            members = lay.embedding_ranks(name, pipeline)
            if rank in members:
                r[name] = members
                g[name] = make.make(members, desc, pg_options=opts(name))
    several = len(pipelines) > 1
    r["pp"] = pipelines if several else pipelines[0]
    g["pp"] = pp_groups if several else pp_groups[0]

    kind("tp_dp_cp", "TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP")
    kind("tp_dp", "TENSOR_AND_DATA_PARALLEL_GROUP")
    kind("tp_cp", "TENSOR_AND_CONTEXT_PARALLEL_GROUP")

    if gtp_axis:
        kind("expt_gtp_remat", "EXPERT_GTP_WEIGHT_REMAT_GROUP")
    kind("ep", "EXPERT_MODEL_PARALLEL_GROUP", **ep_timeout)
    kind("ep_tp", "EXPERT_TENSOR_PARALLEL_GROUP")
    kind("tp_ep_mp", "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP")
    kind("tp_ep_pp", "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP")
    if gtp_axis:
        kind("tp_ep_gtp_remat_pp", "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP_WITH_EGTP")
        gloo = gloo and lay.expert_gtp_remat_size == 1  # 0.19: no expert gloo groups under expert GTP
    kind("ep_dp", "EXPERT_DATA_PARALLEL_GROUP")
    gloo_twin("ep_dp", "EXPERT_DATA_PARALLEL_GROUP_GLOO", timeout=None)
    if n_instances > 1 and facts.partial_expert_dp:
        if sharp == "dp_replica":
            os.environ["NCCL_COLLNET_ENABLE"] = "1"
        for level, name in enumerate(("intra_ep_dp", "inter_ep_dp")):
            kind(name, f"HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_L{level}")
            gloo_twin(name, f"HIERARCHICAL_EXPERT_DATA_PARALLEL_GROUP_GLOO_L{level}", pg_options=opts(name))
        if sharp == "dp_replica":
            _sharp_barrier(g["inter_ep_dp"], legacy_sharp)
    if gtp_axis and lay.expert_gtp_remat_size > 1:  # else it aliases ep_dp
        kind("ep_gtp_remat_dp", "EXPERT_DATA_PARALLEL_GROUP_WITH_GTP_REMAT")

    if facts.dist_opt_instance_group:
        members = lay.group("intra_dist_opt_instance", rank)
        if members is not None:  # None: a 0.13 encoder layout's leftover groups form no instance
            r["intra_dist_opt_instance"] = members
            g["intra_dist_opt_instance"] = make.make(
                members, "INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", pg_options=opts("intra_dist_opt_instance")
            )
