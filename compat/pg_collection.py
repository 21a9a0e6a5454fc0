"""Export compat's process groups as Megatron-Core's ``ProcessGroupCollection``.

Newer Megatron-Core code takes its groups from a
``megatron.core.process_groups_config.ProcessGroupCollection`` (``pg_collection=`` arguments of
models, DDP, optimizers) instead of the global ``parallel_state``. MCore fills one from its
globals with ``ProcessGroupCollection.use_mpu_process_groups()``;
:func:`to_process_group_collection` fills one from a compat :class:`~compat._state.ParallelState`
(the active one, or any other grid of the job, see ``compat.parallel_state.use_state``),
every field with the group MCore's method would put there.

megatron-core is imported only when the function is called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Optional

from . import parallel_state as ps
from ._state import ParallelState

__all__ = ["to_process_group_collection", "FIELD_GETTERS", "UnknownCollectionFieldError"]


class UnknownCollectionFieldError(RuntimeError):
    """The installed ``ProcessGroupCollection`` has a field compat does not know how to fill."""


def _field_getters() -> dict[str, Callable[[], Any]]:
    """Field name -> the compat getter call that yields its group (MCore's pairing)."""
    lenient = {"check_initialized": False}
    return {
        "tp": partial(ps.get_tensor_model_parallel_group, **lenient),
        "pp": partial(ps.get_pipeline_model_parallel_group, **lenient),
        "mp": partial(ps.get_model_parallel_group, **lenient),
        "embd": partial(ps.get_embedding_group, **lenient),
        "pos_embd": partial(ps.get_position_embedding_group, **lenient),
        "cp": partial(ps.get_context_parallel_group, **lenient),
        "tp_cp": partial(ps.get_tensor_and_context_parallel_group, **lenient),
        "hcp": partial(ps.get_hierarchical_context_parallel_groups, **lenient),
        "ep": partial(ps.get_expert_model_parallel_group, **lenient),
        "expt_tp": partial(ps.get_expert_tensor_parallel_group, **lenient),
        "tp_ep": partial(ps.get_expert_tensor_and_model_parallel_group, **lenient),
        "tp_ep_pp": partial(ps.get_expert_tensor_model_pipeline_parallel_group, **lenient),
        "tp_dp_cp": partial(ps.get_tensor_and_data_parallel_group, with_context_parallel=True, **lenient),
        # the data-parallel getters have no lenient mode: uninitialized raises, as in MCore
        "dp": ps.get_data_parallel_group,
        "dp_cp": partial(ps.get_data_parallel_group, with_context_parallel=True),
        "intra_dp_cp": partial(ps.get_data_parallel_group, with_context_parallel=True, partial_data_parallel=True),
        "expt_dp": partial(ps.get_expert_data_parallel_group, **lenient),
        "intra_expt_dp": partial(ps.get_expert_data_parallel_group, partial_expert_data_parallel=True, **lenient),
        "inter_dist_opt": partial(ps.get_inter_distributed_optimizer_instance_group, **lenient),
        "intra_dist_opt": partial(ps.get_intra_distributed_optimizer_instance_group, **lenient),
    }


#: The ``ProcessGroupCollection`` fields compat can fill (megatron-core 0.16.1's set).
FIELD_GETTERS: tuple[str, ...] = tuple(_field_getters())


def _collection_fields(cls: type) -> list[str]:
    if not dataclasses.is_dataclass(cls):
        raise UnknownCollectionFieldError(
            f"{cls.__module__}.{cls.__qualname__} is not a dataclass: cannot derive its fields"
        )
    return [f.name for f in dataclasses.fields(cls)]


def to_process_group_collection(
    state: Optional[ParallelState] = None, required_pgs: Optional[Sequence[str]] = None
) -> Any:
    """A ``ProcessGroupCollection`` holding ``state``'s groups.

    Args:
        state: the grid to export; ``None`` (default) exports the active one, reading the
            getters exactly as ``ProcessGroupCollection.use_mpu_process_groups()`` would after
            :func:`compat.install`. Another state is read through
            ``compat.parallel_state.use_state(state)``, so the active grid is left as it was.
        required_pgs: fill only these fields (default: every field of the installed class).

    Every field of the installed class is set to the group MCore pairs with it (``tp`` ←
    tensor-parallel group, ``expt_dp`` ← expert-data-parallel group, ``intra_dp_cp`` ← the
    partial data-parallel group, ...); fields of groups the grid lacks (``embd`` off the
    embedding stages, ``inter_dist_opt`` with one optimizer instance, ``hcp`` without
    hierarchical context parallelism) are ``None``, as MCore leaves them.

    Raises:
        ValueError: ``required_pgs`` names a field the installed class does not have.
        UnknownCollectionFieldError: the installed class has a field compat cannot fill (a newer
            megatron-core); nothing is silently skipped.
        AssertionError: the grid is not initialized (no data-parallel group), as in MCore.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    fields = _collection_fields(ProcessGroupCollection)
    getters = _field_getters()
    unknown = [name for name in fields if name not in getters]
    if unknown:
        raise UnknownCollectionFieldError(
            f"ProcessGroupCollection of the installed megatron-core has field(s) {unknown} that "
            f"compat.pg_collection cannot fill (known: {sorted(getters)}); add them to _field_getters"
        )
    if required_pgs is None:
        wanted = fields
    else:
        wanted = list(required_pgs)
        invalid = [name for name in wanted if name not in fields]
        if invalid:
            raise ValueError(f"required_pgs names unknown ProcessGroupCollection field(s) {invalid}; fields: {fields}")

    def collect() -> dict[str, Any]:
        return {name: getters[name]() for name in wanted}

    if state is None or state is ps.get_state():
        values = collect()
    else:
        with ps.use_state(state):
            values = collect()
    return ProcessGroupCollection(**values)
