"""One module's Megatron process groups with no module global: a ``ProcessGroupCollection`` in one call.

:func:`build_megatron_groups` creates on this rank exactly the groups ``initialize_model_parallel``
would create over ``[rank_offset, rank_offset + world_size)`` with compat's guarantees, touching
no module global; :meth:`MegatronGroups.collection` (the only megatron import) fills the release's
``ProcessGroupCollection`` as ``use_mpu_process_groups()`` would. See docs/compat.md.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from parallel_state_ng.builders.scope import Scope, no_globals
from parallel_state_ng.groups.handles import GroupHandle
from parallel_state_ng.groups.megatron_groups import ModelParallelGroups, destroy_model_groups, global_values
from parallel_state_ng.groups.pipeline import Prepared, agree, build, check_options, layout_participants
from parallel_state_ng.groups.sleep import SleepReport
from parallel_state_ng.groups.sleep import sleep as sleep_groups
from parallel_state_ng.groups.sleep import wake as wake_groups
from parallel_state_ng.groups.split import creation_path as creation_path_of
from parallel_state_ng.layout.init_args import InitArgs
from parallel_state_ng.layout.kinds import fills
from parallel_state_ng.layout.megatron_layout import SHAPE_ARGUMENTS, MegatronLayout
from parallel_state_ng.layout.plan import PlanOptions
from parallel_state_ng.layout.validate import validate_initialize_args
from parallel_state_ng.releases import Release, as_release
from parallel_state_ng.releases import process_groups_config as collection_facts

__all__ = ["MegatronGroups", "build_megatron_groups", "FIELD_GLOBALS", "NoCollectionError"]

#: ``ProcessGroupCollection`` field -> the Megatron module global ``use_mpu_process_groups()``
#: reads it from (from the group-kind table). Fields missing here (0.18+'s all-gather groups)
#: are left ``None`` by MCore.
FIELD_GLOBALS: dict[str, str] = {fill.collection: fill.name for _, fill in fills() if fill.collection}


class NoCollectionError(ImportError):
    """The release has no ``ProcessGroupCollection`` (0.12–0.14), or megatron-core is not importable."""


class MegatronGroups:
    """This rank's Megatron process groups for one module (a layout over a range of ranks).

    Made by :func:`build_megatron_groups`. ``layout`` is the
    :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout`, ``release`` the megatron-core
    release whose creation order and collection fields are followed, ``rank`` this process's
    global rank and ``is_member`` whether it lies in the module's ranks (a rank outside holds
    no group). Not a global: any number can live side by side.
    """

    def __init__(self, layout: MegatronLayout, rank: int, groups: ModelParallelGroups | None) -> None:
        self.layout = layout
        self.rank = rank
        self.release: Release = as_release(layout.release)
        self._groups = groups

    @property
    def is_member(self) -> bool:
        """Whether this rank is one of the module's ranks (and holds its groups)."""
        return self._groups is not None

    @property
    def destroyed(self) -> bool:
        """Whether :meth:`destroy` has run."""
        return self._groups is None and self.layout.contains(self.rank)

    def _state(self) -> ModelParallelGroups:
        if self._groups is None:
            first = self.layout.rank_offset
            last = first + self.layout.layout_world_size - 1
            if self.layout.contains(self.rank):
                raise RuntimeError(f"these Megatron groups (ranks {first}..{last}) were destroyed")
            raise RuntimeError(
                f"rank {self.rank} is not among this module's ranks {first}..{last}: it holds none of its groups"
            )
        return self._groups

    @property
    def state(self) -> ModelParallelGroups:
        """The underlying groups and rank lists, keyed by group kind."""
        return self._state()

    def group(self, kind: str) -> Any:
        """This rank's group of ``kind`` (a key of ``GROUP_KINDS``, ``"dp_gloo"`` for a gloo twin) or ``None``."""
        return self._state().group(kind)

    def ranks(self, kind: str) -> list[int] | None:
        """The members of this rank's group of ``kind``, in MCore's order, or ``None``."""
        return self._state().ranks.get(kind)

    def handle(self, kind: str) -> GroupHandle:
        """A :class:`~parallel_state_ng.groups.handles.GroupHandle` for this rank's group of ``kind``."""
        return self._state().handle(kind)

    def field_values(self) -> dict[str, Any]:
        """Every collection field of the release -> its group (``None`` where MCore leaves it unset).

        The same pairing ``use_mpu_process_groups()`` makes from the module globals after an
        ``initialize_model_parallel`` with these arguments, computed from this object's groups.
        """
        values = global_values(self._state(), {})
        out: dict[str, Any] = {}
        for name in collection_facts.collection_fields(self.release):
            global_name = FIELD_GLOBALS.get(name)
            out[name] = None if global_name is None else values.get(global_name)
        return out

    def field_ranks(self) -> dict[str, Any]:
        """Every collection field -> the ranks of its group (a list of lists for ``hcp``; ``None`` if unset)."""

        def ranks_of(value: Any) -> Any:
            if value is None:
                return None
            if isinstance(value, list):
                return [ranks_of(v) for v in value]
            return dist.get_process_group_ranks(value)

        return {name: ranks_of(value) for name, value in self.field_values().items()}

    def collection(self) -> Any:
        """This rank's groups as the release's ``megatron.core.process_groups_config.ProcessGroupCollection``.

        Raises:
            NoCollectionError: the release has no ``ProcessGroupCollection`` (0.12–0.14), or
                megatron-core cannot be imported.
            ValueError: the installed megatron-core's collection has other fields than the
                release's (a different release is installed than the one these groups follow).
            RuntimeError: this rank is not one of the module's ranks, or the groups were destroyed.
        """
        values = self.field_values()
        class_name = collection_facts.COLLECTION_CLASS[self.release.series]
        if class_name is None:
            raise NoCollectionError(
                f"megatron-core {self.release.series} has no ProcessGroupCollection (added in 0.15); "
                f"use the groups directly (MegatronGroups.group / .handle) or release='0.15' or later"
            )
        try:
            module = importlib.import_module("megatron.core.process_groups_config")
        except ImportError as err:
            raise NoCollectionError(f"megatron-core is not importable ({err}); pip install megatron-core") from err
        cls = getattr(module, class_name)
        fields = list(getattr(cls, "__dataclass_fields__", {}))
        if set(fields) != set(values):
            raise ValueError(
                f"the installed megatron-core's {class_name} has fields {fields}, but megatron-core "
                f"{self.release.series}'s are {list(values)}: build the groups with the installed "
                f"release (release=None)"
            )
        return cls(**values)

    def scope(self) -> AbstractContextManager[Scope]:
        """A ``with`` block for running this module's code: Megatron's globals refuse to answer in it.

        Inside it, a ``compat.parallel_state`` getter (reached from Megatron code after
        ``compat.install()``) raises :class:`~parallel_state_ng.builders.scope.GlobalStateRefusedError`
        naming the getter and this module instead of answering for the grid behind the globals;
        see :func:`~parallel_state_ng.builders.scope.no_globals`. Nestable, restored on exit (also
        after an exception); ``compat.parallel_state.use_state(state)`` re-opens a grid inside it.

        Raises:
            RuntimeError: the groups were destroyed.
        """
        if self.destroyed:
            self._state()
        return no_globals(self, frames_up=1)

    def sleep(self, *, timeout: float = 60.0) -> SleepReport:
        """Put this module's groups to sleep (the same objects stay in every collection and handle).

        Every rank of the world calls it, a rank outside the module too (it sleeps nothing);
        see :func:`parallel_state_ng.groups.sleep.sleep` for the mechanism, the report and the errors.
        """
        return sleep_groups(self._groups.created if self._groups is not None else [], timeout=timeout)

    def wake(self, *, timeout: float = 60.0) -> SleepReport:
        """Wake this module's groups (every rank of the world calls it); see :meth:`sleep`."""
        return wake_groups(self._groups.created if self._groups is not None else [], timeout=timeout)

    def destroy(self) -> int:
        """Destroy every group this object created on this rank; returns how many. Idempotent."""
        groups, self._groups = self._groups, None
        return 0 if groups is None else destroy_model_groups(groups)

    def __enter__(self) -> MegatronGroups:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        lay = self.layout
        first, size = lay.rank_offset, lay.layout_world_size
        what = "member" if self.is_member else "not a member"
        return (
            f"MegatronGroups(ranks {first}..{first + size - 1}, tp={lay.tensor_model_parallel_size}, "
            f"pp={lay.pipeline_model_parallel_size}, cp={lay.context_parallel_size}, dp={lay.data_parallel_size}, "
            f"ep={lay.expert_model_parallel_size}, order={lay.order!r}, release {self.release.series}; "
            f"rank {self.rank}: {what})"
        )


def build_megatron_groups(
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: Sequence[int] | None = None,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Callable[[list[int], int | None], list[int]] | None = None,
    get_position_embedding_ranks: Callable[[list[int], int | None], list[int]] | None = None,
    rank_offset: int = 0,
    world_size: int | None = None,
    create_gloo_process_groups: bool = False,
    create_embedding_groups: bool = True,
    nccl_comm_cfgs: dict[str, dict[str, Any]] | None = None,
    high_priority_stream_groups: Sequence[str] | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    distributed_timeout_minutes: float = 30,
    release: str | Release | None = None,
    check_agreement_across_ranks: bool | None = None,
    creation_path: str | None = None,
) -> MegatronGroups:
    """Create this rank's Megatron groups for one module over ``[rank_offset, rank_offset + world_size)``.

    The sizes, ``order``, expert and GTP sizes, embedding-rank functions and options mean what
    they mean to ``initialize_model_parallel`` of ``release`` (default: the release compat
    serves, see :func:`parallel_state_ng.releases.select_release`); ``world_size`` is the
    module's number of ranks (default: every rank from ``rank_offset`` to the end of the
    world). Call it on every rank of the world or only on the module's ranks: a rank outside
    them gets an object with no groups and does not communicate.

    ``create_gloo_process_groups`` is off by default (a ``ProcessGroupCollection`` has no gloo
    field and Megatron's optimizer refuses gloo groups next to one); on, the gloo twins are
    created as MCore creates them (:meth:`MegatronGroups.group` with ``"dp_gloo"`` ...).
    ``create_embedding_groups=False`` leaves out the embedding and position-embedding groups
    (their fields are ``None``): a module without word embeddings, such as a vision encoder.
    ``nccl_comm_cfgs`` is the parsed NCCL communicator config (MCore's YAML file as a dict).

    ``check_agreement_across_ranks`` (default: on unless turned off with
    ``PSNG_AGREEMENT_CHECK=0``) compares the arguments across the module's ranks first, so a
    rank that disagrees makes every rank raise instead of hanging.

    ``creation_path`` (``"auto"``, ``"member"`` or ``"split"``; default ``$PSNG_CREATION_PATH``,
    else ``"auto"``): how groups are created, see docs/results/gpus.md. On the split path (a default
    group bound to a device, e.g. NCCL with ``init_process_group(device_id=...)``) every rank of
    the world must call this function, the module's and the others.

    Raises:
        TypeError, ValueError, AssertionError, RuntimeError: a bad argument or an impossible
            layout (MCore's exception types, see :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout`);
            nothing has been created.
        ParallelConfigMismatchError: the module's ranks passed different arguments.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("build_megatron_groups needs torch.distributed: call init_process_group() first")
    args = InitArgs(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        gtp_remat_size=gtp_remat_size,
        expert_gtp_remat_size=expert_gtp_remat_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
        order=order,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        rank_offset=rank_offset,
        local_world_size=world_size,
        create_gloo_process_groups=create_gloo_process_groups,
        high_priority_stream_groups=None if high_priority_stream_groups is None else list(high_priority_stream_groups),
        pipeline_model_parallel_comm_backend=pipeline_model_parallel_comm_backend,
        distributed_timeout_minutes=distributed_timeout_minutes,
    )
    path = creation_path_of(creation_path)
    # 1. prepare: the module's checks (MCore's exception types) and its layout, before any exchange
    prepared = _prepare(args, create_embedding_groups, nccl_comm_cfgs, release, dist.get_world_size())
    check_options(prepared)  # 2. NCCL values the installed NCCL refuses
    layout, rank = prepared.layout, dist.get_rank()
    agreed = None
    if layout.contains(rank) or path == "split":  # 3. the module's ranks (the world, splitting) agree
        fields = {
            **args.fields(),
            "world_size": world_size,
            "create_embedding_groups": create_embedding_groups,
            "nccl_comm_cfgs": nccl_comm_cfgs,
            "release": layout.release,
        }
        agreed = agree(
            fields,
            name=_NAME,
            ranks=layout_participants(layout, path),
            enabled=check_agreement_across_ranks,
            creation=path,
        )
    groups = build(prepared, name=_NAME, path=path, agreed=agreed, rank=rank)  # 4. this rank's groups
    return MegatronGroups(layout, rank, groups)  # 5. publish: an object, no global


