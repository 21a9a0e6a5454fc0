"""``python -m parallel_state_ng port PATH --upgrade FROM:TO``: what breaks moving between releases.

Every use of ``megatron.core.parallel_state`` in PATH (found by
:mod:`~parallel_state_ng.tools.port.source_scan`, as ``port`` finds them) whose meaning changes
from release FROM to TO (any two of ``KNOWN_SERIES``, either direction) is reported as
``file:line: <use>: <change> -> <fix>``, of one of :data:`KINDS`, from the facts compat serves
each release from; exit status 1 when something breaks. The rooms: :mod:`.parallel_state_uses`
and :mod:`.grid_uses` (the checks), :mod:`.report` (findings and summary), :mod:`.check` (the
command). Not followed: a function passed by reference whose parameters moved (its removal is
reported), calls through ``*args`` (reported when a moved position may be among them). The
check: docs/tools.md#upgrade-check.
"""

from __future__ import annotations

from parallel_state_ng.tools.port.upgrade.check import check_file, check_source, parse_upgrade, run
from parallel_state_ng.tools.port.upgrade.report import (
    KINDS,
    NO_EQUIVALENT,
    FileCheck,
    Finding,
    layout_diff_line,
    no_equivalent,
    summary,
)

__all__ = [
    "Finding",
    "FileCheck",
    "KINDS",
    "NO_EQUIVALENT",
    "parse_upgrade",
    "check_source",
    "check_file",
    "run",
    "summary",
    "layout_diff_line",
    "no_equivalent",
]
