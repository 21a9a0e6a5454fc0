"""Export compat's process groups as Megatron-Core's ``ProcessGroupCollection``.

:func:`to_process_group_collection` fills one from compat's state (the active grid or any
other) as ``ProcessGroupCollection.use_mpu_process_groups()`` would fill it from the globals
(:data:`FIELD_GLOBALS`); megatron-core is imported only when it is called. See docs/compat.md
("Collections").
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence
from typing import Any

from parallel_state_ng.groups.megatron_groups import ModelParallelGroups
from parallel_state_ng.layout.kinds import fills
from parallel_state_ng.releases import process_groups_config as facts

from . import parallel_state as ps
from ._release import RELEASE

__all__ = ["to_process_group_collection", "FIELD_GLOBALS", "FIELDS", "UnknownCollectionFieldError"]


class UnknownCollectionFieldError(RuntimeError):
    """The installed ``ProcessGroupCollection`` has a field compat does not know how to fill."""


#: Field -> the module global ``use_mpu_process_groups()`` fills it from (the group-kind table).
FIELD_GLOBALS: dict[str, str] = {fill.collection: fill.name for _, fill in fills() if fill.collection}
#: Every field some supported release's collection has.
_KNOWN_FIELDS = frozenset(field for fields in facts.COLLECTION_FIELDS.values() for field in fields)
#: The ``ProcessGroupCollection`` fields of the served release.
FIELDS: tuple[str, ...] = facts.collection_fields(RELEASE)


def _field_value(name: str) -> Any:
    """The value of field ``name`` read from the active grid's globals, as MCore reads it."""
    global_name = FIELD_GLOBALS.get(name)
    value = None if global_name is None else getattr(ps, global_name, None)
    if value is None and name in facts.STRICT_FIELDS:
        raise AssertionError(f"the {global_name} behind ProcessGroupCollection.{name} is not initialized")
    return value


def _collection_class() -> type:
    class_name = facts.COLLECTION_CLASS[RELEASE.series]
    module = importlib.import_module("megatron.core.process_groups_config")
    if class_name is None:
        raise ImportError(
            f"megatron-core {RELEASE.version} has no ProcessGroupCollection (added in 0.15); "
            f"its megatron.core.process_groups_config has ModelCommProcessGroups / GradCommProcessGroups"
        )
    return getattr(module, class_name)


def _collection_fields(cls: type) -> list[str]:
    if not dataclasses.is_dataclass(cls):
        raise UnknownCollectionFieldError(
            f"{cls.__module__}.{cls.__qualname__} is not a dataclass: cannot derive its fields"
        )
    return [f.name for f in dataclasses.fields(cls)]


def to_process_group_collection(
    state: ModelParallelGroups | None = None, required_pgs: Sequence[str] | None = None
) -> Any:
    """A ``ProcessGroupCollection`` holding ``state``'s groups.

    Args:
        state: the grid to export; ``None`` (default) exports the active one, reading the
            getters exactly as ``ProcessGroupCollection.use_mpu_process_groups()`` would after
            :func:`compat.install`. Another state is read through
            ``compat.parallel_state.use_state(state)``, so the active grid is left as it was.
        required_pgs: fill only these fields (default: every field of the installed class).

    Every field of the installed class is set to the group the served release pairs with it
    (``tp`` ← tensor-parallel group, ``expt_dp`` ← expert-data-parallel group, ``intra_dp_cp`` ←
    the partial data-parallel group, 0.19 ``dp_cp_gtp_remat`` ← the data-parallel group
    spanning the GTP axis, ...); fields of groups the grid lacks (``embd`` off the embedding
    stages, ``inter_dist_opt`` with one optimizer instance, ``hcp`` without hierarchical
    context parallelism, the all-gather groups of 0.18+) are ``None``, as MCore leaves them.

    Raises:
        ImportError: the served release (0.12–0.14) has no ``ProcessGroupCollection``.
        ValueError: ``required_pgs`` names a field the installed class does not have.
        UnknownCollectionFieldError: the installed class has a field compat cannot fill (a newer
            megatron-core); nothing is silently skipped.
        AssertionError: the grid is not initialized (no data-parallel group), as in MCore.
    """
    cls = _collection_class()
    fields = _collection_fields(cls)
    unknown = [name for name in fields if name not in _KNOWN_FIELDS]
    if unknown:
        raise UnknownCollectionFieldError(
            f"ProcessGroupCollection of the installed megatron-core has field(s) {unknown} that "
            f"compat.pg_collection cannot fill (known: {sorted(_KNOWN_FIELDS)}); add them to "
            f"parallel_state_ng.releases.process_groups_config.COLLECTION_FIELDS and to the "
            f"global that fills them in parallel_state_ng.layout.kinds.GROUP_KINDS"
        )
    if required_pgs is None:
        wanted = fields
    else:
        wanted = list(required_pgs)
        invalid = [name for name in wanted if name not in fields]
        if invalid:
            raise ValueError(f"required_pgs names unknown ProcessGroupCollection field(s) {invalid}; fields: {fields}")

    def collect() -> dict[str, Any]:
        return {name: _field_value(name) for name in wanted}

    if state is None or state is ps.get_state():
        values = collect()
    else:
        with ps.use_state(state):
            values = collect()
    return cls(**values)
