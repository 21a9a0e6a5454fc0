"""Command line of parallel_state_ng: ``python -m parallel_state_ng <command>`` (or ``parallel-state-ng``).

Commands: ``layout`` (every group Megatron-Core builds for a configuration), ``port`` (uses of
``megatron.core.parallel_state`` in a codebase, their rewrite, ``--upgrade FROM:TO``),
``topology SPEC`` (a multi-module topology) and ``diagnose DUMP_DIR`` (a hang's culprit from
flight-recorder dumps). Bad input: a message on stderr naming the option,
exit code 2. See docs/tools.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]

PROG = "parallel-state-ng"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per command."""
    from parallel_state_ng.tools.diagnose import command as diagnose_command
    from parallel_state_ng.tools.layout import report as layout_report
    from parallel_state_ng.tools.port import port
    from parallel_state_ng.tools.topology import report as topology_report

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Tools of parallel_state_ng: inspect Megatron-Core process-group layouts and multi-module "
        "topologies, port code to compat.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    layout = commands.add_parser(
        "layout",
        help="show the process groups of a configuration (no processes, no GPUs)",
        description="Show every process group Megatron-Core's initialize_model_parallel builds for a "
        "configuration, one rank's view and node locality. Pure layout math.",
    )
    layout_report.add_arguments(layout)
    layout.set_defaults(handler=layout_report.run)
    porting = commands.add_parser(
        "port",
        help="find megatron.core.parallel_state uses and switch them to compat",
        description="Scan Python files for uses of megatron.core.parallel_state; report each with its "
        "compat.parallel_state equivalent; --rewrite prints the import-switching diff, --apply writes it; "
        "--upgrade FROM:TO reports what breaks moving between two megatron-core releases.",
    )
    port.add_arguments(porting)
    porting.set_defaults(handler=port.run)
    topology = commands.add_parser(
        "topology",
        help="show a multi-module topology from a JSON spec (no processes, no GPUs)",
        description="Validate a multi-module topology (a JSON list of modules, as build_topology takes them) and "
        "show each module's ranks, sizes and process groups, one rank's modules and groups, or an SVG of the "
        "modules as blocks along the rank axis. Pure layout math.",
    )
    topology_report.add_arguments(topology)
    topology.set_defaults(handler=topology_report.run)
    diagnosing = commands.add_parser(
        "diagnose",
        help="name the culprit of a hang from flight-recorder dumps (no processes, no GPUs)",
        description="Read torch's flight-recorder dumps (NCCL or gloo) or the hang watch's records, one file per "
        "rank, and name the likely culprit of a hang: the stuck group's kinds, coordinates and ranks, the ranks "
        "that did not arrive, what each was doing and the chain of waits. Pure layout math over the dumps.",
    )
    diagnose_command.add_arguments(diagnosing)
    diagnosing.set_defaults(handler=diagnose_command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    from parallel_state_ng.tools.common import UsageError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # argparse: --help (0) or a usage error (2, already printed)
        return done.code if isinstance(done.code, int) else 2
    try:
        return args.handler(args, sys.stdout)
    except UsageError as err:
        print(f"{PROG} {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
