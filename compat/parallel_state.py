"""Drop-in replacement for ``megatron.core.parallel_state`` (megatron-core 0.16.1).

Same public functions (names, parameters, defaults, return values, exception types), the same
``RankGenerator`` class and the same module globals (``_TENSOR_MODEL_PARALLEL_GROUP``,
``_PIPELINE_GLOBAL_RANKS``, ...), so Megatron code works unchanged after switching the import
(or after :func:`compat.install`).

Underneath, ``initialize_model_parallel`` builds ONE :class:`compat._state.ParallelState` from
the engine's :class:`~parallel_state_ng.megatron_layout.MegatronLayout`: the rank computes and
creates only the groups it belongs to, validation happens before any group exists, a failure
leaves nothing behind, and ``destroy_model_parallel`` destroys every group it created. The
module globals mirror that state; the getters read the globals, as Megatron's do, so code that
assigns a global directly still sees its own value.

Deliberate differences from MCore are listed in the README ("Compatibility notes").
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from parallel_state_ng.agreement import check_initialize_agreement
from parallel_state_ng.layout import Layout
from parallel_state_ng.naming import new_member_group
from parallel_state_ng.megatron_layout import (  # the two defaults are MCore API, re-exported
    MegatronLayout,
    default_embedding_ranks,  # noqa: F401
    default_position_embedding_ranks,  # noqa: F401
    normalize_order,
)

from . import _state
from ._buffers import GlobalMemoryBuffer
from ._validate import validate_initialize_args

# --------------------------------------------------------------------------- module globals
# Same names as MCore; they mirror the ParallelState of the last initialize_model_parallel.
_TENSOR_MODEL_PARALLEL_GROUP = None
_PIPELINE_MODEL_PARALLEL_GROUP = None
_MODEL_PARALLEL_GROUP = None
_EMBEDDING_GROUP = None
_POSITION_EMBEDDING_GROUP = None
_DATA_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP_GLOO = None
_TENSOR_AND_DATA_PARALLEL_GROUP = None
_EXPERT_MODEL_PARALLEL_GROUP = None
_EXPERT_TENSOR_PARALLEL_GROUP = None
_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP = None
_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP = None
_EXPERT_DATA_PARALLEL_GROUP = None
_EXPERT_DATA_PARALLEL_GROUP_GLOO = None
_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP = None
_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO = None
_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP = None
_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE = None
_MPU_EXPERT_MODEL_PARALLEL_RANK = None
_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE = None
_MPU_EXPERT_TENSOR_PARALLEL_RANK = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = None
_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
_MPU_DATA_PARALLEL_WORLD_SIZE = None
_MPU_DATA_PARALLEL_RANK = None
_MPU_TENSOR_MODEL_PARALLEL_RANK = None
_MPU_PIPELINE_MODEL_PARALLEL_RANK = None
_EMBEDDING_GLOBAL_RANKS = None
_POSITION_EMBEDDING_GLOBAL_RANKS = None
_PIPELINE_GLOBAL_RANKS = None
_DATA_PARALLEL_GLOBAL_RANKS = None
_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS = None
_EXPERT_MODEL_PARALLEL_RANKS = None
_MODEL_PARALLEL_GLOBAL_RANKS = None
_CONTEXT_PARALLEL_GROUP = None
_CONTEXT_PARALLEL_GLOBAL_RANKS = None
_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
_HYBRID_DP_CP_GROUPS: dict = {}
_DATA_PARALLEL_GROUP_WITH_CP = None
_DATA_PARALLEL_GROUP_WITH_CP_AG = None
_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = None
_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None
_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
_TENSOR_AND_CONTEXT_PARALLEL_GROUP = None
_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = None
_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP = None
_GLOBAL_MEMORY_BUFFER = None
_GLOBAL_SYMMETRIC_MEMORY_BUFFER = None
_global_process_group_list = None

# The state object the globals mirror (None when not initialized).
_STATE: Optional[_state.ParallelState] = None

# global name -> (state key, kind of value): "group", "gloo" or "ranks".
_PUBLISHED = {
    "_DATA_PARALLEL_GROUP_WITH_CP": "dp_cp",
    "_DATA_PARALLEL_GROUP_WITH_CP_AG": "dp_cp_ag",
    "_DATA_PARALLEL_GROUP_WITH_CP_GLOO": "dp_cp_gloo",
    "_DATA_PARALLEL_GROUP": "dp",
    "_DATA_PARALLEL_GROUP_GLOO": "dp_gloo",
    "_CONTEXT_PARALLEL_GROUP": "cp",
    "_MODEL_PARALLEL_GROUP": "mp",
    "_TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "_PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "_EMBEDDING_GROUP": "embd",
    "_POSITION_EMBEDDING_GROUP": "pos_embd",
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": "tp_dp_cp",
    "_TENSOR_AND_DATA_PARALLEL_GROUP": "tp_dp",
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": "tp_cp",
    "_EXPERT_MODEL_PARALLEL_GROUP": "ep",
    "_EXPERT_TENSOR_PARALLEL_GROUP": "ep_tp",
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": "tp_ep_mp",
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": "tp_ep_pp",
    "_EXPERT_DATA_PARALLEL_GROUP": "ep_dp",
    "_EXPERT_DATA_PARALLEL_GROUP_GLOO": "ep_dp_gloo",
    "_INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP": "inter_ep_dp",
    "_INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP": "intra_dist_opt_instance",
}
_PUBLISHED_RANKS = {
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": "dp_cp",
    "_DATA_PARALLEL_GLOBAL_RANKS": "dp",
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": "cp",
    "_MODEL_PARALLEL_GLOBAL_RANKS": "mp",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": "tp",
    "_PIPELINE_GLOBAL_RANKS": "pp",
    "_EMBEDDING_GLOBAL_RANKS": "embd",
    "_POSITION_EMBEDDING_GLOBAL_RANKS": "pos_embd",
    "_EXPERT_MODEL_PARALLEL_RANKS": "ep",
}
# Globals initialize_model_parallel / destroy_model_parallel own (reset by destroy).
_STATE_GLOBALS = (
    list(_PUBLISHED)
    + list(_PUBLISHED_RANKS)
    + [
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
        "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP",
        "_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO",
        "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
        "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK",
        "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
        "_global_process_group_list",
    ]
)
# Values set through set_*() that MCore's destroy_model_parallel clears as well.
_OVERRIDE_GLOBALS = (
    "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_TENSOR_MODEL_PARALLEL_RANK",
    "_MPU_PIPELINE_MODEL_PARALLEL_RANK",
    "_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE",
    "_MPU_EXPERT_MODEL_PARALLEL_RANK",
    "_MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE",
    "_MPU_EXPERT_TENSOR_PARALLEL_RANK",
)


def _publish(state: Optional[_state.ParallelState]) -> None:
    """Mirror ``state`` into the module globals (``None``: reset them)."""
    g = globals()
    for name in _STATE_GLOBALS:
        g[name] = None
    g["_HYBRID_DP_CP_GROUPS"] = {}
    if state is None:
        return
    for name, key in _PUBLISHED.items():
        g[name] = state.groups.get(key)
    for name, key in _PUBLISHED_RANKS.items():
        g[name] = state.ranks.get(key)
    partial = state.layout.num_distributed_optimizer_instances > 1
    g["_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP"] = state.groups.get("intra_dp_cp" if partial else "dp_cp")
    g["_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO"] = state.groups.get(
        "intra_dp_cp_gloo" if partial else "dp_cp_gloo"
    )
    g["_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP"] = state.groups.get("intra_ep_dp" if partial else "ep_dp")
    g["_INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO"] = state.groups.get(
        "intra_ep_dp_gloo" if partial else "ep_dp_gloo"
    )
    g["_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS"] = state.hierarchical_cp_groups
    g["_HYBRID_DP_CP_GROUPS"] = dict(state.hybrid_dp_cp_groups)
    g["_global_process_group_list"] = state.process_group_list


def get_state() -> Optional[_state.ParallelState]:
    """The state object behind the globals (``None`` before initialization).

    Not part of MCore's API: it gives new code the layout (``get_state().layout``) and every
    group by kind (``get_state().groups``).
    """
    return _STATE


# ------------------------------------------------------------------ several grids (not MCore API)
# A job may hold several independent grids (e.g. a vision encoder with tp 2 and a language model
# with tp 4 over the same ranks). Build each with initialize_model_parallel and detach_state(),
# then activate one at a time with use_state(). Names chosen not to collide with MCore's.

# set_*() overrides, per use_state block: a block starts without any and drops its own on exit.
_BLOCK_OVERRIDES = (*_OVERRIDE_GLOBALS, "_MPU_DATA_PARALLEL_RANK", "_MPU_DATA_PARALLEL_WORLD_SIZE")
# Globals that belong to one grid but are not kept in its ParallelState.
_STATE_EXTRAS = (
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK",
    "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE",
    "_GLOBAL_MEMORY_BUFFER",
    "_GLOBAL_SYMMETRIC_MEMORY_BUFFER",
)
# id(detached state) -> (state, its _STATE_EXTRAS values); holding the state keeps its id unique.
_DETACHED: dict[int, tuple[_state.ParallelState, dict[str, Any]]] = {}
# The states that enclosing use_state blocks make active again on exit, outermost first.
_SUSPENDED: list[Optional[_state.ParallelState]] = []


def _extras_of(state: Optional[_state.ParallelState]) -> dict[str, Any]:
    """The _STATE_EXTRAS values that go with ``state`` when it becomes active."""
    g = globals()
    if state is None:
        return dict.fromkeys(_STATE_EXTRAS)
    if state is _STATE:
        return {name: g[name] for name in _STATE_EXTRAS}
    if id(state) in _DETACHED:
        return dict(_DETACHED[id(state)][1])
    # built elsewhere (e.g. compat._state.build_state): no virtual pipeline, the buffers in place
    return {
        "_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK": None,
        "_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE": None,
        "_GLOBAL_MEMORY_BUFFER": _GLOBAL_MEMORY_BUFFER,
        "_GLOBAL_SYMMETRIC_MEMORY_BUFFER": _GLOBAL_SYMMETRIC_MEMORY_BUFFER,
    }


@contextmanager
def use_state(state: Optional[_state.ParallelState]):
    """Make ``state`` the grid every getter reads inside the ``with`` block.

    ``state`` is a grid from :func:`get_state` or :func:`detach_state` (``None``: no grid, every
    getter fails as uninitialized). Inside the block the module globals mirror ``state`` alone:
    a getter whose group ``state`` lacks (no gloo twin, not an embedding stage, no hierarchical
    context parallelism, ...) raises ``AssertionError`` as MCore does before initialization
    (or returns ``None`` with ``check_initialized=False``) instead of answering for another
    grid. The grid's virtual-pipeline size and global memory buffer come with it.

    ``set_*`` overrides are per block: the block starts without any and those set inside it are
    dropped on exit. On exit, normal or by an exception, the previous grid, its overrides and
    globals are restored exactly; blocks nest. A grid initialized inside a block must be
    detached there, else it is dropped on exit with its groups alive (a ``ResourceWarning``).
    """
    global _STATE
    g = globals()
    extras = _extras_of(state)
    saved_state = _STATE
    saved = {name: g[name] for name in (*_STATE_GLOBALS, *_BLOCK_OVERRIDES, *_STATE_EXTRAS, "_HYBRID_DP_CP_GROUPS")}
    _SUSPENDED.append(saved_state)
    try:
        _STATE = state
        _publish(state)
        g.update(extras)
        for name in _BLOCK_OVERRIDES:
            g[name] = None
        yield state
    finally:
        _SUSPENDED.pop()
        left = _STATE
        _STATE = saved_state
        g.update(saved)
        if left is not None and left is not state and id(left) not in _DETACHED:
            warnings.warn(
                "a parallel state initialized inside a use_state block was neither detached nor "
                "destroyed there; its process groups stay alive but no getter can reach them",
                ResourceWarning,
                stacklevel=3,
            )


def detach_state() -> _state.ParallelState:
    """Take the active grid out of the module without destroying its groups; return it.

    The module is left as :func:`destroy_model_parallel` leaves it (uninitialized, overrides
    and buffers cleared), so ``initialize_model_parallel`` can build another grid. The returned
    state keeps its groups, virtual-pipeline size and memory buffer: activate it with
    :func:`use_state`, export it with ``compat.pg_collection.to_process_group_collection``,
    and free it with :func:`destroy_state`. Typical use::

        initialize_model_parallel(tensor_model_parallel_size=2)
        vision = detach_state()
        initialize_model_parallel(tensor_model_parallel_size=4)
        language = detach_state()
        with use_state(vision):
            ...  # Megatron code sees the tp-2 grid
        destroy_state(vision); destroy_state(language)

    Raises:
        AssertionError: no grid is active.
    """
    global _STATE
    state = _STATE
    if state is None:
        raise AssertionError(
            "no parallel state to detach: initialize_model_parallel has not run, or its grid was "
            "destroyed or detached already"
        )
    g = globals()
    _DETACHED[id(state)] = (state, {name: g[name] for name in _STATE_EXTRAS})
    _STATE = None
    _publish(None)
    for name in (*_OVERRIDE_GLOBALS, "_GLOBAL_MEMORY_BUFFER", "_GLOBAL_SYMMETRIC_MEMORY_BUFFER"):
        g[name] = None
    return state


def destroy_state(state: _state.ParallelState) -> None:
    """Destroy the process groups of ``state``, an active or detached grid.

    The active grid is destroyed with :func:`destroy_model_parallel`; a detached one is
    destroyed without touching the active grid. Destroying a grid twice is harmless.

    Raises:
        TypeError: ``state`` is not a ParallelState.
        AssertionError: an enclosing :func:`use_state` block would make ``state`` active again
            on exit (destroy it after that block).
    """
    if not isinstance(state, _state.ParallelState):
        raise TypeError(f"state must be a ParallelState (from get_state or detach_state), got {state!r}")
    if any(s is state for s in _SUSPENDED):
        raise AssertionError(
            "this parallel state is restored by an enclosing use_state block on exit; destroy it after that block"
        )
    if state is _STATE:
        destroy_model_parallel()
        return
    _DETACHED.pop(id(state), None)
    _state.destroy_state(state)


# --------------------------------------------------------------------------- helpers (MCore API)
def get_nccl_options(pg_name, nccl_comm_cfgs):
    """NCCL options for group ``pg_name`` from a parsed communicator config, or ``None``.

    Recognised keys per group: ``is_high_priority_stream``, ``cga_cluster_size``, ``max_ctas``,
    ``min_ctas`` and ``net_name`` (``IB`` or ``socket``, else ``RuntimeError``).
    """
    if pg_name not in nccl_comm_cfgs:
        return None
    cfg = nccl_comm_cfgs[pg_name]
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


def update_pg_timeout(timeout: timedelta, pg: Optional[torch._C._distributed_c10d.ProcessGroup] = None):
    """Set ``timeout`` on ``pg``, or on every group of this rank (and the default one).

    Synchronizes the group(s) first (barrier and CUDA sync), as MCore does.
    """
    if not hasattr(torch.distributed.distributed_c10d, "_set_pg_timeout"):
        return
    torch.distributed.barrier(pg)
    torch.cuda.synchronize()
    targets = _global_process_group_list if pg is None else [pg]
    for group in targets:
        torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)


def create_group(
    ranks=None,
    timeout=None,
    backend=None,
    pg_options=None,
    use_local_synchronization=False,
    group_desc=None,
):
    """Create a process group with ``torch.distributed.new_group`` (same arguments).

    A group that contains the calling rank is appended to ``_global_process_group_list`` so
    that :func:`update_pg_timeout` reaches it.
    """
    global _global_process_group_list
    group = torch.distributed.new_group(
        ranks=ranks,
        timeout=timeout,
        backend=backend,
        pg_options=pg_options,
        use_local_synchronization=use_local_synchronization,
        group_desc=group_desc,
    )
    if _global_process_group_list is None:
        _global_process_group_list = [None]
    if torch.distributed.get_rank() in ranks:
        _global_process_group_list.append(group)
    return group


def _note_group_creation() -> None:
    """Start ``_global_process_group_list`` (with the default group) if it is not yet."""
    global _global_process_group_list
    if _global_process_group_list is None:
        _global_process_group_list = [None]


def _member_group(ranks: list[int], **kwargs: Any) -> Any:
    """A group created by its members only, recorded for :func:`update_pg_timeout`."""
    group = new_member_group(ranks, **kwargs)
    _note_group_creation()
    _global_process_group_list.append(group)
    return group


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: List[int], mask: List[bool]
) -> List[List[int]]:
    """All groups over the masked dims of a mixed-radix layout (first size varies fastest).

    ``parallel_size[i]`` is the size of dim ``i``; ``mask[i]`` says whether dim ``i`` is inside
    the groups. Groups are numbered by the unmasked dims and list their ranks by the masked
    dims, both with the first dim fastest. Computed by the engine's vectorized enumeration.
    """
    names = [f"d{i}" for i in range(len(parallel_size))]
    layout = Layout(list(parallel_size), names)
    groups = layout.enumerate_groups([n for n, m in zip(names, mask) if m])
    wanted = world_size // groups.shape[1]
    if wanted > groups.shape[0]:
        raise AssertionError(
            f"world_size {world_size} is larger than the layout {list(parallel_size)} ({layout.size} ranks)"
        )
    return groups[:wanted].tolist()


def create_hierarchical_groups(
    rank,
    ranks,
    hierarchical_group_sizes,
    create_gloo_process_groups=False,
    pg_options=None,
    timeout=None,
    group_desc=None,
):
    """Create ``rank``'s sub-groups of the group ``ranks`` at each hierarchy level.

    ``ranks`` is split into levels of sizes ``hierarchical_group_sizes`` (level 0 varies
    fastest over the positions in ``ranks``). Returns ``(groups, gloo_groups)``, one entry per
    level; both empty when ``rank`` is not in ``ranks``. Only the calling rank's sub-groups are
    created (``use_local_synchronization=True``). ``pg_options`` may be a list (one per level).
    """
    sizes = list(hierarchical_group_sizes)
    if not isinstance(pg_options, list):
        pg_options = [pg_options] * len(sizes)
    if math.prod(sizes) != len(ranks):
        raise RuntimeError(  # MCore's einops rearrange fails with a RuntimeError subclass
            f"hierarchical_group_sizes {sizes} multiply to {math.prod(sizes)}, but ranks has {len(ranks)} entries"
        )
    if sizes and ranks:
        _note_group_creation()
    if rank not in ranks:
        return [], []
    layout = Layout([len(ranks)], ["all"]).split("all", sizes, [f"l{i}" for i in range(len(sizes))])
    position = list(ranks).index(rank)
    groups, gloo_groups = [], []
    for level in range(len(sizes)):
        members = [ranks[i] for i in layout.group_ranks(position, f"l{level}")]
        groups.append(
            _member_group(members, timeout=timeout, pg_options=pg_options[level], group_desc=f"HIERARCHICAL_{group_desc}_L{level}")
        )
        gloo_groups.append(
            _member_group(
                members,
                timeout=timeout,
                backend="gloo",
                pg_options=pg_options[level],
                group_desc=f"HIERARCHICAL_{group_desc}_GLOO_L{level}",
            )
            if create_gloo_process_groups
            else None
        )
    return groups, gloo_groups


def create_hybrid_dp_cp_groups(rank, ranks, pg_options):
    """Create ``rank``'s hybrid dp×cp groups: for each power of two ``s`` from 2 below
    ``len(ranks)``, the chunk of ``s`` consecutive entries of ``ranks`` holding ``rank``.

    Returns ``{s: group}``; only the calling rank's chunks are created.
    """
    out = {}
    sizes = [2**i for i in range(1, int(math.log2(len(ranks))))] if len(ranks) > 0 else []
    if sizes:
        _note_group_creation()
    if rank not in ranks:
        return out
    position = list(ranks).index(rank)
    for size in sizes:
        start = (position // size) * size
        out[size] = _member_group(
            list(ranks[start : start + size]), pg_options=pg_options, group_desc=f"HYBRID_DP_CP_GROUP_{size}"
        )
    return out


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs, pg_name, key_value_pair):
    """Set ``nccl_comm_cfgs[pg_name][key] = value`` for ``key_value_pair = (key, value)``."""
    nccl_comm_cfgs.setdefault(pg_name, {})[key_value_pair[0]] = key_value_pair[1]


class RankGenerator:
    """Rank groups for a tp/ep/dp/pp/cp layout given by an ``order`` string.

    Same constructor and methods as MCore's ``RankGenerator``; groups come from the engine's
    :class:`~parallel_state_ng.layout.Layout` (vectorized).
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0) -> None:
        if not (ep == 1 or cp == 1):
            raise AssertionError(
                f"a RankGenerator takes ep > 1 or cp > 1, not both (ep={ep}, cp={cp}): cp belongs to "
                f"the dense generator and ep to the expert one"
            )
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * dp * pp * cp * ep
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        tokens = normalize_order(order, self.name_to_size)
        self.order = "-".join(tokens)
        self.ordered_size = [self.name_to_size[t] for t in tokens]
        self._layout = Layout(self.ordered_size, tokens, rank_offset)

    def get_mask(self, order: str, token: str):
        """Booleans over the tokens of ``order``: True for those named in ``token`` ('tp-dp')."""
        ordered = order.split("-")
        mask = [False] * len(ordered)
        for t in token.split("-"):
            mask[ordered.index(t)] = True
        return mask

    def get_ranks(self, token):
        """All groups over the dims named in ``token`` (e.g. ``'tp-dp'``), in MCore order."""
        dims = token.split("-")
        for t in dims:
            self.order.split("-").index(t)  # ValueError for a token not in order, like MCore
        return self._layout.rank_enum(dims)


