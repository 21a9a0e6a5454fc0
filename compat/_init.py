"""``initialize_model_parallel`` and ``create_all_gather_groups`` of ``compat.parallel_state``.

One implementation with the union of every release's parameters; a parameter the served
release lacks keeps its default, which means what that release does (no hybrid groups, no
all-gather group, no offset, GTP sizes 1). The layout (``MegatronLayout`` for the served
release) rejects arguments the release does not have.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from parallel_state_ng.groups.megatron_groups import ModelParallelGroups, add_group
from parallel_state_ng.groups.nccl_config import check_nccl_config
from parallel_state_ng.groups.pipeline import Prepared, agree, build, check_options
from parallel_state_ng.groups.split import creation_path
from parallel_state_ng.groups.torch_support import empty_group_error
from parallel_state_ng.layout.init_args import InitArgs
from parallel_state_ng.layout.kinds import GROUP_KINDS
from parallel_state_ng.layout.megatron_layout import SHAPE_ARGUMENTS, MegatronLayout
from parallel_state_ng.layout.order import EmptyGroupAssertionError, EmptyGroupError
from parallel_state_ng.layout.plan import PlanOptions
from parallel_state_ng.layout.validate import validate_initialize_args

from . import _scoping
from ._expert import set_global_memory_buffer
from ._getters import is_initialized
from ._helpers import get_nccl_options
from ._namespace import facade as ps
from ._release import FACTS, RELEASE, VERSION

__all__: list[str] = []  # served through compat.parallel_state


def _load_nccl_config(path: str | None) -> dict:
    if path is None:
        return {}
    try:
        import yaml
    except ImportError:
        raise RuntimeError(
            "Cannot import `yaml`: nccl_communicator_config_path needs the PyYAML package (pip install pyyaml)"
        ) from None
    with open(path) as stream:
        config = yaml.safe_load(stream)
    if not isinstance(config, dict):
        # MCore fails on it later with TypeError ("argument of type 'NoneType' ...").
        raise TypeError(
            f"nccl_communicator_config_path {path!r} must hold a mapping of group name to options, "
            f"got {type(config).__name__}"
        )
    return config


def _check_sharp(use_sharp: bool, sharp_enabled_group: str | None, n_instances: int) -> str | None:
    """The SHARP group to use (MCore's checks and default)."""
    if use_sharp:
        if sharp_enabled_group is None:
            return "dp"
        if sharp_enabled_group not in ("dp", "dp_replica"):
            raise AssertionError(f"Invalid sharp_enabled_group {sharp_enabled_group!r}: use 'dp' or 'dp_replica'")
        if sharp_enabled_group == "dp_replica" and not n_instances > 1:
            raise AssertionError(
                f"sharp_enabled_group 'dp_replica' requires num_distributed_optimizer_instances > 1, got {n_instances}"
            )
    elif sharp_enabled_group is not None:
        raise AssertionError(f"sharp_enabled_group={sharp_enabled_group!r} is only valid with use_sharp=True")
    return sharp_enabled_group


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_split_rank: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    encoder_tensor_model_parallel_size: int = 0,
    encoder_pipeline_model_parallel_size: int | None = 0,
    get_embedding_ranks: Callable[[list[int], int | None], list[int]] | None = None,
    get_position_embedding_ranks: Callable[[list[int], int | None], list[int]] | None = None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: list[str] | None = None,
    sharp_enabled_group: str | None = None,
    create_all_gather_group: bool | None = False,
    rank_offset: int = 0,
    local_world_size: int | None = None,
) -> None:
    """Build this rank's model- and data-parallel groups (the served release's signature and semantics).

    The world (``torch.distributed``; from 0.17 on the ``local_world_size`` ranks from
    ``rank_offset``) is split into tensor (``tp``), context (``cp``), data (``dp``) and
    pipeline (``pp``) parallel dims (0.19: and the GTP weight-rematerialization axis), and,
    for MoE layers, into expert-tensor, expert (``ep``), expert-data and pipeline dims, laid
    out by ``order`` (first token varies fastest). Every argument means what it means in the
    served megatron-core release (``compat.parallel_state.MEGATRON_VERSION``).

    Unlike MCore: all arguments are checked before any group is created; the rank creates
    only the groups it belongs to; a failure destroys whatever was created and leaves the
    module uninitialized; and a later ``destroy_model_parallel`` destroys every group.
    """
    args = InitArgs(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_split_rank=pipeline_model_parallel_split_rank,
        pipeline_model_parallel_comm_backend=pipeline_model_parallel_comm_backend,
        use_sharp=use_sharp,
        context_parallel_size=context_parallel_size,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        hybrid_context_parallel=hybrid_context_parallel,
        expert_model_parallel_size=expert_model_parallel_size,
        gtp_remat_size=gtp_remat_size,
        expert_gtp_remat_size=expert_gtp_remat_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        nccl_communicator_config_path=nccl_communicator_config_path,
        distributed_timeout_minutes=distributed_timeout_minutes,
        order=order,
        encoder_tensor_model_parallel_size=encoder_tensor_model_parallel_size,
        encoder_pipeline_model_parallel_size=encoder_pipeline_model_parallel_size,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        create_gloo_process_groups=create_gloo_process_groups,
        high_priority_stream_groups=high_priority_stream_groups,
        sharp_enabled_group=sharp_enabled_group,
        create_all_gather_group=create_all_gather_group,
        rank_offset=rank_offset,
        local_world_size=local_world_size,
    )
    try:
        state = _build(args)
    except EmptyGroupError as err:  # MCore fails in torch's new_group([]): its exception type is torch's
        if empty_group_error() is AssertionError and not isinstance(err, AssertionError):
            raise EmptyGroupAssertionError(str(err)) from None
        raise
    _publish(state, args)


