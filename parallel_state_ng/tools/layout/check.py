"""``layout --check SNAPSHOT`` and ``layout --diff``: layout snapshots checked and compared.

``--check`` recomputes the layout from a snapshot's configuration and release
(:mod:`parallel_state_ng.layout.snapshot`) and compares (exit 0 with one OK line, 1 with the
differences, 2 for a snapshot that cannot be read). ``--diff`` compares two releases
(``--release A --against B``), two configurations (``--against-set KEY=VALUE``) or two snapshot
files (``--diff A.json B.json``) kind by kind (:mod:`parallel_state_ng.layout.layout_diff`):
exit 0 when they are the same, 1 when they differ, as ``diff`` does. Text or JSON. The tool:
docs/tools.md#snapshots-check-and-diff.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from typing import Any

from parallel_state_ng.layout.bounded_input import MAX_ENUMERATED_RANKS, InputLimitError, read_bounded
from parallel_state_ng.layout.layout_diff import KindChange, LayoutDiff, diff_snapshots
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.snapshot import SnapshotError, layout_of, load_snapshot, snapshot_of
from parallel_state_ng.releases import SUPPORTED_SERIES
from parallel_state_ng.tools.common import UsageError, format_ranks, int_list, plural, positive_int, write_output

__all__ = ["add_arguments", "wanted", "run", "read_snapshot", "render_diff", "AGAINST_KEYS", "diff_command"]

LayoutBuilder = Callable[[argparse.Namespace], MegatronLayout]

#: ``--against-set`` keys: the layout option (without ``--``) -> (argparse dest, value type).
AGAINST_KEYS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "world-size": ("world_size", positive_int),
    "tp": ("tp", positive_int),
    "pp": ("pp", positive_int),
    "cp": ("cp", positive_int),
    "ep": ("ep", positive_int),
    "etp": ("etp", positive_int),
    "order": ("order", str),
    "num-dist-opt-instances": ("num_dist_opt_instances", positive_int),
    "hcp-sizes": ("hcp_sizes", int_list),
    "gtp-remat-size": ("gtp_remat_size", positive_int),
    "expert-gtp-remat-size": ("expert_gtp_remat_size", positive_int),
}
# Options that set the configuration (dest, option, default): --check reads it from the snapshot.
_CONFIG_OPTIONS = (
    ("world_size", "--world-size", None),
    ("tp", "--tp", 1),
    ("pp", "--pp", 1),
    ("cp", "--cp", 1),
    ("ep", "--ep", 1),
    ("etp", "--etp", None),
    ("order", "--order", "tp-cp-ep-dp-pp"),
    ("num_dist_opt_instances", "--num-dist-opt-instances", 1),
    ("hcp_sizes", "--hcp-sizes", None),
    ("gtp_remat_size", "--gtp-remat-size", 1),
    ("expert_gtp_remat_size", "--expert-gtp-remat-size", 1),
    ("release", "--release", None),
)
# Report options that mean nothing to --check / --diff (dest, option, default).
_REPORT_OPTIONS = (
    ("rank", "--rank", None),
    ("kinds", "--kinds", None),
    ("share", "--share", False),
    ("no_gloo_twins", "--no-gloo-twins", False),
    ("gpus_per_node", "--gpus-per-node", None),
)
_RULE_TEXT = {"init": "the init timeout", "torch": "torch's default timeout"}
_SHOWN = 4  # groups / moved ranks shown per kind without --full


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--check``, ``--diff``, ``--against`` and ``--against-set`` to the layout command."""
    snap = parser.add_argument_group("snapshots (--format json writes one)")
    snap.add_argument(
        "--check",
        metavar="SNAPSHOT",
        default=None,
        help="recompute the layout from SNAPSHOT's configuration and release ('-': stdin); exit 0 when it "
        "matches, 1 with the differences, 2 when SNAPSHOT cannot be read",
    )
    snap.add_argument(
        "--diff",
        nargs="*",
        metavar="SNAPSHOT",
        default=None,
        help="compare two layouts kind by kind: two SNAPSHOT files, or (no file) this configuration under "
        "--release and --against / --against-set; exit 0 when the same, 1 when they differ",
    )
    snap.add_argument("--against", metavar="RELEASE", default=None, help="--diff: the other release, e.g. 0.19")
    snap.add_argument(
        "--against-set",
        metavar="KEY=VALUE",
        action="append",
        default=None,
        help=f"--diff: change one option on the other side, e.g. order=tp-pp-dp (keys: {', '.join(AGAINST_KEYS)})",
    )