# --------------------------------------------------------------------------- initialization
def _load_nccl_config(path: Optional[str]) -> dict:
    if path is None:
        return {}
    try:
        import yaml
    except ImportError:
        raise RuntimeError(
            "Cannot import `yaml`: nccl_communicator_config_path needs the PyYAML package (pip install pyyaml)"
        ) from None
    with open(path, "r") as stream:
        config = yaml.safe_load(stream)
    if not isinstance(config, dict):
        # MCore fails on it later with TypeError ("argument of type 'NoneType' ...").
        raise TypeError(
            f"nccl_communicator_config_path {path!r} must hold a mapping of group name to options, "
            f"got {type(config).__name__}"
        )
    return config


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_comm_backend: Optional[str] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Optional[List[int]] = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Optional[Callable[[List[int], Optional[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int], Optional[int]], List[int]]] = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: Optional[List[str]] = None,
    sharp_enabled_group: Optional[str] = None,
    create_all_gather_group: Optional[bool] = False,
) -> None:
    """Build this rank's model- and data-parallel groups (MCore's signature and semantics).

    The world (``torch.distributed``) is split into tensor (``tp``), context (``cp``), data
    (``dp``) and pipeline (``pp``) parallel dims, and, for MoE layers, into expert-tensor,
    expert (``ep``), expert-data and pipeline dims, laid out by ``order`` (first token varies
    fastest). Every argument means what it means in megatron-core 0.16.1.

    Unlike MCore: all arguments are checked before any group is created; the rank creates
    only the groups it belongs to; a failure destroys whatever was created and leaves the
    module uninitialized; and a later :func:`destroy_model_parallel` destroys every group.
    """
    global _STATE
    # Every rank must pass the same arguments: compare them across ranks before anything else
    # (a mismatch raises on every rank instead of hanging; see parallel_state_ng.agreement).
    check_initialize_agreement(locals())
    if use_sharp:
        if sharp_enabled_group is None:
            sharp_enabled_group = "dp"
        elif sharp_enabled_group not in ("dp", "dp_replica"):
            raise AssertionError(f"Invalid sharp_enabled_group {sharp_enabled_group!r}: use 'dp' or 'dp_replica'")
        elif sharp_enabled_group == "dp_replica" and not num_distributed_optimizer_instances > 1:
            raise AssertionError(
                "sharp_enabled_group 'dp_replica' requires num_distributed_optimizer_instances > 1, "
                f"got {num_distributed_optimizer_instances}"
            )
    elif sharp_enabled_group is not None:
        raise AssertionError(
            f"sharp_enabled_group={sharp_enabled_group!r} is only valid with use_sharp=True"
        )
    os.environ.pop("NCCL_COLLNET_ENABLE", None)
    if not dist.is_initialized():
        raise AssertionError("torch.distributed is not initialized: call init_process_group() first")
    world_size = dist.get_world_size()
    validate_initialize_args(dict(locals()))

    if virtual_pipeline_model_parallel_size is not None and not pipeline_model_parallel_size > 1:
        raise RuntimeError(
            f"virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size} needs "
            f"pipeline_model_parallel_size > 1 (got {pipeline_model_parallel_size}): the interleaved "
            f"schedule interleaves pipeline stages"
        )
    layout = MegatronLayout(
        world_size=world_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        order=order,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
    )
    if _DATA_PARALLEL_GROUP is not None or _STATE is not None:
        raise AssertionError(
            "data parallel group is already initialized: call destroy_model_parallel() before "
            "initializing again"
        )
    if hybrid_context_parallel and (layout.data_parallel_size * context_parallel_size) % 2 != 0:
        raise AssertionError(
            f"hybrid_context_parallel needs an even data_parallel_size x context_parallel_size, got "
            f"{layout.data_parallel_size} x {context_parallel_size}"
        )
    if pipeline_model_parallel_comm_backend not in (None, "nccl", "ucc"):
        raise AssertionError(
            f'"{pipeline_model_parallel_comm_backend}" backend for PP communication is not supported '
            f"(pipeline_model_parallel_comm_backend must be None, 'nccl' or 'ucc')"
        )
    if _GLOBAL_MEMORY_BUFFER is not None:
        raise AssertionError("global memory buffer is already initialized: call destroy_model_parallel() first")

    nccl_comm_cfgs = _load_nccl_config(nccl_communicator_config_path)
    for pg_name in high_priority_stream_groups or []:
        overwrite_nccl_comm_cfgs(nccl_comm_cfgs, pg_name, ("is_high_priority_stream", True))
    if pipeline_model_parallel_comm_backend == "ucc":
        _set_ucc_environment()

    state = _state.build_state(
        layout,
        dist.get_rank(),
        timeout=timedelta(minutes=distributed_timeout_minutes),
        nccl_options=lambda name: get_nccl_options(name, nccl_comm_cfgs),
        create_gloo_process_groups=create_gloo_process_groups,
        create_all_gather_group=bool(create_all_gather_group),
        pipeline_model_parallel_comm_backend=pipeline_model_parallel_comm_backend,
        sharp_enabled_group=sharp_enabled_group,
        hybrid_context_parallel=hybrid_context_parallel,
    )
    _STATE = state
    _publish(state)
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size
    _set_global_memory_buffer()


