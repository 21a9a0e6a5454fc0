"""``python -m parallel_state_ng topology SPEC``: a multi-module topology, module by module.

The spec (a JSON list of modules, :func:`parse_spec`) is checked by
:func:`~parallel_state_ng.layout.topology_spec.validate_topology`, as ``build_topology`` checks
it; each module's groups come from its ``MegatronLayout`` (pure math: no processes, no GPUs).
The report: which module runs where, each module's sizes, options and groups, and ``--rank R``'s
modules and groups (closed form). Formats ``text`` (:mod:`.text`), ``json`` and ``svg``
(:mod:`.svg`). Work is O(module ranks) per kind, and one enumeration per module shape: modules
of one shape share a layout and their groups are copies shifted to their ranks. The tool:
docs/tools.md#topology-tool.
"""

from __future__ import annotations

import argparse
import gc
import json
from collections.abc import Sequence
from typing import Any

from parallel_state_ng.layout.bounded_input import (
    MAX_RANK,
    MAX_TOPOLOGY_MODULES,
    InputLimitError,
    load_json,
    read_bounded,
)
from parallel_state_ng.layout.topology_spec import (
    BUILD_OPTIONS,
    ModulePlacement,
    ModuleSpec,
    TopologySpecError,
    validate_topology,
)
from parallel_state_ng.releases import known_release
from parallel_state_ng.tools.common import (
    UsageError,
    kind_entry,
    name_list,
    non_negative_int,
    positive_int,
    write_output,
)
from parallel_state_ng.tools.layout.report import rank_view, rank_view_lines
from parallel_state_ng.tools.topology.text import render_topology_text

__all__ = [
    "add_arguments",
    "run",
    "parse_spec",
    "read_spec",
    "place_modules",
    "module_kinds",
    "build_topology_report",
    "rank_report",
    "render_topology_text",
    "SPEC_KEYS",
    "JSON_OPTIONS",
]

#: Keys of one module in a spec file -> :class:`ModuleSpec` field.
SPEC_KEYS = {
    "name": "name",
    "ranks": "ranks",
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
    "order": "order",
    "language": "language",
    "options": "options",
}
#: Module options a spec file may set: :data:`BUILD_OPTIONS` less the callables JSON cannot hold.
JSON_OPTIONS = BUILD_OPTIONS - {"get_embedding_ranks", "get_position_embedding_ranks"}
_EMBEDDING_KINDS = ("embd", "pos_embd")


# --------------------------------------------------------------------------- arguments
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``topology`` command's options to ``parser``."""
    parser.add_argument(
        "spec",
        metavar="SPEC",
        help='topology spec: a JSON file ("-": stdin) holding a list of modules, e.g. '
        '[{"name": "encoder", "ranks": [0, 2]}, {"name": "language", "ranks": [2, 6], "tp": 2, "language": true}]',
    )
    parser.add_argument(
        "--release",
        default=None,
        help="megatron-core release whose layouts to show, e.g. 0.19 (modules on part of the world need 0.17+; "
        "default: the installed one, $PSNG_MEGATRON_VERSION, else the newest supported)",
    )
    parser.add_argument(
        "--world-size",
        type=positive_int,
        default=None,
        help="number of ranks (default: the end of the last module's ranks); every rank must run a module",
    )
    parser.add_argument(
        "--rank", type=non_negative_int, default=None, help="also show the modules this rank runs and its groups"
    )
    parser.add_argument("--kinds", type=name_list, default=None, help="comma-separated group kinds to show")
    parser.add_argument("--full", action="store_true", help="text: print every group and every rank")
    parser.add_argument("--format", choices=("text", "json", "svg"), default="text", help="output format")
    parser.add_argument("--output", "-o", default=None, help="write to this file instead of stdout")
    from parallel_state_ng.tools.layout.nvlink import add_domain_arguments

    add_domain_arguments(
        parser,
        "--suggest-placement",
        "list module placements (rank offsets) and orders that keep --keep-inside kinds inside a domain, best first",
    )


