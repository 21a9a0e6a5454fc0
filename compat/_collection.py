"""Serve a ``ProcessGroupCollection`` as ``compat.parallel_state``'s globals: :func:`use_collection`.

The collection's groups become compat's state for a ``with`` block, strictly: the layout is
read back from the groups' member lists and checked (:func:`parallel_state_ng.layout.from_groups.infer_layout`),
the ranks agree on it, a getter whose field the collection lacks raises as before
initialization, and leaving the block restores the previous state (:func:`compat._scoping.use_state`).
Not MCore API. See docs/compat.md ("Serving a ProcessGroupCollection").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from parallel_state_ng.groups.agreement_protocol import ParallelConfigMismatchError
from parallel_state_ng.groups.megatron_groups import ModelParallelGroups
from parallel_state_ng.groups.pipeline import agree
from parallel_state_ng.layout.from_groups import FIELD_KINDS, InconsistentCollectionError, infer_layout
from parallel_state_ng.layout.kinds import GROUP_KINDS

from ._release import RELEASE
from ._scoping import use_state

__all__ = ["use_collection", "collection_state", "InconsistentCollectionError"]

# The GTP data-parallel kinds (0.19), each with the layout's size of its GTP axis: at size 1
# their globals are MCore's aliases of the plain data-parallel groups, and their fallbacks in
# the kind table are what MCore publishes then. They are left unset, not taken from a field:
# ``dp_cp_gtp_remat`` holds the dp x cp group then, and would stand in for the partial
# (intra-instance) group MCore aliases to ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP``
# (``expt_dp_gtp_remat`` likewise for the expert one).
_GTP_ALIASES = {
    "gtp_remat_dp": "gtp_remat_size",
    "gtp_remat_dp_cp": "gtp_remat_size",
    "ep_gtp_remat_dp": "expert_gtp_remat_size",
}


def _aliased(kind: str, layout: Any) -> bool:
    """Whether ``kind`` is a GTP data-parallel kind whose axis has size 1 in ``layout``."""
    return kind in _GTP_ALIASES and getattr(layout, _GTP_ALIASES[kind]) == 1


_AGREEMENT_NAME = "compat.use_collection"


def _field_names(pgc: Any) -> list[str]:
    """The fields of ``pgc`` that hold groups (a dataclass's fields, else the known ones it has)."""
    if dataclasses.is_dataclass(pgc) and not isinstance(pgc, type):
        names = [f.name for f in dataclasses.fields(pgc)]
        unknown = [n for n in names if n not in FIELD_KINDS]
        if unknown:
            raise InconsistentCollectionError(
                f"{type(pgc).__qualname__} has field(s) {unknown} that use_collection cannot serve "
                f"(known: {sorted(FIELD_KINDS)})"
            )
        return names
    return [n for n in FIELD_KINDS if hasattr(pgc, n)]


def _members(name: str, group: Any) -> list[int]:
    """The global ranks of ``group`` (field ``name``), or an error naming the field."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise InconsistentCollectionError(
            f"field {name!r} holds a group this rank is not a member of (torch's NON_GROUP_MEMBER)"
        )
    try:
        return list(dist.get_process_group_ranks(group))
    except (ValueError, KeyError, RuntimeError, AttributeError, TypeError) as exc:
        raise InconsistentCollectionError(
            f"field {name!r} holds {group!r}, which is no process group of this process's world "
            f"(destroyed, or made for another world): {exc}"
        ) from exc


def _read(pgc: Any) -> tuple[dict[str, Any], dict[str, list[int]]]:
    """(field -> group, field -> member list) of the fields ``pgc`` sets; ``hcp`` as ``hcp0``, ``hcp1``, ..."""
    groups: dict[str, Any] = {}
    members: dict[str, list[int]] = {}
    for name in _field_names(pgc):
        value = getattr(pgc, name, None)
        if value is None:
            continue
        groups[name] = value
        if name == "hcp":
            if not isinstance(value, (list, tuple)):
                raise InconsistentCollectionError(
                    f"field 'hcp' must be a list of groups (one per level), got {value!r}"
                )
            for level, group in enumerate(value):
                members[f"hcp{level}"] = _members(f"hcp[{level}]", group)
        else:
            members[name] = _members(name, value)
    return groups, members


def collection_state(pgc: Any) -> ModelParallelGroups:
    """Compat's state holding the groups of ``pgc``, after checking they form a Megatron layout.

    Every rank of the world calls it with its own collection (a collective: the ranks agree on
    the inferred layout). The state owns no group: destroying it destroys nothing.

    Raises:
        TypeError: ``pgc`` is ``None`` or torch.distributed is not initialized.
        InconsistentCollectionError: on a rank whose collection is no Megatron layout of this
            world (the fields and their rank lists are named).
        ParallelConfigMismatchError: on the other ranks, when the ranks' collections give
            different layouts (or some rank's is inconsistent).
    """
    if pgc is None:
        raise TypeError("pgc must be a ProcessGroupCollection (or an object with its fields), got None")
    if not (dist.is_available() and dist.is_initialized()):
        raise TypeError("use_collection needs torch.distributed to be initialized (the groups live in its world)")
    rank, world = dist.get_rank(), dist.get_world_size()
    problem: InconsistentCollectionError | None = None
    try:
        groups, members = _read(pgc)
        inferred = infer_layout(rank, world, members, RELEASE.series)
        agreed: dict[str, Any] = {"collection": inferred.configuration()}
    except InconsistentCollectionError as exc:
        problem = exc
        agreed = {"collection": "inconsistent"}
    try:
        agree(agreed, name=_AGREEMENT_NAME)
    except ParallelConfigMismatchError as mismatch:
        if problem is not None:
            raise problem from mismatch
        raise
    if problem is not None:
        raise problem
    return _state(inferred.layout, rank, groups, inferred.ranks)


def _state(layout: Any, rank: int, fields: dict[str, Any], ranks: dict[str, list[int]]) -> ModelParallelGroups:
    state = ModelParallelGroups(layout=layout, rank=rank)
    # Every kind starts unset (None, not missing): a kind the collection lacks takes no fallback.
    for kind in GROUP_KINDS:
        if not _aliased(kind, layout):
            state.groups[kind] = None
    for name, value in fields.items():
        if name == "hcp":
            state.hierarchical_cp_groups = list(value)
            continue
        kind = FIELD_KINDS[name]
        if _aliased(kind, layout):
            continue
        state.groups[kind] = value
        state.ranks[kind] = ranks[name]
    seen: set[int] = set()
    for group in [g for name, v in fields.items() for g in (v if name == "hcp" else [v])]:
        if id(group) not in seen:
            seen.add(id(group))
            state.process_group_list.append(group)
    return state


@contextmanager
def use_collection(pgc: Any) -> Iterator[ModelParallelGroups]:
    """Serve ``pgc``'s groups as compat's globals inside the ``with`` block; yield the state.

    ``pgc`` is a ``ProcessGroupCollection`` (from :func:`parallel_state_ng.build_megatron_groups`,
    ``compat.pg_collection.to_process_group_collection``, Megatron's
    ``ProcessGroupCollection.use_mpu_process_groups()``, or built by hand) or any object with
    its fields. On entry every rank reads its groups' members, infers the layout (sizes and an
    ``order`` under which Megatron's groups for this rank are these) and the ranks agree on it;
    then :func:`compat._scoping.use_state` publishes it. Inside the block a getter of a field
    ``pgc`` holds returns that very group object (and the world-size / rank getters answer from
    it); a getter whose field is missing (``None`` or absent), and the getters of groups no
    field holds (gloo twins, ``get_tensor_and_data_parallel_group``), raise ``AssertionError``
    as MCore's do before initialization: no other group stands in. On exit, also by an
    exception, the previous state, its globals and overrides are restored; blocks nest.

    Raises:
        TypeError: ``pgc`` is ``None``, or torch.distributed is not initialized.
        InconsistentCollectionError: (a ``ValueError``) ``pgc`` is no Megatron layout of this
            world on this rank: a group of another world, inconsistent sizes (``mp`` is not
            tp × pp, ...), or groups no order gives (the fields and rank lists are named).
        ParallelConfigMismatchError: the ranks' collections give different layouts (raised
            on every rank, the inconsistent one raising its own error).
    """
    state = collection_state(pgc)
    with use_state(state):
        yield state
