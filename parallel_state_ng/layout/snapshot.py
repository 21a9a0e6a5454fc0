"""Layout snapshots: one configuration's groups as stable, versioned data (``layout --format json``).

A snapshot is a JSON object with these fields (schema :data:`SCHEMA`):

* ``schema``: ``"parallel_state_ng.layout/1"``;
* ``release``: the megatron-core series mirrored (``"0.16"``);
* ``config``: every argument :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout`
  needs to recompute the layout (:data:`CONFIG_FIELDS`, MCore's argument names;
  ``expert_tensor_parallel_size`` resolved);
* ``kinds``: per group kind ``initialize_model_parallel`` builds, in its creation order: ``desc``
  (MCore's ``group_desc``), ``timeout`` (``rule``: ``"init"``, the init's
  ``distributed_timeout_minutes``, or ``"torch"``, torch's default; ``flipped_by``: the
  :class:`~parallel_state_ng.releases.facts.ReleaseFacts` attribute under which a release takes
  the other rule, or ``null``), ``gloo`` (its gloo twin's ``desc`` and timeout ``rule``, or
  ``null``) and ``groups`` (rank lists in MCore's in-group order).

Everything else a tool adds (the layout tool's ``report``: sizes, locality, warnings, a rank's
view) is not part of the snapshot: :func:`load_snapshot` ignores it. The desc and timeout
entries are read from :data:`~parallel_state_ng.layout.kinds.GROUP_KINDS` and the release's
facts, never restated. :func:`load_snapshot` validates a snapshot fully and raises
:class:`SnapshotError` naming the field and the values. Pure: no ``torch.distributed``.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping
from typing import Any

from parallel_state_ng.layout.bounded_input import MAX_ENUMERATED_RANKS, load_json
from parallel_state_ng.layout.kinds import GROUP_KINDS
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.releases import SUPPORTED_SERIES
from parallel_state_ng.releases.facts import release_facts

__all__ = [
    "SCHEMA",
    "SUPPORTED_SCHEMAS",
    "CONFIG_FIELDS",
    "SnapshotError",
    "kind_desc",
    "kind_entry",
    "layout_config",
    "snapshot_of",
    "layout_of",
    "dumps_snapshot",
    "load_snapshot",
    "validate_snapshot",
]

#: The schema written, and the schemas :func:`load_snapshot` reads.
SCHEMA = "parallel_state_ng.layout/1"
SUPPORTED_SCHEMAS: tuple[str, ...] = (SCHEMA,)

#: The configuration fields of a snapshot: MegatronLayout's arguments, each with what it must be.
CONFIG_FIELDS: dict[str, str] = {
    "world_size": "int",
    "tensor_model_parallel_size": "int",
    "pipeline_model_parallel_size": "int",
    "context_parallel_size": "int",
    "expert_model_parallel_size": "int",
    "expert_tensor_parallel_size": "int",
    "order": "str",
    "num_distributed_optimizer_instances": "int",
    "hierarchical_context_parallel_sizes": "int list or null",
    "gtp_remat_size": "int",
    "expert_gtp_remat_size": "int",
}
_TOP_FIELDS = ("schema", "release", "config", "kinds")
_IGNORED_FIELDS = ("report",)  # what a tool adds: not part of the snapshot
_HCP = re.compile(r"^hcp(\d+)$")
_RULES = ("init", "torch")
_MAX_HCP_LEVELS = 32  # hierarchical context-parallel levels a snapshot may state


def _short(value: Any, limit: int = 120) -> str:
    """``repr(value)`` cut to ``limit`` characters (a hostile value must not make a huge message)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SnapshotError(ValueError):
    """A snapshot that cannot be read: the message names the source, the field and the values."""


# --------------------------------------------------------------------------- writing
def kind_desc(kind: str) -> str:
    """MCore's ``group_desc`` of ``kind`` (``hcpN``: hierarchical context-parallel level N)."""
    level = _HCP.match(kind)
    if level:
        return GROUP_KINDS["hcp"].desc.format(level=level.group(1))
    return GROUP_KINDS[kind].desc