# --------------------------------------------------------------------------- spec
def parse_spec(text: str, source: str = "SPEC") -> list[ModuleSpec]:
    """The modules of a JSON spec: a list of objects with the keys of :data:`SPEC_KEYS`.

    ``name`` and ``ranks`` (``[start, stop]``, stop excluded) are required; ``tp``, ``pp``,
    ``cp``, ``ep`` default to 1, ``etp`` to ``tp``, ``order`` to ``"tp-cp-ep-dp-pp"``,
    ``language`` to false; ``options`` is an object of :data:`JSON_OPTIONS`. Values are checked
    later by :func:`place_modules`.

    Raises:
        UsageError: not JSON, not a list of objects, an unknown or duplicate key, a missing name
            or ranks, or an option JSON cannot express (``source`` names the file).
    """
    data = load_json(text, source, error=UsageError)
    if not isinstance(data, list) or not data:
        raise UsageError(f"{source}: a topology spec is a non-empty JSON list of modules, got {_json_type(data)}")
    if len(data) > MAX_TOPOLOGY_MODULES:
        raise UsageError(f"{source}: modules: {len(data)} modules is over the limit of {MAX_TOPOLOGY_MODULES}")
    modules = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise UsageError(
                f"{_where(source, i, entry)} must be an object with keys {list(SPEC_KEYS)}, got {_json_type(entry)}"
            )
        if not entry.keys() <= _SPEC_KEY_SET:
            unknown = sorted(set(entry) - _SPEC_KEY_SET)
            raise UsageError(f"{_where(source, i, entry)}: unknown key(s) {unknown}; allowed: {list(SPEC_KEYS)}")
        if "name" not in entry or "ranks" not in entry:
            missing = [k for k in ("name", "ranks") if k not in entry]
            raise UsageError(f"{_where(source, i, entry)}: missing key(s) {missing}")
        ranks = entry["ranks"]
        if not (isinstance(ranks, list) and len(ranks) == 2 and _is_int(ranks[0]) and _is_int(ranks[1])):
            raise UsageError(
                f"{_where(source, i, entry)}: ranks must be [start, stop] (two integers, stop excluded), "
                f"got {_short(ranks)}"
            )
        if max(ranks) > MAX_RANK:
            raise UsageError(
                f"{_where(source, i, entry)}: ranks: {_short(ranks)} ends beyond the limit of rank {MAX_RANK} (2**62)"
            )
        options = entry.get("options", {})
        if not isinstance(options, dict):
            raise UsageError(f"{_where(source, i, entry)}: options must be an object, got {_json_type(options)}")
        if not options.keys() <= JSON_OPTIONS:
            unknown, allowed = sorted(set(options) - JSON_OPTIONS), sorted(JSON_OPTIONS)
            raise UsageError(
                f"{_where(source, i, entry)}: option(s) {unknown} cannot be set in a spec file; allowed: {allowed}"
            )
        fields = {SPEC_KEYS[k]: v for k, v in entry.items()}
        fields["ranks"] = (ranks[0], ranks[1])
        modules.append(ModuleSpec(**fields))
    return modules


_SPEC_KEY_SET = frozenset(SPEC_KEYS)


def _where(source: str, index: int, entry: Any) -> str:
    """A module of the spec in a message: its name when it has a short one, always its index."""
    name = entry.get("name") if isinstance(entry, dict) else None
    if isinstance(name, str) and len(name) <= _NAME_SHOWN:
        return f"{source}: module {name!r} (modules[{index}])"
    return f"{source}: modules[{index}]"


_NAME_SHOWN = 80  # longest module name quoted in a message


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    if value == []:
        return "an empty list"
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def read_spec(path: str) -> list[ModuleSpec]:
    """The modules of the spec file at ``path`` (``"-"``: stdin); see :func:`parse_spec`.

    Read through :func:`~parallel_state_ng.layout.bounded_input.read_bounded` (size limit
    before the whole file is read).
    """
    source = "<stdin>" if path == "-" else path
    try:
        text = read_bounded(path, source)
    except InputLimitError as err:
        raise UsageError(str(err), "SPEC") from None
    return parse_spec(text, source)


def place_modules(
    modules: Sequence[ModuleSpec], world_size: int | None = None, release: str | None = None
) -> list[ModulePlacement]:
    """Validate the topology (``world_size`` default: the end of the last range) as ``build_topology`` does.

    Raises:
        UsageError: an unknown release, or a topology :func:`validate_topology` refuses (its message).
    """
    try:
        series = known_release(release).series
    except ValueError as err:
        raise UsageError(str(err), "--release") from None
    if world_size is None:
        world_size = max((m.ranks.stop if isinstance(m.ranks, range) else m.ranks[1] for m in modules), default=1)
    try:
        return validate_topology(modules, world_size, series)
    except TopologySpecError as err:
        raise UsageError(f"invalid topology: {err}") from None