def wanted(args: argparse.Namespace) -> bool:
    """Whether the parsed options ask for ``--check`` or ``--diff``."""
    return args.check is not None or args.diff is not None or bool(args.against or args.against_set)


def diff_command(old: str, new: str, config_options: str = "--world-size 8 --tp 2 --pp 2") -> str:
    """The ``layout --diff`` command line that compares the layouts of releases ``old`` and ``new``."""
    return f"python -m parallel_state_ng layout {config_options} --diff --release {old} --against {new}"


# --------------------------------------------------------------------------- reading
def read_snapshot(path: str, option: str) -> dict[str, Any]:
    """Read and validate the snapshot at ``path`` (``-``: stdin); a bad one raises :class:`UsageError`.

    Read through :func:`~parallel_state_ng.layout.bounded_input.read_bounded` (the size limit
    before the whole file is read), then :func:`load_snapshot` (depth, schema, world-size limit).
    """
    source = f"snapshot {'<stdin>' if path == '-' else path}"
    try:
        return load_snapshot(read_bounded(path, source), source)
    except (SnapshotError, InputLimitError) as err:
        raise UsageError(str(err), option) from None


def _recompute(snapshot: dict[str, Any], source: str, option: str) -> dict[str, Any]:
    try:
        return snapshot_of(layout_of(snapshot["config"], snapshot["release"]))
    except (RuntimeError, AssertionError, KeyError, ValueError, TypeError) as err:
        text = err.args[0] if err.args and isinstance(err.args[0], str) else str(err)
        raise UsageError(
            f"{source}: config: megatron-core {snapshot['release']} cannot build this configuration: {text}", option
        ) from None


def _refuse(args: argparse.Namespace, options: tuple, why: str) -> None:
    given = [option for dest, option, default in options if getattr(args, dest, default) != default]
    if given:
        raise UsageError(f"{', '.join(given)} cannot be combined with {why}")


# --------------------------------------------------------------------------- text
def _config_text(config: dict[str, Any]) -> str:
    text = (
        f"world size {config['world_size']}: tp={config['tensor_model_parallel_size']} "
        f"pp={config['pipeline_model_parallel_size']} cp={config['context_parallel_size']} "
        f"ep={config['expert_model_parallel_size']} etp={config['expert_tensor_parallel_size']} "
        f"order={config['order']}"
    )
    if config["num_distributed_optimizer_instances"] != 1:
        text += f" num_distributed_optimizer_instances={config['num_distributed_optimizer_instances']}"
    if config["hierarchical_context_parallel_sizes"]:
        text += f" hcp={config['hierarchical_context_parallel_sizes']}"
    if config["gtp_remat_size"] != 1 or config["expert_gtp_remat_size"] != 1:
        text += f" gtp={config['gtp_remat_size']} egtp={config['expert_gtp_remat_size']}"
    return text


def _groups_text(groups: list[list[int]], full: bool) -> str:
    shown = groups if full else groups[:_SHOWN]
    more = "" if len(shown) == len(groups) else f", ... ({len(groups) - len(shown)} more)"
    return ", ".join(format_ranks(g, full) for g in shown) + more


