"""Command-line tools of parallel_state_ng (``python -m parallel_state_ng <command>``).

* :mod:`.layout_report` — ``layout``: every process group Megatron-Core would build for a
  configuration, one rank's view, node locality; text, JSON or SVG. Pure math, no processes.
* :mod:`.svg` — the SVG picture used by ``layout --format svg``.
* :mod:`.topology_report` — ``topology SPEC``: a multi-module topology (JSON spec) module by
  module, one rank's modules and groups; text, JSON or SVG (:mod:`.topology_svg`). Pure math.
* :mod:`.port` — ``port``: find uses of ``megatron.core.parallel_state`` in a codebase and
  switch its imports to ``compat.parallel_state``.
* :mod:`.upgrade` — ``port --upgrade FROM:TO``: the uses whose meaning changes between two
  megatron-core releases, with the fix.
"""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """Bad command-line input, reported on stderr with exit code 2 (no traceback).

    With ``option`` the message reads ``argument OPTION: message`` (argparse's style);
    without, ``message`` must itself name the option(s) at fault.
    """

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(f"argument {option}: {message}" if option else message)
        self.option = option
        self.message = message