def _set_ucc_environment() -> None:
    """Environment the UCC pipeline backend needs (same values MCore sets)."""
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise AssertionError(
            "pipeline_model_parallel_comm_backend='ucc' requires CUDA_DEVICE_MAX_CONNECTIONS > 1 (it is 1)"
        )
    os.environ.setdefault("TORCH_UCC_BLOCKING_WAIT", "none")
    os.environ.setdefault("UCC_EC_CUDA_STREAM_TASK_MODE", "driver")
    os.environ.setdefault("UCX_TLS", "ib,cuda_copy")
    os.environ["NSYS_UCP_COMM_PARAMS"] = "1"
    os.environ["UCX_RNDV_THRESH"] = "0"
    os.environ["UCX_NET_DEVICES"] = "all"
    os.environ["UCC_CL_BASIC_TLS"] = "^sharp,nccl"


def is_initialized():
    """Whether ``initialize_model_parallel`` has run (the data-parallel group exists)."""
    return _DATA_PARALLEL_GROUP is not None


def is_unitialized() -> bool:
    """Deprecated inverse of :func:`is_initialized`."""
    warnings.warn("is_unitialized is deprecated, use is_initialized instead", DeprecationWarning)
    return not is_initialized()


def model_parallel_is_initialized():
    """Whether the tensor, pipeline and data-parallel groups all exist."""
    return not (
        _TENSOR_MODEL_PARALLEL_GROUP is None or _PIPELINE_MODEL_PARALLEL_GROUP is None or _DATA_PARALLEL_GROUP is None
    )