def _build(args: InitArgs) -> ModelParallelGroups:
    """The pipeline's steps for one call, in one direction: agree, prepare, check options, build."""
    path = creation_path()
    # 1. Every rank must pass the same arguments: compared across the world before anything
    # else, so a mismatch raises on every rank instead of hanging.
    agreed = agree(args.fields(), name=_NAME, creation=path)
    _announce(args)
    # 2. The release's checks and the layout: a pure function of the arguments and the world.
    prepared = _prepare(args, _World.now())
    # What the checks let through touches files and the environment, as MCore does after them.
    prepared = prepared.with_nccl_config(
        _load_nccl_config(args.nccl_communicator_config_path),
        source=f"nccl_communicator_config_path {args.nccl_communicator_config_path!r}",
    )
    if args.pipeline_model_parallel_comm_backend == "ucc":
        _set_ucc_environment()
    check_options(prepared)  # 3. NCCL values the installed NCCL refuses
    # 4. This rank's groups (a rank outside local_world_size gets a state with no group, as in MCore).
    state = build(prepared, name=_NAME, path=path, agreed=agreed, empty_outside=True)
    assert state is not None
    return state


def _publish(state: ModelParallelGroups, args: InitArgs) -> None:
    """The last step: the state becomes the module's, with the globals that are not groups."""
    _scoping.set_active(state)
    if args.pipeline_model_parallel_split_rank is not None:  # 0.12-0.13; kept across destroy, as in MCore
        ps._PIPELINE_MODEL_PARALLEL_SPLIT_RANK = args.pipeline_model_parallel_split_rank
    if args.virtual_pipeline_model_parallel_size is not None:
        ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = args.virtual_pipeline_model_parallel_size
    set_global_memory_buffer()


_NAME = "initialize_model_parallel"


@dataclass(frozen=True)
class _World:
    """What prepare reads of the process: the world and whether the module is initialized already."""

    distributed: bool
    world_size: int
    initialized: bool
    memory_buffer: bool

    @classmethod
    def now(cls) -> _World:
        distributed = dist.is_initialized()
        return cls(
            distributed=distributed,
            world_size=dist.get_world_size() if distributed else 0,
            initialized=ps._DATA_PARALLEL_GROUP is not None or _scoping.get_state() is not None,
            memory_buffer=ps._GLOBAL_MEMORY_BUFFER is not None,
        )


def _announce(args: InitArgs) -> None:
    """What the release does before its checks: the encoder deprecation, the SHARP variable."""
    if args.encoder_tensor_model_parallel_size != 0 or args.encoder_pipeline_model_parallel_size != 0:
        if FACTS.encoder_deprecation_warnings:
            warnings.warn(
                "encoder_tensor_model_parallel_size / encoder_pipeline_model_parallel_size: encoder-specific "
                "pipeline parallelism is deprecated in megatron-core 0.13 and removed in 0.14",
                DeprecationWarning,
                stacklevel=4,  # the caller of initialize_model_parallel (through _build)
            )
    if not FACTS.sharp_collnet_zero:  # 0.14+ starts without the SHARP variable
        os.environ.pop("NCCL_COLLNET_ENABLE", None)


