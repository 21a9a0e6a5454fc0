"""``parallel-state-ng diagnose DUMP_DIR [--layout SNAPSHOT | layout options]``.

Reads every dump in ``DUMP_DIR`` (torch's flight-recorder dumps, NCCL or gloo, pickle or
JSON; the hang watch's own records, same format; a file's rank is the number its name ends
with), places each group through the layout (a snapshot in the regression kit's format, or the
``layout`` command's size options) and prints the report: the likely culprit, the stuck
group's kinds, coordinates and ranks, the ranks that did not arrive and the chain of waits.
Without a layout the report names kinds from the descriptions and ranks from the dumps only.
Exit code 0 when a culprit is named, 1 when none is (nothing stuck, or a cycle), 2 on bad input.
"""

from __future__ import annotations

import argparse
from typing import Any

from parallel_state_ng.layout.hang import Placer, diagnose, read_dump_dir, render
from parallel_state_ng.layout.hang.flight_recorder import DumpError
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.snapshot import layout_of
from parallel_state_ng.tools.common import UsageError, write_output
from parallel_state_ng.tools.layout.check import read_snapshot
from parallel_state_ng.tools.layout.report import add_arguments as add_layout_arguments
from parallel_state_ng.tools.layout.report import build_layout

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``diagnose`` command's options to ``parser``."""
    parser.add_argument("dump_dir", metavar="DUMP_DIR", help="folder of flight-recorder dumps, one file per rank")
    parser.add_argument(
        "--layout",
        dest="snapshot",
        action="append",
        default=None,
        metavar="[NAME=]SNAPSHOT",
        help="layout snapshot (layout --format json) to place the groups in, or give the layout options; "
        "repeat as NAME=SNAPSHOT for several layouts in one job (the report names which)",
    )
    sizes = parser.add_argument_group("layout (the layout command's options; --world-size sets it)")
    for option, kwargs in _layout_options():
        sizes.add_argument(option, **kwargs)
    parser.add_argument("--output", "-o", default=None, help="write to this file instead of stdout")


def _layout_options() -> list[tuple[str, dict[str, Any]]]:
    """The size options of the layout command, as it defines them (read once from its parser)."""
    probe = argparse.ArgumentParser(add_help=False)
    add_layout_arguments(probe)
    wanted = (
        *("--world-size", "--tp", "--pp", "--cp", "--ep", "--etp", "--order", "--num-dist-opt-instances"),
        *("--hcp-sizes", "--gtp-remat-size", "--expert-gtp-remat-size", "--release"),
    )
    out = []
    for action in probe._actions:
        option = next((o for o in action.option_strings if o in wanted), None)
        if option is not None:
            out.append((option, {"type": action.type, "default": action.default, "help": action.help}))
    return out


def _layout(args: argparse.Namespace) -> MegatronLayout | dict[str, MegatronLayout] | None:
    if args.snapshot:
        if args.world_size is not None:
            raise UsageError("give either --layout SNAPSHOT or the layout options, not both", "--layout")
        named: dict[str, MegatronLayout] = {}
        for given in args.snapshot:
            name, _, path = given.rpartition("=") if "=" in given else ("", "", given)
            if name in named:
                raise UsageError(f"layout name {name!r} given twice (use NAME=SNAPSHOT for several)", "--layout")
            snapshot = read_snapshot(path, "--layout")
            try:
                named[name] = layout_of(snapshot["config"], snapshot["release"])
            except (RuntimeError, AssertionError, KeyError, ValueError, TypeError) as err:
                raise UsageError(f"the layout of {path!r} cannot be built: {err}", "--layout") from None
        return named[""] if list(named) == [""] else named
    if args.world_size is None:
        return None
    return build_layout(args)


def run(args: argparse.Namespace, stdout: Any) -> int:
    """Run ``diagnose``; returns the exit code."""
    placer = Placer(_layout(args))
    try:
        records = read_dump_dir(args.dump_dir, placer)
    except DumpError as err:
        raise UsageError(str(err), "DUMP_DIR") from None
    found = diagnose(records, placer)
    write_output(render(found, placer) + "\n", args.output, stdout)
    return 0 if found.culprit is not None else 1