def _required(value: Any, what: str) -> Any:
    if value is None:
        raise AssertionError(f"{what} is not initialized")
    return value


def _checked(value: Any, check_initialized: bool, what: str) -> Any:
    return _required(value, what) if check_initialized else value


# --------------------------------------------------------------------------- group getters
def get_model_parallel_group(check_initialized=True):
    """This rank's model-parallel (tp × pp) group."""
    return _checked(_MODEL_PARALLEL_GROUP, check_initialized, "model parallel group")


def get_tensor_model_parallel_group(check_initialized=True):
    """This rank's tensor-model-parallel group."""
    return _checked(_TENSOR_MODEL_PARALLEL_GROUP, check_initialized, "tensor model parallel group")


def get_pipeline_model_parallel_group(check_initialized=True):
    """This rank's pipeline-model-parallel group."""
    return _checked(_PIPELINE_MODEL_PARALLEL_GROUP, check_initialized, "pipeline_model parallel group")


def get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False, independent_all_gather=False):
    """This rank's data-parallel group (with cp, partial, or the separate all-gather twin)."""
    if with_context_parallel:
        if partial_data_parallel:
            return _required(_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP, "Intra partial data parallel group")
        if independent_all_gather:
            return _required(_DATA_PARALLEL_GROUP_WITH_CP_AG, "data parallel group with context parallel AG")
        return _required(_DATA_PARALLEL_GROUP_WITH_CP, "data parallel group with context parallel combined")
    _required(_DATA_PARALLEL_GROUP, "data parallel group")
    if partial_data_parallel:
        raise AssertionError("Partial DP for Optimizer needs to include CP (with_context_parallel=True)")
    return _DATA_PARALLEL_GROUP