def _change_lines(change: KindChange, diff: LayoutDiff, full: bool) -> list[str]:
    if change.entry is not None:
        side = diff.new_label if change.status == "added" else diff.old_label
        groups = change.entry["groups"]
        mark = "+" if change.status == "added" else "-"
        return [f"  {mark} {change.kind} [{change.entry['desc']}]: only in {side}: {plural(len(groups), 'group')}"]
    lines = [f"  ~ {change.kind} [{change.new_desc}]:"]
    if change.desc:
        lines.append(f"      group_desc {change.desc[0]} -> {change.desc[1]}")
    if change.timeout:
        why = f" (ReleaseFacts.{change.flipped_by})" if change.flipped_by else ""
        lines.append(f"      timeout {_RULE_TEXT[change.timeout[0]]} -> {_RULE_TEXT[change.timeout[1]]}{why}")
    if change.gloo:
        lines.append(f"      gloo twin {json.dumps(change.gloo[0])} -> {json.dumps(change.gloo[1])}")
    if change.moved:
        lines.append(
            f"      {plural(len(change.removed), 'group')} removed, {len(change.added)} added, "
            f"{plural(len(change.moved), 'rank')} change group"
        )
        if change.removed:
            lines.append(f"      removed: {_groups_text(change.removed, full)}")
        if change.added:
            lines.append(f"      added:   {_groups_text(change.added, full)}")
        moves = change.moved if full else change.moved[:_SHOWN]
        for move in moves:
            old = "no group" if move.old is None else format_ranks(move.old, full)
            new = "no group" if move.new is None else format_ranks(move.new, full)
            same = move.old is not None and move.new is not None and sorted(move.old) == sorted(move.new)
            lines.append(f"      rank {move.rank}: {old} -> {new}" + (" (same ranks, another order)" if same else ""))
        if len(moves) < len(change.moved):
            lines.append(f"      ... {len(change.moved) - len(moves)} more ranks (--full shows all)")
    return lines


def _span(counts: list[int]) -> str:
    low, high = min(counts, default=0), max(counts, default=0)
    return str(low) if low == high else f"{low}-{high}"


def render_diff(diff: LayoutDiff, full: bool = False) -> list[str]:
    """Text lines of a diff: configurations, one block per changed kind, communicators per rank."""
    lines = []
    if diff.old_config == diff.new_config:
        lines.append(f"  configuration: {_config_text(dict(diff.old_config))}")
    else:
        lines.append(f"  {diff.old_label}: {_config_text(dict(diff.old_config))}")
        lines.append(f"  {diff.new_label}: {_config_text(dict(diff.new_config))}")
    counts = {s: sum(c.status == s for c in diff.changes) for s in ("added", "removed", "changed")}
    lines.append(
        f"  kinds: {counts['added']} appear, {counts['removed']} vanish, {counts['changed']} change, "
        f"{len(diff.unchanged)} unchanged"
    )
    for change in diff.changes:
        lines += _change_lines(change, diff, full)
    moved = diff.communicator_changes()
    spans = f"{diff.old_label} {_span(diff.old_communicators)}, {diff.new_label} {_span(diff.new_communicators)}"
    lines.append(
        f"  communicators per rank (gloo twins on, no sharing): {spans}; "
        + (f"{plural(len(moved), 'rank')} change" if moved else "no rank changes")
    )
    shown = moved if full else moved[:_SHOWN]
    if shown:
        text = ", ".join(f"rank {r} {'-' if a is None else a} -> {'-' if b is None else b}" for r, a, b in shown)
        lines.append(f"    {text}" + ("" if len(shown) == len(moved) else f", ... ({len(moved) - len(shown)} more)"))
    return lines


# --------------------------------------------------------------------------- commands
def _run_check(args: argparse.Namespace, stdout: Any) -> int:
    _refuse(args, _CONFIG_OPTIONS, "--check (the snapshot states the configuration and release)")
    snapshot = read_snapshot(args.check, "--check")
    name = "<stdin>" if args.check == "-" else args.check
    now = _recompute(snapshot, f"snapshot {name}", "--check")
    diff = diff_snapshots(snapshot, now, "snapshot", "recomputed")
    groups = sum(len(e["groups"]) for e in now["kinds"].values())
    what = f"megatron-core {snapshot['release']}, {_config_text(snapshot['config'])}"
    if args.format == "json":
        text = json.dumps({"snapshot": name, "ok": diff.same, "diff": diff.as_json()}) + "\n"
    elif diff.same:
        text = f"OK: {name} matches the layout recomputed for {what} ({len(now['kinds'])} kinds, {groups} groups)\n"
    else:
        text = "\n".join(
            [f"FAILED: {name} differs from the layout recomputed for {what} (snapshot -> recomputed):"]
            + render_diff(diff, args.full)
        )
        text += "\n"
    write_output(text, args.output, stdout)
    return 0 if diff.same else 1


