"""What Megatron's pg_collection path still needs besides the collection, without private MCore calls.

:func:`ensure_global_memory_buffer` (the scratch buffer ``DotProductAttention`` reads) and
:func:`megatron_schedule` (the schedule ``get_forward_backward_func`` would pick, with
``pg_collection=`` and ``p2p_communicator=``). Release data:
:mod:`parallel_state_ng.releases.new_code_path`; megatron-core is imported only when these run.
See docs/compat.md ("The rest of the pg_collection set-up").
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch.distributed as dist

from parallel_state_ng.builders.collection import MegatronGroups, NoCollectionError
from parallel_state_ng.releases import Release, as_release
from parallel_state_ng.releases import new_code_path as facts

__all__ = ["ensure_global_memory_buffer", "MegatronSchedule", "megatron_schedule"]

_PARALLEL_STATE = "megatron.core.parallel_state"


def ensure_global_memory_buffer() -> Any:
    """Megatron's global memory buffer, created if there is none yet; returns it.

    The buffer belongs to the ``megatron.core.parallel_state`` module Megatron's code reads:
    compat's after ``compat.install()``, Megatron's own otherwise. Idempotent, and it works
    inside a no-globals scope (the buffer is scratch memory of no grid). Call it after any
    ``initialize_model_parallel`` of the job: that function refuses to run while a buffer
    exists (in MCore and in compat), and reuses none.

    Raises:
        ImportError: megatron-core is not importable.
    """
    ps = importlib.import_module(_PARALLEL_STATE)
    if getattr(ps, "_GLOBAL_MEMORY_BUFFER", None) is None:
        ps._set_global_memory_buffer()
    return ps.get_global_memory_buffer()


@dataclass(frozen=True)
class MegatronSchedule:
    """The schedule Megatron's ``get_forward_backward_func`` picks for a collection, with its arguments.

    ``forward_backward_func`` is the schedule function, ``pp_size`` / ``vp_size`` the pipeline
    and virtual-pipeline sizes it was picked for, ``kwargs`` the group arguments it takes
    (``pg_collection``, and ``p2p_communicator`` where the release's function takes it).
    Calling the object calls the function with ``kwargs`` and the caller's arguments
    (``forward_step_func``, ``data_iterator``, ``model``, ``num_microbatches``, ...).
    """

    forward_backward_func: Callable[..., Any]
    pp_size: int
    vp_size: int | None
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, **kwargs: Any) -> Any:
        """Run the schedule: ``forward_backward_func(**self.kwargs, **kwargs)``.

        Raises:
            TypeError: ``kwargs`` repeats one of ``self.kwargs``.
        """
        clash = sorted(set(kwargs) & set(self.kwargs))
        if clash:
            raise TypeError(f"{clash} are set by this MegatronSchedule already (its kwargs); do not pass them again")
        return self.forward_backward_func(**self.kwargs, **kwargs)


def megatron_schedule(collection: Any, config: Any, *, release: str | Release | None = None) -> MegatronSchedule:
    """The training schedule for a module's ``ProcessGroupCollection``, as ``get_forward_backward_func`` picks it.

    ``collection`` is a ``ProcessGroupCollection`` (or a :class:`MegatronGroups`, whose
    :meth:`~MegatronGroups.collection` is used); ``config`` the model's ``ModelParallelConfig``
    / ``TransformerConfig``. The pipeline size is the size of ``collection.pp``, the virtual
    pipeline size ``config.virtual_pipeline_model_parallel_size``; no global is read (on 0.15,
    whose ``get_forward_backward_func`` takes no sizes, the function is picked by the same
    rule). ``release`` names the installed megatron-core's series (default: the one compat
    serves, see :func:`parallel_state_ng.releases.select_release`).

    Raises:
        NoCollectionError: the release has no pg_collection path (before 0.15).
        TypeError: ``config`` has no ``virtual_pipeline_model_parallel_size``, or ``collection``
            no ``pp`` group.
        ValueError: ``config.pipeline_model_parallel_size`` differs from the collection's
            pipeline size, or a virtual pipeline size is set without pipelining.
        ImportError: megatron-core is not importable.
    """
    series = as_release(release).series
    if series not in facts.FORWARD_BACKWARD_FUNC_PARAMS:
        raise NoCollectionError(
            f"megatron-core {series} has no pg_collection schedule path (from 0.15 on); "
            f"its schedules read parallel_state's globals"
        )
    if isinstance(collection, MegatronGroups):
        collection = collection.collection()
    pp_group = getattr(collection, "pp", None)
    if pp_group is None:
        raise TypeError(f"collection must be a ProcessGroupCollection with a pp group, got {collection!r}")
    if not hasattr(config, "virtual_pipeline_model_parallel_size"):
        raise TypeError(
            f"config must be Megatron's ModelParallelConfig / TransformerConfig "
            f"(with virtual_pipeline_model_parallel_size), got {type(config).__name__}"
        )
    pp_size = dist.get_world_size(pp_group)
    vp_size = config.virtual_pipeline_model_parallel_size
    config_pp = getattr(config, "pipeline_model_parallel_size", pp_size)
    if config_pp != pp_size:
        raise ValueError(
            f"config.pipeline_model_parallel_size ({config_pp}) differs from the collection's pipeline "
            f"size ({pp_size}, the size of collection.pp): build the config for this module's groups"
        )
    if vp_size is not None and pp_size == 1:
        raise ValueError(
            f"config.virtual_pipeline_model_parallel_size is {vp_size} but the collection has no pipeline "
            f"(pp size 1): a virtual pipeline needs pipeline_model_parallel_size > 1"
        )
    schedules = importlib.import_module(facts.SCHEDULE_MODULE)
    if facts.FORWARD_BACKWARD_FUNC_PARAMS[series][:2] == ("pp_size", "vp_size"):
        func = schedules.get_forward_backward_func(pp_size=pp_size, vp_size=vp_size)
    else:
        no_pp, one_f_one_b, interleaved = facts.SCHEDULE_FUNCTIONS
        name = no_pp if pp_size == 1 else (one_f_one_b if vp_size is None else interleaved)
        func = getattr(schedules, name)
    kwargs: dict[str, Any] = {"pg_collection": collection}
    if func.__name__ in facts.P2P_COMMUNICATOR_TAKERS[series]:
        module, cls, _ = facts.P2P_COMMUNICATOR[series]
        communicator = getattr(importlib.import_module(module), cls)
        kwargs["p2p_communicator"] = communicator(pp_group=pp_group, config=config)
    return MegatronSchedule(func, pp_size, vp_size, MappingProxyType(kwargs))