def has_separate_all_gather_group() -> bool:
    """Whether a dedicated all-gather twin of the dp×cp group was created."""
    return _DATA_PARALLEL_GROUP_WITH_CP_AG is not None


def get_data_parallel_group_gloo(with_context_parallel=False, partial_data_parallel=False):
    """The gloo twin of this rank's data-parallel group."""
    if with_context_parallel:
        if partial_data_parallel:
            return _required(_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO, "Intra partial data parallel group")
        return _required(
            _DATA_PARALLEL_GROUP_WITH_CP_GLOO, "data parallel group-gloo with context parallel combined"
        )
    _required(_DATA_PARALLEL_GROUP_GLOO, "data parallel group-gloo")
    if partial_data_parallel:
        raise AssertionError("Partial DP for Optimizer needs to include CP (with_context_parallel=True)")
    return _DATA_PARALLEL_GROUP_GLOO


def get_context_parallel_group(check_initialized=True):
    """This rank's context-parallel group."""
    return _checked(_CONTEXT_PARALLEL_GROUP, check_initialized, "context parallel group")


def get_context_parallel_global_ranks(check_initialized=True):
    """Global ranks of this rank's context-parallel group, in group order."""
    return _checked(_CONTEXT_PARALLEL_GLOBAL_RANKS, check_initialized, "context parallel group")


