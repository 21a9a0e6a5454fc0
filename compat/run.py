"""``python -m compat.run``: run an unchanged Megatron program on compat.

``python -m compat.run [--hyper-comm-grid] SCRIPT [ARGS...]`` and ``python -m compat.run
[--hyper-comm-grid] -m MODULE [ARGS...]`` (console script: ``compat-run``) call
:func:`compat.install` and then run the program as ``python SCRIPT ARGS`` / ``python -m MODULE
ARGS`` would: ``sys.argv`` is ``[SCRIPT, *ARGS]`` (for a module, its file), the program runs as
``__main__``, ``sys.path[0]`` is the script's directory (the current directory for ``-m``), and
its exit status and any exception come out unchanged. Under ``torchrun`` and ``srun`` every
process the launcher starts runs the runner. Usage errors (no program, a missing script or
module, an unknown runner option, a runner option after the program's name) print one line and
exit with status 2 before the program runs. See docs/compat.md (Run your Megatron job on
compat).
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Program", "RunnerUsageError", "main", "parse_args", "run"]

PROG = "python -m compat.run"
USAGE = f"usage: {PROG} [--hyper-comm-grid] SCRIPT [ARGS...]  |  {PROG} [--hyper-comm-grid] -m MODULE [ARGS...]"
HELP = f"""{USAGE}

Run a Megatron program on compat, unchanged: compat.install() first, then the program exactly
as `python SCRIPT ARGS` or `python -m MODULE ARGS` runs it (sys.argv, __main__, sys.path[0],
exit status). Runner options come before the program; everything after it is the program's.

options:
  --hyper-comm-grid  also serve megatron.core.hyper_comm_grid.HyperCommGrid from the engine
                     (compat.install(hyper_comm_grid=True); megatron-core 0.14 and later)
  -m MODULE          run a module as `python -m MODULE` does
  -h, --help         show this help and exit
"""
#: Options of the runner; one of them after the program's name is refused (it would go to the program).
RUNNER_OPTIONS = ("--hyper-comm-grid",)


class RunnerUsageError(ValueError):
    """A command line the runner cannot run (exit status 2, one line on stderr)."""


@dataclass(frozen=True)
class Program:
    """What to run: a script path or a module name, its arguments, and the install options."""

    target: str
    args: tuple[str, ...]
    module: bool = False
    hyper_comm_grid: bool = False


def parse_args(argv: Sequence[str]) -> Program | None:
    """The runner's command line (after ``compat.run``) -> :class:`Program`; None for ``--help``.

    Raises:
        RunnerUsageError: no program, an unknown runner option, ``-m`` without a module, or a
            runner option among the program's arguments.
    """
    hyper_comm_grid = False
    for i, arg in enumerate(argv):
        if arg in ("-h", "--help"):
            return None
        if arg == "--hyper-comm-grid":
            hyper_comm_grid = True
            continue
        if arg.startswith("-m"):
            name = arg[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            if not name:
                raise RunnerUsageError("-m needs a module name (-m MODULE [ARGS...])")
            rest = argv[i + 1 :] if arg[2:] else argv[i + 2 :]
            return _checked(Program(name, tuple(rest), module=True, hyper_comm_grid=hyper_comm_grid))
        if arg.startswith("-"):
            raise RunnerUsageError(
                f"unknown runner option {arg!r} (runner options: --hyper-comm-grid, -m MODULE; they come "
                "before the program)"
            )
        return _checked(Program(arg, tuple(argv[i + 1 :]), hyper_comm_grid=hyper_comm_grid))
    raise RunnerUsageError("no program given: name a SCRIPT or -m MODULE")


def _checked(program: Program) -> Program:
    """Refuse a runner option after the program's name: it would silently go to the program."""
    for arg in program.args:
        flag = arg.split("=", 1)[0]
        if flag in RUNNER_OPTIONS:
            what = f"-m {program.target}" if program.module else program.target
            raise RunnerUsageError(
                f"{flag} comes after {what}, so it belongs to the program, not the runner; put it before: "
                f"{PROG} {flag} {what} ..."
            )
    return program


def _check_script(path: str) -> None:
    if not os.path.exists(path):
        raise RunnerUsageError(f"can't open file {os.path.abspath(path)!r}: no such file or directory")
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "__main__.py")):
        raise RunnerUsageError(f"can't find '__main__' module in {path!r}")


def _check_module(name: str) -> None:
    """Raise :class:`RunnerUsageError` unless ``name`` can run as ``python -m name`` (imports its parents)."""
    try:
        spec = importlib.util.find_spec(name)
        package = spec is not None and spec.submodule_search_locations is not None
        main_spec = importlib.util.find_spec(f"{name}.__main__") if package else None
    except (ImportError, ValueError) as exc:
        raise RunnerUsageError(f"no module named {name!r} ({type(exc).__name__}: {exc})") from None
    if spec is None:
        raise RunnerUsageError(f"no module named {name!r}")
    if package and main_spec is None:
        raise RunnerUsageError(f"no module named {name}.__main__; {name!r} is a package and cannot be run")


def _install(hyper_comm_grid: bool) -> None:
    import compat
    from parallel_state_ng.releases import UnsupportedReleaseError

    try:
        compat.install(hyper_comm_grid=hyper_comm_grid)
    except UnsupportedReleaseError as exc:
        raise RunnerUsageError(f"--hyper-comm-grid: {exc}") from None


def run(program: Program) -> None:
    """Install compat and run ``program`` as Python runs a script or ``-m`` module.

    ``sys.path[0]`` becomes the script's directory (symbolic links resolved) or, with ``-m``,
    the current directory, before compat is installed, so that the megatron-core next to the
    program is the one compat serves. Whatever the program raises (``SystemExit`` included)
    propagates.

    Raises:
        RunnerUsageError: the script or module does not exist, or ``--hyper-comm-grid`` for a
            release without ``HyperCommGrid`` (nothing is installed or run then).
    """
    if program.module:
        sys.path[0] = os.getcwd()
        if importlib.util.find_spec(program.target.split(".")[0]) is None:
            raise RunnerUsageError(f"no module named {program.target.split('.')[0]!r}")
        _install(program.hyper_comm_grid)
        _check_module(program.target)  # after install: its parent packages may import megatron
        sys.argv[:] = [program.target, *program.args]  # argv[0] becomes the module's file
        runpy.run_module(program.target, run_name="__main__", alter_sys=True)
        return
    _check_script(program.target)
    path = program.target
    sys.path[0] = os.path.dirname(os.path.realpath(path)) if os.path.isfile(path) else path
    _install(program.hyper_comm_grid)
    sys.argv[:] = [path, *program.args]
    runpy.run_path(path, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
    """The runner's entry point: the program's own exit status passes through as ``SystemExit``
    (or its exception propagates); 0 when it returns, 2 for a usage error.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        program = parse_args(args)
        if program is None:
            print(HELP, end="")
            return 0
        run(program)
    except RunnerUsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