def module_kinds(placement: ModulePlacement) -> list[str]:
    """The group kinds ``build_topology`` builds for a module (embedding kinds: language module only)."""
    kinds = placement.shape.kinds()  # the kinds of a layout do not depend on its first rank
    return kinds if placement.spec.language else [k for k in kinds if k not in _EMBEDDING_KINDS]


def _kinds_of(placements: Sequence[ModulePlacement]) -> list[list[str]]:
    """:func:`module_kinds` of each placement, worked out once per module shape."""
    known: dict[tuple[int, bool], list[str]] = {}
    out = []
    for p in placements:
        key = (id(p.shape), p.spec.language)  # shapes live as long as the placements
        if key not in known:
            known[key] = module_kinds(p)
        out.append(known[key])
    return out


# --------------------------------------------------------------------------- report
def _sizes(placement: ModulePlacement) -> dict[str, int | None]:
    lay = placement.shape
    return {
        "tp": lay.tensor_model_parallel_size,
        "cp": lay.context_parallel_size,
        "dp": lay.data_parallel_size,
        "pp": lay.pipeline_model_parallel_size,
        "ep": lay.expert_model_parallel_size,
        "etp": lay.expert_tensor_parallel_size,
        "edp": lay.expert_data_parallel_size,
    }


def _shifted_kinds(kinds_out: dict[str, Any], delta: int) -> dict[str, Any]:
    return {
        kind: {**entry, "groups": [[rank + delta for rank in group] for group in entry["groups"]]}
        for kind, entry in kinds_out.items()
    }


def _module_reports(
    placements: Sequence[ModulePlacement], kinds: Sequence[str] | None, alike_groups: bool
) -> list[dict[str, Any]]:
    """Each module's report: sizes, options and the groups of its shown kinds.

    A module's groups are its shape's (``ModulePlacement.shape``) shifted to its first rank:
    each shape's groups are enumerated once, then copied shifted (linear in the output). A
    module shaped like one reported before it (same shape and shown kinds) names that module
    in ``shaped_like``; with ``alike_groups`` false its ``kinds`` is ``None`` unless it is colocated.
    """
    first_of: dict[tuple[int, bool, tuple[str, ...]], tuple[str, dict[str, Any]]] = {}
    out = []
    for p, own in zip(placements, _kinds_of(placements), strict=True):
        shown = own if kinds is None else [k for k in kinds if k in own]
        key = (id(p.shape), p.spec.language, tuple(shown))
        delta = p.ranks.start - p.shape.rank_offset
        like = first_of.get(key)
        if like is None:
            base = {kind: kind_entry(kind, p.shape.enumerate(kind)) for kind in shown}
            first_of[key] = (p.name, base)
            kinds_out: dict[str, Any] | None = _shifted_kinds(base, delta) if delta else base
        else:
            kinds_out = _shifted_kinds(like[1], delta) if alike_groups or p.colocated_with else None
        out.append(
            {
                "name": p.name,
                "ranks": [p.ranks.start, p.ranks.stop],
                "num_ranks": len(p.ranks),
                "colocated_with": list(p.colocated_with),
                "language": p.spec.language,
                "sizes": _sizes(p),
                "order": p.shape.order,
                "options": dict(p.spec.options),
                "shaped_like": None if like is None else like[0],
                "kinds": kinds_out,
            }
        )
    return out


def rank_report(placements: Sequence[ModulePlacement], rank: int, kinds: Sequence[str] | None = None) -> dict[str, Any]:
    """The modules ``rank`` runs and, in each, its coordinates, pipeline and group of every kind.

    Closed form (``MegatronLayout.group``, O(group size) per kind): no group is enumerated.
    """
    views = {}
    for p in placements:
        if rank not in p.ranks:
            continue
        own = module_kinds(p)
        view = rank_view(p.layout, rank, own if kinds is None else [k for k in kinds if k in own], gpus_per_node=1)
        del view["node"], view["rank"]
        views[p.name] = view
    return {"rank": rank, "modules": list(views), "views": views}