def get_hierarchical_context_parallel_groups(check_initialized=True):
    """This rank's hierarchical context-parallel groups, one per level."""
    return _checked(_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS, check_initialized, "hierarchical context parallel group")


def get_hybrid_data_context_parallel_groups(check_initialized=True, group_size=None):
    """This rank's hybrid dp×cp group of ``group_size`` (the whole dp×cp group at full size)."""
    if get_data_parallel_world_size(with_context_parallel=True) == group_size:
        return _checked(_DATA_PARALLEL_GROUP_WITH_CP, check_initialized, "data parallel group with context parallel")
    if check_initialized:
        _required(_HYBRID_DP_CP_GROUPS, "hybrid data context parallel groups")
    return _HYBRID_DP_CP_GROUPS[group_size]


def get_embedding_group(check_initialized=True):
    """This rank's word-embedding group."""
    return _checked(_EMBEDDING_GROUP, check_initialized, "embedding group")


def get_position_embedding_group(check_initialized=True):
    """This rank's position-embedding group."""
    return _checked(_POSITION_EMBEDDING_GROUP, check_initialized, "position embedding group")


def get_amax_reduction_group(with_context_parallel=False, tp_only_amax_red=False):
    """The FP8 amax reduction group: tp×dp(×cp), or tp(×cp) with ``tp_only_amax_red``."""
    if with_context_parallel:
        group = _TENSOR_AND_CONTEXT_PARALLEL_GROUP if tp_only_amax_red else _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP
    else:
        group = _TENSOR_MODEL_PARALLEL_GROUP if tp_only_amax_red else _TENSOR_AND_DATA_PARALLEL_GROUP
    return _required(group, "FP8 amax reduction group")


def get_tensor_and_data_parallel_group(check_initialized=True, with_context_parallel=False):
    """This rank's tp × dp (× cp with ``with_context_parallel``) group."""
    group = _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP if with_context_parallel else _TENSOR_AND_DATA_PARALLEL_GROUP
    return _checked(group, check_initialized, "tensor and data parallel group")


def get_tensor_and_context_parallel_group(check_initialized=True):
    """This rank's tp × cp group."""
    return _checked(_TENSOR_AND_CONTEXT_PARALLEL_GROUP, check_initialized, "tensor and context parallel group")


# --------------------------------------------------------------------------- sizes and ranks
def set_tensor_model_parallel_world_size(world_size):
    """Override the tensor-model-parallel size that the getters report."""
    global _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_pipeline_model_parallel_world_size(world_size):
    """Override the pipeline-model-parallel size that the getters report."""
    global _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_virtual_pipeline_model_parallel_world_size(world_size):
    """Set the virtual-pipeline size."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def get_tensor_model_parallel_world_size():
    """Size of the tensor-model-parallel group (or the override)."""
    if _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    return get_tensor_model_parallel_group().size()


def get_pipeline_model_parallel_world_size():
    """Size of the pipeline-model-parallel group (or the override)."""
    if _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    return get_pipeline_model_parallel_group().size()


def set_tensor_model_parallel_rank(rank):
    """Override the tensor-model-parallel rank that the getters report."""
    global _MPU_TENSOR_MODEL_PARALLEL_RANK
    _MPU_TENSOR_MODEL_PARALLEL_RANK = rank


def set_pipeline_model_parallel_rank(rank):
    """Override the pipeline-model-parallel rank that the getters report."""
    global _MPU_PIPELINE_MODEL_PARALLEL_RANK
    _MPU_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_tensor_model_parallel_rank():
    """This rank's position in its tensor-model-parallel group (or the override)."""
    if _MPU_TENSOR_MODEL_PARALLEL_RANK is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_RANK
    return get_tensor_model_parallel_group().rank()


def get_pipeline_model_parallel_rank():
    """This rank's pipeline stage (or the override)."""
    if _MPU_PIPELINE_MODEL_PARALLEL_RANK is not None:
        return _MPU_PIPELINE_MODEL_PARALLEL_RANK
    return torch.distributed.get_rank(group=get_pipeline_model_parallel_group())


def _virtual_stage_matches(ignore_virtual: bool, vp_stage: Optional[int], wanted: Callable[[int], int]) -> bool:
    """False when a virtual stage is in play and ``vp_stage`` is not the wanted one."""
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if ignore_virtual or vp_size is None:
        return True
    if vp_stage is None:
        raise AssertionError("vp_stage must be passed if virtual pipeline is enabled")
    return vp_stage == wanted(vp_size)