def _against_args(args: argparse.Namespace) -> tuple[argparse.Namespace, str]:
    other = copy.copy(args)
    label = []
    if args.against is not None:
        if args.against not in SUPPORTED_SERIES:
            raise UsageError(
                f"release {args.against!r} is not supported; supported: {', '.join(SUPPORTED_SERIES)}", "--against"
            )
        other.release = args.against
    for item in args.against_set or []:
        key, sep, value = item.partition("=")
        if not sep or key not in AGAINST_KEYS:
            keys = ", ".join(AGAINST_KEYS)
            raise UsageError(f"expected KEY=VALUE with KEY one of {keys}, got {item!r}", "--against-set")
        dest, parse = AGAINST_KEYS[key]
        try:
            setattr(other, dest, parse(value))
        except (argparse.ArgumentTypeError, ValueError) as err:
            raise UsageError(f"{key}: {err}", "--against-set") from None
        label.append(f"{key}={value}")
    return other, " ".join(label)


def _side(args: argparse.Namespace, label: str, build_layout: LayoutBuilder) -> dict[str, Any]:
    try:
        return snapshot_of(build_layout(args))
    except UsageError as err:
        raise UsageError(f"{label}: {err}") from None


def _run_diff(args: argparse.Namespace, stdout: Any, build_layout: LayoutBuilder) -> int:
    files = args.diff or []
    if files:
        if len(files) != 2:
            raise UsageError(f"takes two snapshot files or none, got {len(files)}: {files}", "--diff")
        _refuse(args, _CONFIG_OPTIONS, "--diff A.json B.json (the snapshots state their configurations)")
        if args.against is not None or args.against_set:
            raise UsageError("--against / --against-set compare configurations; --diff A.json B.json compares files")
        old, new = (read_snapshot(path, "--diff") for path in files)
        old_label, new_label = files
    else:
        if args.world_size is None:
            raise UsageError("--diff without snapshot files compares this configuration: give --world-size")
        if args.against is None and not args.against_set:
            raise UsageError("--diff without snapshot files needs --against RELEASE or --against-set KEY=VALUE")
        other, changed = _against_args(args)
        for side, option in ((args, "--world-size"), (other, "--against-set")):
            if side.world_size > MAX_ENUMERATED_RANKS:
                raise UsageError(
                    f"{side.world_size} ranks is over the limit of {MAX_ENUMERATED_RANKS} ranks that --diff "
                    "enumerates group by group",
                    option,
                )
        old = _side(args, "this side (--release)", build_layout)
        new = _side(
            other, f"the other side (--against {args.against})" if args.against else "--against-set", build_layout
        )
        old_label = old["release"]
        new_label = new["release"] + (f" with {changed}" if changed else "")
    diff = diff_snapshots(old, new, old_label, new_label)
    if args.format == "json":
        text = json.dumps(diff.as_json()) + "\n"
    else:
        head = f"layout diff {old_label} -> {new_label}: " + ("the same" if diff.same else "they differ")
        text = "\n".join([head, *render_diff(diff, args.full)]) + "\n"
    write_output(text, args.output, stdout)
    return 0 if diff.same else 1


def run(args: argparse.Namespace, stdout: Any, build_layout: LayoutBuilder) -> int:
    """Run ``--check`` or ``--diff`` for parsed ``args``; returns the exit code.

    ``build_layout``: the layout command's options -> MegatronLayout (raising :class:`UsageError`).
    """
    if args.check is not None and args.diff is not None:
        raise UsageError("--check and --diff are two commands: give one")
    if args.diff is None and args.check is None:
        raise UsageError("--against / --against-set only go with --diff")
    if args.format == "svg":
        raise UsageError("--check and --diff write text or json, not svg", "--format")
    _refuse(args, _REPORT_OPTIONS, "--check / --diff (they compare whole layouts)")
    return _run_check(args, stdout) if args.check is not None else _run_diff(args, stdout, build_layout)