def _table_kind(kind: str) -> str:
    return "hcp" if _HCP.match(kind) else kind


def kind_entry(kind: str, release: str, groups: list[list[int]]) -> dict[str, Any]:
    """One kind of a snapshot: desc, timeout rule, gloo twin and groups, from the table and the facts."""
    row = GROUP_KINDS[_table_kind(kind)]
    gloo = None
    if row.gloo_desc is not None:
        gloo = {"desc": row.gloo_desc, "timeout": row.gloo_timeout}
    return {
        "desc": kind_desc(kind),
        "timeout": {"rule": row.timeout_rule(release_facts(release)), "flipped_by": row.timeout_flipped_by},
        "gloo": gloo,
        "groups": groups,
    }


def layout_config(layout: MegatronLayout) -> dict[str, Any]:
    """The snapshot ``config`` of ``layout``: every argument needed to recompute it."""
    hcp = layout.hierarchical_context_parallel_sizes
    return {
        "world_size": layout.world_size,
        "tensor_model_parallel_size": layout.tensor_model_parallel_size,
        "pipeline_model_parallel_size": layout.pipeline_model_parallel_size,
        "context_parallel_size": layout.context_parallel_size,
        "expert_model_parallel_size": layout.expert_model_parallel_size,
        "expert_tensor_parallel_size": layout.expert_tensor_parallel_size,
        "order": layout.order,
        "num_distributed_optimizer_instances": layout.num_distributed_optimizer_instances,
        "hierarchical_context_parallel_sizes": None if hcp is None else list(hcp),
        "gtp_remat_size": layout.gtp_remat_size,
        "expert_gtp_remat_size": layout.expert_gtp_remat_size,
    }


def snapshot_of(layout: MegatronLayout) -> dict[str, Any]:
    """The snapshot of ``layout`` (every kind it builds at init, in creation order).

    Raises:
        ValueError: the layout has a rank range or an encoder block (a snapshot holds neither).
    """
    if layout.rank_offset or layout.local_world_size is not None or layout.encoder_world_size:
        raise ValueError("a snapshot holds a layout over the whole world without an encoder block")
    release = str(layout.release)
    return {
        "schema": SCHEMA,
        "release": release,
        "config": layout_config(layout),
        "kinds": {kind: kind_entry(kind, release, layout.enumerate(kind)) for kind in layout.kinds()},
    }


def layout_of(config: Mapping[str, Any], release: str) -> MegatronLayout:
    """The :class:`MegatronLayout` of a snapshot's ``config`` and ``release``.

    Raises what MegatronLayout raises for a configuration the release cannot build.
    """
    return MegatronLayout(release=release, **{name: config[name] for name in CONFIG_FIELDS})