def is_pipeline_first_stage(ignore_virtual=True, vp_stage=None):
    """Whether this rank runs the first pipeline stage (and ``vp_stage`` is the first chunk)."""
    if not _virtual_stage_matches(ignore_virtual, vp_stage, lambda size: 0):
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
    """Whether this rank runs the last pipeline stage (and ``vp_stage`` is the last chunk)."""
    if not _virtual_stage_matches(ignore_virtual, vp_stage, lambda size: size - 1):
        return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual=True, vp_stage=None):
    """Whether this rank holds word embeddings (with virtual stages: in this chunk)."""
    rank = torch.distributed.get_rank()
    if _EMBEDDING_GLOBAL_RANKS is None or rank not in _EMBEDDING_GLOBAL_RANKS:
        return False
    if ignore_virtual:
        return True
    if rank == _EMBEDDING_GLOBAL_RANKS[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == _EMBEDDING_GLOBAL_RANKS[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group():
    """Whether this rank holds position embeddings."""
    rank = torch.distributed.get_rank()
    return _POSITION_EMBEDDING_GLOBAL_RANKS is not None and rank in _POSITION_EMBEDDING_GLOBAL_RANKS


def get_virtual_pipeline_model_parallel_rank():
    """The virtual pipeline rank (deprecated global state; ``None`` without interleaving)."""
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


def set_virtual_pipeline_model_parallel_rank(rank):
    """Set the virtual pipeline rank (deprecated: pass ``vp_stage`` instead)."""
    warnings.warn(
        "set_virtual_pipeline_model_parallel_rank in global scope is deprecated. "
        "Pass vp_stage explicitly to is_pipeline_first_stage, is_pipeline_last_stage, etc.",
        DeprecationWarning,
    )
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_virtual_pipeline_model_parallel_world_size():
    """The number of virtual pipeline chunks per rank (``None`` without interleaving)."""
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE


def get_tensor_model_parallel_src_rank():
    """Global rank of the first member of this rank's tensor-model-parallel group."""
    return _required(_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS, "Tensor model parallel group")[0]


def get_model_parallel_src_rank():
    """Global rank of the first member of this rank's model-parallel group."""
    return _required(_MODEL_PARALLEL_GLOBAL_RANKS, "Model parallel group")[0]


def get_data_parallel_src_rank(with_context_parallel=False):
    """Global rank of the first member of this rank's data-parallel (× cp) group."""
    if with_context_parallel:
        return _required(
            _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP, "Data parallel group with context parallel combined"
        )[0]
    return _required(_DATA_PARALLEL_GLOBAL_RANKS, "Data parallel group")[0]


def get_pipeline_model_parallel_first_rank():
    """Global rank of the first stage of this rank's pipeline."""
    return _required(_PIPELINE_GLOBAL_RANKS, "Pipeline parallel group")[0]


def get_pipeline_model_parallel_last_rank():
    """Global rank of the last stage of this rank's pipeline."""
    ranks = _required(_PIPELINE_GLOBAL_RANKS, "Pipeline parallel group")
    return ranks[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank():
    """Global rank of the next stage of this rank's pipeline (wrapping around)."""
    ranks = _required(_PIPELINE_GLOBAL_RANKS, "Pipeline parallel group")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % get_pipeline_model_parallel_world_size()]


def get_pipeline_model_parallel_prev_rank():
    """Global rank of the previous stage of this rank's pipeline (wrapping around)."""
    ranks = _required(_PIPELINE_GLOBAL_RANKS, "Pipeline parallel group")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % get_pipeline_model_parallel_world_size()]


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def get_data_parallel_world_size(with_context_parallel=False, partial_data_parallel=False):
    """Size of this rank's data-parallel group (0 without torch.distributed)."""
    if _MPU_DATA_PARALLEL_WORLD_SIZE is not None:
        return _MPU_DATA_PARALLEL_WORLD_SIZE
    if not _distributed():
        return 0
    return get_data_parallel_group(
        with_context_parallel=with_context_parallel, partial_data_parallel=partial_data_parallel
    ).size()


def set_data_parallel_rank(rank):
    """Override the data-parallel rank that the getters report."""
    global _MPU_DATA_PARALLEL_RANK
    _MPU_DATA_PARALLEL_RANK = rank


def get_data_parallel_rank(with_context_parallel=False, partial_data_parallel=False):
    """This rank's position in its data-parallel group (0 without torch.distributed)."""
    if _MPU_DATA_PARALLEL_RANK is not None:
        return _MPU_DATA_PARALLEL_RANK
    if not _distributed():
        return 0
    return get_data_parallel_group(
        with_context_parallel=with_context_parallel, partial_data_parallel=partial_data_parallel
    ).rank()


def get_context_parallel_world_size():
    """Size of this rank's context-parallel group (0 without torch.distributed)."""
    return get_context_parallel_group().size() if _distributed() else 0


def get_context_parallel_rank():
    """This rank's position in its context-parallel group (0 without torch.distributed)."""
    return get_context_parallel_group().rank() if _distributed() else 0


def get_tensor_and_context_parallel_world_size():
    """Size of this rank's tp × cp group (0 without torch.distributed)."""
    return get_tensor_and_context_parallel_group().size() if _distributed() else 0


def get_tensor_and_context_parallel_rank():
    """This rank's position in its tp × cp group (0 without torch.distributed)."""
    return get_tensor_and_context_parallel_group().rank() if _distributed() else 0


# --------------------------------------------------------------------------- expert parallel
def get_expert_model_parallel_group(check_initialized=True):
    """This rank's expert-model-parallel group."""
    return _checked(_EXPERT_MODEL_PARALLEL_GROUP, check_initialized, "expert model parallel group")


def get_expert_model_parallel_src_rank():
    """Global rank of the first member of this rank's expert-model-parallel group."""
    return _required(_EXPERT_MODEL_PARALLEL_RANKS, "Expert model parallel group")[0]


def get_expert_model_parallel_world_size():
    """Size of this rank's expert-model-parallel group (or the override; 0 without dist)."""
    if _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE
    return get_expert_model_parallel_group().size() if _distributed() else 0


def set_expert_model_parallel_world_size(world_size):
    """Override the expert-model-parallel size that the getters report."""
    global _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE
    _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE = world_size


def get_expert_model_parallel_rank():
    """This rank's position in its expert-model-parallel group (or the override)."""
    if _MPU_EXPERT_MODEL_PARALLEL_RANK is not None:
        return _MPU_EXPERT_MODEL_PARALLEL_RANK
    return get_expert_model_parallel_group().rank() if _distributed() else 0


def set_expert_model_parallel_rank(rank):
    """Override the expert-model-parallel rank that the getters report."""
    global _MPU_EXPERT_MODEL_PARALLEL_RANK
    _MPU_EXPERT_MODEL_PARALLEL_RANK = rank


def get_expert_tensor_parallel_group(check_initialized=True):
    """This rank's expert-tensor-parallel group."""
    return _checked(_EXPERT_TENSOR_PARALLEL_GROUP, check_initialized, "Expert tensor parallel group")


def get_expert_tensor_parallel_world_size():
    """Size of the expert-tensor-parallel group (falls back to the tp override before init)."""
    if _MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE is not None:
        return _MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE
    if not _EXPERT_TENSOR_PARALLEL_GROUP:
        return _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    return get_expert_tensor_parallel_group().size()


def set_expert_tensor_parallel_world_size(world_size):
    """Override the expert-tensor-parallel size that the getters report."""
    global _MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE
    _MPU_EXPERT_TENSOR_PARALLEL_WORLD_SIZE = world_size


def get_expert_tensor_parallel_rank():
    """This rank's expert-tensor-parallel rank (falls back to the tp override before init)."""
    if _MPU_EXPERT_TENSOR_PARALLEL_RANK is not None:
        return _MPU_EXPERT_TENSOR_PARALLEL_RANK
    if not _EXPERT_TENSOR_PARALLEL_GROUP:
        return _MPU_TENSOR_MODEL_PARALLEL_RANK
    return get_expert_tensor_parallel_group().rank()


def set_expert_tensor_parallel_rank(rank):
    """Override the expert-tensor-parallel rank that the getters report."""
    global _MPU_EXPERT_TENSOR_PARALLEL_RANK
    _MPU_EXPERT_TENSOR_PARALLEL_RANK = rank


def get_expert_tensor_and_model_parallel_group(check_initialized=True):
    """This rank's expert tp × ep group."""
    return _checked(
        _EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP, check_initialized, "Expert tensor and model parallel group"
    )


def get_expert_tensor_and_model_parallel_world_size():
    """Size of this rank's expert tp × ep group (0 without torch.distributed)."""
    return get_expert_tensor_and_model_parallel_group().size() if _distributed() else 0


def get_expert_tensor_and_model_parallel_rank():
    """This rank's position in its expert tp × ep group (0 without torch.distributed)."""
    return get_expert_tensor_and_model_parallel_group().rank() if _distributed() else 0


def get_expert_tensor_model_pipeline_parallel_group(check_initialized=True):
    """This rank's expert tp × ep × pp group."""
    return _checked(
        _EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP,
        check_initialized,
        "Expert tensor-model-pipeline parallel group",
    )


def get_expert_data_parallel_group(check_initialized=True, partial_expert_data_parallel=False):
    """This rank's expert-data-parallel group (or its share within one optimizer instance)."""
    if partial_expert_data_parallel:
        return _checked(
            _INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP, check_initialized, "Intra partial expert data parallel group"
        )
    return _checked(_EXPERT_DATA_PARALLEL_GROUP, check_initialized, "Expert data parallel group")


def get_data_modulo_expert_parallel_group(partial_expert_data_parallel=False):
    """Deprecated name of :func:`get_expert_data_parallel_group`."""
    warnings.warn(
        "get_data_modulo_expert_parallel_group is deprecated, please use get_expert_data_parallel_group instead.",
        DeprecationWarning,
    )
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel)