def _prepare(args: InitArgs, world: _World) -> Prepared:
    """``initialize_model_parallel``'s checks (MCore's exception types), its layout and group options.

    Pure: it reads only ``args``, ``world`` and the served release's facts. The NCCL config is
    read from its file afterwards (:meth:`Prepared.with_nccl_config`).
    """
    sharp_enabled_group = _check_sharp(
        args.use_sharp, args.sharp_enabled_group, args.num_distributed_optimizer_instances
    )
    if not world.distributed:
        raise AssertionError("torch.distributed is not initialized: call init_process_group() first")
    args = args.replace(sharp_enabled_group=sharp_enabled_group)
    validate_initialize_args(args)

    vpp, pp = args.virtual_pipeline_model_parallel_size, args.pipeline_model_parallel_size
    if vpp is not None and not pp > 1:
        raise RuntimeError(
            f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 (got {pp}): "
            f"the interleaved schedule interleaves pipeline stages"
        )
    layout = MegatronLayout(
        world_size=world.world_size, release=RELEASE.series, **{name: getattr(args, name) for name in _LAYOUT_ARGS}
    )
    if world.initialized:
        raise AssertionError(
            "data parallel group is already initialized: call destroy_model_parallel() before initializing again"
        )
    cp = args.context_parallel_size
    if args.hybrid_context_parallel and (layout.data_parallel_size * cp) % 2 != 0:
        raise AssertionError(
            f"hybrid_context_parallel needs an even data_parallel_size x context_parallel_size, got "
            f"{layout.data_parallel_size} x {cp}"
        )
    if sharp_enabled_group == "dp" and FACTS.sharp_dp_unusable:
        raise AssertionError(
            f"use_sharp with sharp_enabled_group='dp' fails in megatron-core {VERSION}: its SHARP "
            f"barrier reads the data parallel group with CP (with GTP_remat) before it is initialized"
        )
    backend = args.pipeline_model_parallel_comm_backend
    if backend not in (None, "nccl", "ucc"):
        raise AssertionError(
            f'"{backend}" backend for PP communication is not supported '
            f"(pipeline_model_parallel_comm_backend must be None, 'nccl' or 'ucc')"
        )
    if world.memory_buffer:
        raise AssertionError("global memory buffer is already initialized: call destroy_model_parallel() first")
    return Prepared(
        layout=layout,
        timeout=timedelta(minutes=args.distributed_timeout_minutes),
        options=PlanOptions(
            create_gloo_process_groups=args.create_gloo_process_groups,
            create_all_gather_group=bool(args.create_all_gather_group),
            pipeline_model_parallel_comm_backend=backend,
            sharp_enabled_group=sharp_enabled_group,
            hybrid_context_parallel=args.hybrid_context_parallel,
        ),
        nccl_comm_cfgs={},
        high_priority_stream_groups=args.high_priority_stream_groups or (),
    )


#: The arguments of ``initialize_model_parallel`` that ``MegatronLayout`` takes as they are.
_LAYOUT_ARGS = (
    *SHAPE_ARGUMENTS,
    "rank_offset",
    "local_world_size",
    "encoder_tensor_model_parallel_size",
    "encoder_pipeline_model_parallel_size",
    "pipeline_model_parallel_split_rank",
)


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


def create_all_gather_groups(for_expert_parallelism=False, timeout=None, nccl_comm_cfgs=None):
    """Create the all-gather twins of this rank's data-parallel groups (0.18+); return them.

    Returns ``(dp_cp_ag_group, expt_dp_ag_group)``: the twin of the dp × cp group and, with
    ``for_expert_parallelism`` and expert parallelism > 1, of the expert-data-parallel group
    (else ``None``). As in MCore, the groups are laid out in the default order from rank 0
    with the sizes of the active grid; they are not kept in module globals, but
    ``destroy_model_parallel`` destroys them with the grid.

    Raises:
        RuntimeError: the module is not initialized.
        ValueError: the groups MCore would build contain ranks outside the world (0.19 with a
            GTP size > 1: MCore then asks ``new_group`` for ranks that do not exist).
    """
    state = _scoping.get_state()
    if not is_initialized() or state is None:
        if state is not None and state.creation_path == "split":
            # a rank outside local_world_size: the members' splits need it all the same
            _all_gather_groups(state, for_expert_parallelism, timeout, nccl_comm_cfgs or {})
        raise RuntimeError(
            "create_all_gather_groups() requires parallel state to be initialized: "
            "call initialize_model_parallel() first"
        )
    return _all_gather_groups(state, for_expert_parallelism, timeout, nccl_comm_cfgs or {})


def _all_gather_groups(state: Any, for_expert_parallelism: bool, timeout: Any, cfgs: dict) -> tuple[Any, Any]:
    """The all-gather twins for ``state``'s rank (none, joining the splits, for a rank outside its layout)."""
    layout, rank = state.layout, state.rank
    kinds = ["dp_cp_ag"]
    if for_expert_parallelism and layout.expert_model_parallel_size > 1:
        kinds.append("ep_dp_ag")
    plans = []
    world = dist.get_world_size()
    for kind in kinds:
        # the layout's first rank stands for a rank outside it: the same check as the members'
        members = layout.group(kind, rank if layout.contains(rank) else layout.rank_offset)
        if members is not None and max(members) >= world:
            raise ValueError(
                f"create_all_gather_groups: the {kind} group {members} has ranks outside the world of {world} "
                f"(megatron-core's own function reads the data-parallel size including the GTP axis)"
            )
        plans.append((GROUP_KINDS[kind], members))
    check_nccl_config(
        cfgs, source="create_all_gather_groups(nccl_comm_cfgs=...)", legacy_defaults=layout.facts.nccl_config_defaults
    )
    results = {"dp_cp_ag": None, "ep_dp_ag": None}
    for kind_row, members in plans:  # members None: none on the member path, no colour on the split path
        results[kind_row.name] = add_group(
            state, members, kind_row.desc, timeout=timeout, pg_options=get_nccl_options(kind_row.nccl_key, cfgs)
        )
    return results["dp_cp_ag"], results["ep_dp_ag"]