def build_topology_report(
    placements: Sequence[ModulePlacement],
    *,
    kinds: Sequence[str] | None = None,
    rank: int | None = None,
    alike_groups: bool = True,
) -> dict[str, Any]:
    """The whole report as JSON-ready data (``kinds=None``: every kind each module builds).

    Each module names in ``shaped_like`` the first module before it of the same shape (same
    spec but for the name and first rank), whose groups shifted by the difference of their
    first ranks are its own (``None``: the first of its shape). ``alike_groups=False`` leaves
    such a module's ``kinds`` out (``None``) unless it is colocated: the text report summarises it.
    """
    first = placements[0].shape
    spans: dict[tuple[int, int], list[str]] = {}
    for p in placements:
        spans.setdefault((p.ranks.start, p.ranks.stop), []).append(p.name)
    return {
        "world_size": first.world_size,
        "release": first.release,
        "language_module": next(p.name for p in placements if p.spec.language),
        "spans": [{"ranks": list(span), "modules": names} for span, names in sorted(spans.items())],
        "modules": _module_reports(placements, kinds, alike_groups),
        "rank": None if rank is None else rank_report(placements, rank, kinds),
    }


def _summary_ranks(placements: Sequence[ModulePlacement]) -> int:
    """Ranks whose groups the text summary enumerates: the first module of each shape, and colocated ones.

    A module shaped like an earlier one gets a line, not its groups (``render_topology_text``),
    so a world past the enumeration limit still has a text summary when these ranks are within it.
    """
    seen: set[tuple[int, bool]] = set()
    total = 0
    for p in placements:
        key = (id(p.shape), p.spec.language)
        if key not in seen or p.colocated_with:
            seen.add(key)
            total += len(p.ranks)
    return total


# --------------------------------------------------------------------------- command
def run(args: argparse.Namespace, stdout: Any) -> int:
    """Run the ``topology`` command for parsed ``args``; returns the exit code.

    The cyclic garbage collector is paused meanwhile: a report of many modules is millions of
    small containers and no cycles, which CPython's collector would walk again and again (more
    than half of the CPU time at 20,000 modules).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _run(args, stdout)
    finally:
        if enabled:
            gc.enable()


def _run(args: argparse.Namespace, stdout: Any) -> int:
    placements = place_modules(read_spec(args.spec), args.world_size, args.release)
    world_size = placements[0].layout.world_size
    if args.rank is not None and args.rank >= world_size:
        raise UsageError(f"rank {args.rank} is out of range for a world of {world_size} ranks", "--rank")
    if args.kinds is not None:
        known = list(dict.fromkeys(k for own in _kinds_of(placements) for k in own))
        unknown = [k for k in args.kinds if k not in known]
        if unknown:
            raise UsageError(f"unknown group kind(s) {unknown}; kinds of these modules: {','.join(known)}", "--kinds")
    from parallel_state_ng.tools.layout import big_world, nvlink

    domains = nvlink.domains_from_args(args, "--suggest-placement", args.suggest_placement)
    keep_inside = nvlink.keep_inside_from_args(args)
    summary = args.format == "text" and not args.full and args.rank is None and domains is None
    if big_world.too_large(world_size) and not (summary and not big_world.too_large(_summary_ranks(placements))):
        write_output(
            big_world.topology_rank_only(
                args, placements, module_kinds, domains is not None, (rank_view, rank_view_lines)
            ),
            args.output,
            stdout,
        )
        return 0
    if args.format == "svg":
        from parallel_state_ng.tools.topology.svg import render_topology_svg

        per = None if domains is None else domains.ranks_per_domain
        text = render_topology_svg(placements, highlight_rank=args.rank, ranks_per_domain=per)
    else:
        alike_groups = args.format == "json" or args.full  # the text report summarises modules of one shape
        report = build_topology_report(placements, kinds=args.kinds, rank=args.rank, alike_groups=alike_groups)
        if domains is not None:
            from parallel_state_ng.tools.topology.nvlink import render_topology_nvlink, topology_nvlink_section

            own = {p.name: k for p, k in zip(placements, _kinds_of(placements), strict=True)}
            report["nvlink"] = topology_nvlink_section(
                placements, domains, keep_inside, own, kinds=args.kinds, suggest=args.suggest_placement, top=args.top
            )
        text = json.dumps(report) + "\n" if args.format == "json" else render_topology_text(report, full=args.full)
        if domains is not None and args.format == "text":
            text += render_topology_nvlink(report["nvlink"])
    write_output(text, args.output, stdout)
    return 0