def get_expert_data_parallel_group_gloo(partial_expert_data_parallel=False):
    """The gloo twin of this rank's expert-data-parallel group."""
    if partial_expert_data_parallel:
        return _required(
            _INTRA_PARTIAL_EXPERT_DATA_PARALLEL_GROUP_GLOO, "Intra partial expert data parallel group-gloo"
        )
    return _required(_EXPERT_DATA_PARALLEL_GROUP_GLOO, "Expert data parallel group-gloo")


def get_expert_data_parallel_rank(partial_expert_data_parallel=False):
    """This rank's position in its expert-data-parallel group (0 without torch.distributed)."""
    if not _distributed():
        return 0
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel).rank()


def get_expert_data_parallel_world_size(partial_expert_data_parallel=False):
    """Size of this rank's expert-data-parallel group (0 without torch.distributed)."""
    if not _distributed():
        return 0
    return get_expert_data_parallel_group(partial_expert_data_parallel=partial_expert_data_parallel).size()


def get_intra_distributed_optimizer_instance_group(check_initialized=True):
    """All ranks of this rank's distributed-optimizer instance."""
    return _checked(
        _INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP, check_initialized, "Intra distributed optimizer instance group"
    )


def get_inter_distributed_optimizer_instance_group(check_initialized=True):
    """The group across distributed-optimizer instances (shared by dense and expert layers)."""
    return _checked(
        _INTER_PARTIAL_EXPERT_DATA_PARALLEL_GROUP, check_initialized, "Inter distributed optimizer instance group"
    )


# --------------------------------------------------------------------------- buffers
def _set_global_memory_buffer():
    """Create the global memory buffer (once)."""
    global _GLOBAL_MEMORY_BUFFER
    if _GLOBAL_MEMORY_BUFFER is not None:
        raise AssertionError("global memory buffer is already initialized")
    _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()


def _set_global_symmetric_memory_buffer():
    """Create the global symmetric memory buffer over the tensor-parallel group (needs
    megatron-core and a GPU build of torch with symmetric memory)."""
    global _GLOBAL_SYMMETRIC_MEMORY_BUFFER
    if _GLOBAL_SYMMETRIC_MEMORY_BUFFER is not None:
        raise AssertionError("global symmetric memory buffer is already initialized")
    from megatron.core.utils import GlobalSymmetricMemoryBuffer

    _GLOBAL_SYMMETRIC_MEMORY_BUFFER = GlobalSymmetricMemoryBuffer(
        size_in_mb=256, process_group=get_tensor_model_parallel_group()
    )


def get_global_memory_buffer():
    """The global memory buffer."""
    return _required(_GLOBAL_MEMORY_BUFFER, "global memory buffer")


def get_global_symmetric_memory_buffer():
    """The global symmetric memory buffer."""
    return _required(_GLOBAL_SYMMETRIC_MEMORY_BUFFER, "global symmetric memory buffer")


def destroy_global_memory_buffer():
    """Drop the global memory buffer."""
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = None


def destroy_global_symmetric_memory_buffer():
    """Drop the global symmetric memory buffer."""
    global _GLOBAL_SYMMETRIC_MEMORY_BUFFER
    _GLOBAL_SYMMETRIC_MEMORY_BUFFER = None


def get_all_ranks():
    """This rank's tp, dp, cp, pp and ep ranks joined by ``_`` (e.g. ``'1_0_0_2_0'``)."""
    ranks = [
        get_tensor_model_parallel_rank(),
        get_data_parallel_rank(),
        get_context_parallel_rank(),
        get_pipeline_model_parallel_rank(),
        get_expert_model_parallel_rank(),
    ]
    return "_".join(str(r or 0) for r in ranks)


def destroy_model_parallel():
    """Destroy every group ``initialize_model_parallel`` created and reset the module state."""
    global _STATE, _GLOBAL_MEMORY_BUFFER, _GLOBAL_SYMMETRIC_MEMORY_BUFFER
    state, _STATE = _STATE, None
    _publish(None)
    g = globals()
    for name in _OVERRIDE_GLOBALS:
        g[name] = None
    _GLOBAL_MEMORY_BUFFER = None
    _GLOBAL_SYMMETRIC_MEMORY_BUFFER = None
    if state is not None:
        _DETACHED.pop(id(state), None)
        _state.destroy_state(state)