_NAME = "build_megatron_groups"


def _prepare(
    args: InitArgs,
    create_embedding_groups: bool,
    nccl_comm_cfgs: dict[str, dict[str, Any]] | None,
    release: str | Release | None,
    total: int,
) -> Prepared:
    """``build_megatron_groups``' checks (MCore's exception types), the module's layout and group options.

    Pure: it reads only its arguments (``total``: the world's size).
    """
    validate_initialize_args(args)
    backend = args.pipeline_model_parallel_comm_backend
    if nccl_comm_cfgs is not None and not isinstance(nccl_comm_cfgs, dict):
        raise TypeError(f"nccl_comm_cfgs must be a dict of group name -> options, got {nccl_comm_cfgs!r}")
    if backend not in (None, "nccl", "ucc"):
        raise ValueError(f"pipeline_model_parallel_comm_backend must be None, 'nccl' or 'ucc', got {backend!r}")
    rank_offset, world_size = args.rank_offset, args.local_world_size
    if world_size is None:
        world_size = total - rank_offset if isinstance(rank_offset, int) else None
    if isinstance(world_size, int) and rank_offset + world_size > total:
        raise ValueError(
            f"rank_offset ({rank_offset}) + world_size ({world_size}) = {rank_offset + world_size} "
            f"exceeds the {total} ranks of torch.distributed's world"
        )
    return Prepared(
        layout=_layout(args, total, world_size, release),
        timeout=timedelta(minutes=args.distributed_timeout_minutes),
        options=PlanOptions(
            create_gloo_process_groups=args.create_gloo_process_groups,
            embedding_groups=create_embedding_groups,
            pipeline_model_parallel_comm_backend=backend,
        ),
        nccl_comm_cfgs=nccl_comm_cfgs or {},
        high_priority_stream_groups=tuple(args.high_priority_stream_groups or ()),
    )


def _layout(args: InitArgs, total: int, world_size: int | None, release: str | Release | None) -> MegatronLayout:
    """The module's :class:`MegatronLayout`; ranges other than the whole world need 0.17+."""
    series = as_release(release).series
    whole_world = args.rank_offset == 0 and world_size == total
    common = {name: getattr(args, name) for name in SHAPE_ARGUMENTS}
    if whole_world:
        return MegatronLayout(world_size=total, release=series, **common)
    try:
        return MegatronLayout(
            world_size=total, rank_offset=args.rank_offset, local_world_size=world_size, release=series, **common
        )
    except TypeError as err:
        if "rank_offset" not in str(err):
            raise
        raise TypeError(
            f"megatron-core {series} cannot place a module on part of the world "
            f"(rank_offset={args.rank_offset}, world_size={world_size}, world {total}): its layout has no "
            f"rank offset (added in 0.17); use release='0.17' or later, or the whole world"
        ) from None