def dumps_snapshot(snapshot: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> str:
    """Stable text of a snapshot: the fields in a fixed order, one line per kind (diff-friendly).

    ``extra``: more top-level fields written after the snapshot's (the layout tool's ``report``).
    """
    lines = ["{"]
    for name in ("schema", "release", "config"):
        lines.append(f"  {json.dumps(name)}: {json.dumps(snapshot[name])},")
    lines.append('  "kinds": {')
    kinds = list(snapshot["kinds"].items())
    for i, (kind, entry) in enumerate(kinds):
        lines.append(f"    {json.dumps(kind)}: {json.dumps(entry)}" + ("," if i < len(kinds) - 1 else ""))
    lines.append("  }" + ("," if extra else ""))
    for i, (name, value) in enumerate((extra or {}).items()):
        lines.append(f"  {json.dumps(name)}: {json.dumps(value)}" + ("," if i < len(extra or {}) - 1 else ""))
    return "\n".join(lines) + "\n}\n"


# --------------------------------------------------------------------------- reading
def load_snapshot(text: str | bytes, source: str = "snapshot") -> dict[str, Any]:
    """Parse and validate a snapshot's JSON text (see :func:`validate_snapshot`).

    The text goes through :func:`~parallel_state_ng.layout.bounded_input.load_json` first
    (size, nesting depth, UTF-8, duplicate keys: docs/reliability.md, "Hostile input").

    Raises:
        SnapshotError: beyond a limit, not JSON (truncated, ...) or not a valid snapshot; one
            line that starts with ``source`` and names the field and the values or the limit.
    """
    data = load_json(text, source, error=SnapshotError)
    return validate_snapshot(data, source)


def _fail(source: str, field: str, message: str) -> SnapshotError:
    return SnapshotError(f"{source}: {field}: {message}")


def _check_config(config: Any, source: str) -> dict[str, Any]:
    if not isinstance(config, dict):
        raise _fail(source, "config", f"must be an object, got {type(config).__name__}")
    unknown = sorted(set(config) - set(CONFIG_FIELDS))
    if unknown:
        raise _fail(source, "config", f"unknown field(s) {unknown}; the fields are {list(CONFIG_FIELDS)}")
    missing = [name for name in CONFIG_FIELDS if name not in config]
    if missing:
        raise _fail(source, "config", f"missing field(s) {missing}")
    for name, what in CONFIG_FIELDS.items():
        value = config[name]
        if what == "int":
            ok = type(value) is int and 1 <= value <= MAX_ENUMERATED_RANKS
        elif what == "str":
            ok = isinstance(value, str) and bool(value)
        else:
            ok = value is None or (
                isinstance(value, list)
                and 1 <= len(value) <= _MAX_HCP_LEVELS
                and all(type(v) is int and 1 <= v <= MAX_ENUMERATED_RANKS for v in value)
            )
        if not ok:
            expected = {
                "int": f"an integer from 1 to {MAX_ENUMERATED_RANKS} (the limit of ranks a snapshot holds)",
                "str": "a non-empty string",
            }.get(what, f"null or a list of 1 to {_MAX_HCP_LEVELS} integers from 1 to {MAX_ENUMERATED_RANKS}")
            raise _fail(source, f"config.{name}", f"must be {expected}, got {_short(value)}")
    return config


def _check_timeout(value: Any, source: str, field: str) -> None:
    if not isinstance(value, dict) or value.get("rule") not in _RULES:
        got = value.get("rule") if isinstance(value, dict) else value
        raise _fail(source, field, f"the timeout rule must be one of {list(_RULES)}, got {_short(got)}")
    if not (value.get("flipped_by") is None or isinstance(value.get("flipped_by"), str)):
        raise _fail(source, f"{field}.flipped_by", f"must be a string or null, got {_short(value['flipped_by'])}")


def _check_kind(kind: str, entry: Any, world: int, source: str) -> None:
    field = f"kinds.{kind}"
    if (kind not in GROUP_KINDS and not _HCP.match(kind)) or kind == "hcp":
        known = ", ".join(k for k in GROUP_KINDS if k != "hcp")
        raise _fail(source, field, f"unknown group kind {_short(kind)}; known kinds: {known}, hcp0, hcp1, ...")
    if not isinstance(entry, dict):
        raise _fail(source, field, f"must be an object, got {type(entry).__name__}")
    missing = [k for k in ("desc", "timeout", "gloo", "groups") if k not in entry]
    if missing:
        raise _fail(source, field, f"missing field(s) {missing}")
    if not isinstance(entry["desc"], str):
        raise _fail(source, f"{field}.desc", f"must be a string, got {_short(entry['desc'])}")
    _check_timeout(entry["timeout"], source, f"{field}.timeout")
    gloo = entry["gloo"]
    if gloo is not None:
        if not isinstance(gloo, dict) or not isinstance(gloo.get("desc"), str):
            raise _fail(source, f"{field}.gloo", f"must be null or an object with a desc, got {_short(gloo)}")
        if gloo.get("timeout") not in _RULES:
            raise _fail(
                source, f"{field}.gloo.timeout", f"must be one of {list(_RULES)}, got {_short(gloo.get('timeout'))}"
            )
    groups = entry["groups"]
    if not isinstance(groups, list):
        raise _fail(source, f"{field}.groups", f"must be a list of rank lists, got {type(groups).__name__}")
    owner: dict[int, int] = {}
    for i, group in enumerate(groups):
        where = f"{field}.groups[{i}]"
        if not isinstance(group, list) or not group or not all(type(r) is int for r in group):
            raise _fail(source, where, f"must be a non-empty list of integer ranks, got {_short(group)}")
        seen: set[int] = set()
        for rank in group:
            if not 0 <= rank < world:
                raise _fail(
                    source, where, f"rank {rank} is out of range for config.world_size {world} (ranks 0..{world - 1})"
                )
            if rank in seen:
                raise _fail(source, where, f"rank {rank} appears twice in {_short(group)}")
            seen.add(rank)
            if rank in owner:
                first = owner[rank]
                raise _fail(
                    source,
                    field,
                    f"rank {rank} is in groups[{first}] {_short(groups[first])} and groups[{i}] {_short(group)}; "
                    "a rank is in at most one group of a kind",
                )
            owner[rank] = i
    view = GROUP_KINDS[_table_kind(kind)].view
    if view in ("dense", "expert") and len(owner) != world:
        lacking = list(itertools.islice((r for r in range(world) if r not in owner), 9))
        raise _fail(
            source,
            "config.world_size",
            f"{world} is inconsistent with the groups: kinds.{kind} covers {len(owner)} ranks, "
            f"not ranks {lacking[:8]}{' ...' if len(lacking) > 8 else ''}",
        )


def validate_snapshot(data: Any, source: str = "snapshot") -> dict[str, Any]:
    """Check a parsed snapshot completely; returns it (without the fields it ignores).

    Checks: an object; ``schema`` present and supported; no unknown top-level field;
    ``release`` a supported series; ``config`` with exactly :data:`CONFIG_FIELDS`, each of its
    type; ``kinds`` known, each with desc, timeout rule, gloo twin and groups whose ranks lie in
    ``[0, world_size)``, none twice in a group or in two groups of a kind; the kinds read off a
    rank generator cover the whole world.

    Raises:
        SnapshotError: the first problem found, naming ``source``, the field and the values.
    """
    if not isinstance(data, dict):
        raise _fail(source, "snapshot", f"must be a JSON object, got {type(data).__name__}")
    if "schema" not in data:
        raise _fail(source, "schema", f"missing: not a layout snapshot (supported schemas: {list(SUPPORTED_SCHEMAS)})")
    if data["schema"] not in SUPPORTED_SCHEMAS:
        raise _fail(
            source, "schema", f"{_short(data['schema'])} is not supported; supported: {list(SUPPORTED_SCHEMAS)}"
        )
    unknown = sorted(set(data) - set(_TOP_FIELDS) - set(_IGNORED_FIELDS))
    if unknown:
        raise _fail(source, "snapshot", f"unknown field(s) {unknown}; the fields are {list(_TOP_FIELDS)}")
    missing = [name for name in _TOP_FIELDS if name not in data]
    if missing:
        raise _fail(source, "snapshot", f"missing field(s) {missing}")
    if data["release"] not in SUPPORTED_SERIES:
        raise _fail(
            source,
            "release",
            f"{_short(data['release'])} is not a supported series; supported: {list(SUPPORTED_SERIES)}",
        )
    config = _check_config(data["config"], source)
    kinds = data["kinds"]
    if not isinstance(kinds, dict) or not kinds:
        raise _fail(source, "kinds", f"must be a non-empty object of group kinds, got {_short(kinds)}")
    for kind, entry in kinds.items():
        _check_kind(kind, entry, config["world_size"], source)
    return {name: data[name] for name in _TOP_FIELDS}
