"""What a live job holds, read from any source as entries to check against MCore's layout.

:func:`read_source` turns a ``ProcessGroupCollection`` (MCore's, ours, hand-made, a dict of
field -> group, or a :class:`~parallel_state_ng.builders.collection.MegatronGroups`), a
``parallel_state``-like module after init (``compat.parallel_state``,
``megatron.core.parallel_state``), a ``HyperCommGrid`` (ours or MCore's) or a torch
``DeviceMesh`` with named dims into :class:`Entry` rows: what the caller calls the value, the
group kind it must hold and the value itself. Which field, global or dim holds which kind is
read from the group-kind table (:data:`parallel_state_ng.layout.kinds.GROUP_KINDS`). Reads
only: no collective, no group created. Used by :mod:`parallel_state_ng.builders.verify`.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from parallel_state_ng.builders.collection import MegatronGroups
from parallel_state_ng.builders.grid import BASE_VIEW
from parallel_state_ng.layout.kinds import GROUP_KINDS, fills, token_kind_dims
from parallel_state_ng.layout.order import GTP_TOKEN
from parallel_state_ng.releases import Release
from parallel_state_ng.releases import parallel_state as api
from parallel_state_ng.releases import process_groups_config as collection_facts
from parallel_state_ng.releases.facts import release_facts

__all__ = ["MISSING", "Entry", "Source", "read_source", "kind_of_dims", "FIELD_KINDS"]


class _Missing:
    """The value of a field or global the source does not have at all."""

    def __repr__(self) -> str:
        return "<missing>"


#: A field or global the source lacks (not even ``None``).
MISSING: Any = _Missing()

#: ``ProcessGroupCollection`` field -> (group kind, the module global MCore fills it from),
#: from the group-kind table.
FIELD_KINDS: dict[str, tuple[str, str]] = {
    fill.collection: (kind.name, fill.name) for kind, fill in fills() if fill.collection
}

#: Dim-name tokens besides the kinds' own: expert tensor / data parallel dims of a separate grid.
_EXPERT_ALIASES = {"etp": "tp", "edp": "dp"}


@dataclass(frozen=True)
class Entry:
    """One value the source holds, and the group kind it must hold.

    ``name`` is what the caller calls it (a field, a global, a dim) and ``where`` says so in
    messages. ``kind`` is its ``GROUP_KINDS`` row; ``expect`` the Megatron global whose
    expected value applies (empty: the kind's group of the rank). ``ordered``: a rank list
    whose order matters (MCore's ``_*_GLOBAL_RANKS``); ``optional``: ``None`` is fine (a gloo
    twin the job may not have built).
    """

    name: str
    where: str
    kind: str
    expect: str
    value: Any
    ordered: bool = False
    optional: bool = False


@dataclass
class Source:
    """The entries read from one source; ``what`` names the source, ``unchecked`` what had no kind."""

    what: str
    entries: list[Entry]
    unchecked: list[str] = field(default_factory=list)


def read_source(
    source: Any,
    release: Release,
    fields: Collection[str] | None = None,
    dim_kinds: Mapping[str, str] | None = None,
) -> Source:
    """The entries of ``source`` for ``release`` (``fields``: only these names).

    Raises:
        TypeError: ``source`` is none of the accepted kinds of object.
        ValueError: a DeviceMesh without dim names; a dim name that is no Megatron dim;
            ``fields`` or ``dim_kinds`` names something the source or the table lacks.
    """
    if dim_kinds is not None:
        unknown_kinds = sorted({k for k in dim_kinds.values() if k not in GROUP_KINDS})
        if not isinstance(dim_kinds, Mapping) or unknown_kinds:
            raise ValueError(
                f"dim_kinds must map dim names to group kinds; unknown kind(s) {unknown_kinds}, "
                f"kinds: {sorted(GROUP_KINDS)}"
            )
    read = _reader(source)
    out = read(source, release, dict(dim_kinds or {}))
    if fields is not None:
        if isinstance(fields, str):
            raise TypeError(f"fields must be a collection of names, got the string {fields!r}")
        known = [e.name for e in out.entries]
        unknown = sorted(set(fields) - set(known))
        if unknown:
            raise ValueError(f"fields names {unknown}, which this {out.what} does not have; its names: {known}")
        out.entries = [e for e in out.entries if e.name in set(fields)]
    return out


def _reader(source: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(source, DeviceMesh):
        return _from_mesh
    if isinstance(source, types.ModuleType):
        return _from_module
    if isinstance(source, (MegatronGroups, Mapping)) or dataclasses.is_dataclass(source):
        return _from_collection
    if hasattr(source, "_pgs") and hasattr(source, "dim_names") and hasattr(source, "shape"):
        return _from_grid
    raise TypeError(
        f"source must be a ProcessGroupCollection (or a dict of field -> group, or MegatronGroups), a "
        f"parallel_state module after init, a HyperCommGrid or a DeviceMesh with dim names; got "
        f"{type(source).__module__}.{type(source).__qualname__}"
    )


def _from_collection(source: Any, release: Release, dim_kinds: dict[str, str]) -> Source:
    """A collection's fields: each field's kind and global from the table."""
    expected_fields = collection_facts.collection_fields(release)
    if not expected_fields:
        if isinstance(source, MegatronGroups):  # 0.12-0.14: its groups by kind
            return _from_kinds(source, release)
        raise ValueError(
            f"megatron-core {release.series} has no ProcessGroupCollection (added in 0.15): check its "
            f"parallel_state module instead, or state release='0.15' or later"
        )
    if isinstance(source, MegatronGroups):
        values, what = source.field_values(), "MegatronGroups"
    elif isinstance(source, Mapping):
        values, what = dict(source), "mapping of fields"
        known = {name for names in collection_facts.COLLECTION_FIELDS.values() for name in names}
        unknown = sorted(str(name) for name in values if name not in known)
        if unknown:
            raise ValueError(
                f"source has field name(s) {unknown} that no ProcessGroupCollection has; fields of "
                f"megatron-core {release.series}: {list(collection_facts.collection_fields(release))}"
            )
    else:
        names = [f.name for f in dataclasses.fields(source)]
        values = {name: _field_value(source, name) for name in names}
        what = type(source).__qualname__
    names = list(dict.fromkeys([*expected_fields, *values]))
    entries, unchecked = [], []
    for name in names:
        if name not in FIELD_KINDS:
            if values.get(name) is not None and values.get(name) is not MISSING:
                unchecked.append(name)  # the all-gather groups: set by the caller, no global behind them
            continue
        kind, global_name = FIELD_KINDS[name]
        entries.append(Entry(name, f"field {name!r}", kind, global_name, values.get(name, MISSING)))
    return Source(what, entries, unchecked)


def _field_value(collection: Any, name: str) -> Any:
    """A collection field's value, :data:`MISSING` where it was never set.

    Read from the instance's own attributes: 0.19's ``ProcessGroupCollection`` answers ``None``
    for a declared field that was never set (its ``__getattr__``), where earlier releases raise
    ``AttributeError``, so ``getattr`` alone would call the same unset field "missing" on one
    release and ``None`` on another.
    """
    own = getattr(collection, "__dict__", None)
    if own is None:  # a dataclass with slots: no __getattr__ fallback to see through
        return getattr(collection, name, MISSING)
    return own.get(name, MISSING)


def _from_kinds(groups: MegatronGroups, release: Release) -> Source:
    """A MegatronGroups of a release without a collection: each kind's group it holds."""
    held = groups.state.groups
    entries = [
        Entry(kind, f"group {kind!r}", kind, "", held.get(kind, MISSING))
        for kind in groups.layout.kinds()
        if kind in GROUP_KINDS and GROUP_KINDS[kind].fills and GROUP_KINDS[kind].fills[0].value == "group"
    ]
    return Source(f"MegatronGroups (megatron-core {release.series}: by group kind)", entries)


def _from_module(module: Any, release: Release, dim_kinds: dict[str, str]) -> Source:
    """A parallel_state module's globals (those of the release), from the table's fills."""
    served = api.globals_of(release)
    entries = []
    for kind, fill in fills():
        if fill.value == "by_size" or fill.name not in served:
            continue
        value = getattr(module, fill.name, MISSING)
        where = f"global {fill.name}"
        ordered, optional = fill.value == "ranks", fill.value == "gloo"
        entries.append(Entry(fill.name, where, kind.name, fill.name, value, ordered=ordered, optional=optional))
    return Source(f"module {module.__name__}", entries)


def _from_grid(grid: Any, release: Release, dim_kinds: dict[str, str]) -> Source:
    """A HyperCommGrid's created groups (ours or MCore's; read from its group table)."""
    entries = []
    for key, group in dict(grid._pgs).items():
        view, dims = (BASE_VIEW, key.split("-")) if isinstance(key, str) else (key[0], list(key[1]))
        name = "-".join(dims) if view == BASE_VIEW else f"{view}:{'-'.join(dims)}"
        kind = kind_of_dims(name, dims, release, dim_kinds, expert=view != BASE_VIEW)
        entries.append(Entry(name, f"grid group {name!r}", kind, "", group))
    return Source(f"{type(grid).__module__}.{type(grid).__qualname__}", entries)


def _from_mesh(mesh: Any, release: Release, dim_kinds: dict[str, str]) -> Source:
    """A DeviceMesh's named dims and flattened dims (``dp_cp``: the dp × cp group)."""
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(
            f"source is a DeviceMesh without dim names (mesh_dim_names={names!r}, shape "
            f"{tuple(mesh.mesh.shape)}): create it with mesh_dim_names=('pp', 'dp', 'tp', ...) so each "
            f"dim's group kind is known"
        )
    flattened = _flattened_dims(mesh)
    entries = []
    for name in [*names, *[f for f in flattened if f not in names]]:
        kind = kind_of_dims(name, _tokens(name), release, dim_kinds)
        entries.append(Entry(name, f"mesh dim {name!r}", kind, "", mesh.get_group(name)))
    return Source("DeviceMesh", entries)


def _flattened_dims(mesh: Any) -> list[str]:
    """The names of a DeviceMesh's flattened dims (``mesh["dp", "cp"]._flatten("dp_cp")``).

    Where torch keeps them differs by release (``TORCH_FACTS["device_mesh_flatten_mapping"]``):
    on the mesh (``_flatten_mapping``), or, before, in the mesh environment's
    ``root_to_flatten_mapping`` under the root mesh. A torch with neither (2.4.1: no
    ``_flatten``) has no flattened dims.
    """
    mapping = getattr(mesh, "_flatten_mapping", None)
    if mapping is None:
        try:
            from torch.distributed.device_mesh import _mesh_resources

            mapping = getattr(_mesh_resources, "root_to_flatten_mapping", {}).get(_mesh_resources.get_root_mesh(mesh))
        except Exception:  # noqa: BLE001 - a torch that keeps no such mapping
            mapping = None
    return list(mapping or {})


def _tokens(name: str) -> list[str]:
    """A dim name's parallelism tokens: ``"dp_cp"`` -> ``["dp", "cp"]`` (``-`` or ``_`` between)."""
    return [GTP_TOKEN if t == "gtp" else t for t in re.split(r"[-_]", name.replace(GTP_TOKEN, "gtp")) if t]


def kind_of_dims(
    name: str, dims: list[str], release: Release, dim_kinds: Mapping[str, str], *, expert: bool = False
) -> str:
    """The group kind whose ``get_ranks`` dims are ``dims`` (``dim_kinds[name]`` first).

    Dense kinds unless ``expert`` (a grid view), a dim is ``ep`` or an expert alias (``etp``,
    ``edp``). On a release with the GTP axis, dims without ``gtp_remat`` that no kind has
    exactly name the kind spanning ``gtp_remat`` besides them (``dp-tp`` is ``tp_dp``, whose
    dims there are tp, gtp_remat, dp). Raises ``ValueError`` naming the dim when no kind has
    these dims.
    """
    if name in dim_kinds:
        return dim_kinds[name]
    expert = expert or "ep" in dims or any(d in _EXPERT_ALIASES for d in dims)
    plain = sorted(_EXPERT_ALIASES.get(d, d) for d in dims)
    view = "expert" if expert else "dense"
    gtp_axis = release_facts(release.series).gtp_remat_axis
    # A dim without gtp_remat is a group of gtp_remat size 1: on 0.19, where tp_dp, tp_dp_cp and
    # mp also span gtp_remat, it is the kind with gtp_remat dropped (the membership check then
    # tells whether the stated layout's gtp_remat is 1 too).
    tables = [gtp_axis] + ([False] if gtp_axis and GTP_TOKEN not in plain else [])
    for axis in tables:
        for kind, (kind_view, kind_dims) in token_kind_dims(axis).items():
            if kind_view == view and sorted(kind_dims) == plain:
                return kind
    tokens = sorted({t for _, d in token_kind_dims(True).values() for t in d} | set(_EXPERT_ALIASES))
    raise ValueError(
        f"dim {name!r} (dims {dims}) matches no {view} group kind of megatron-core {release.series}; name "
        f"dims with {tokens} (flattened dims joined by '_'), or map it with dim_kinds={{{name!r}: <kind>}}"
    )
