"""The upgrade check's report: its findings, per-file results and summary line.

:class:`Finding` is one use whose meaning changes between two releases, :data:`KINDS` the kinds
of finding in the order the summary lists them, :class:`FileCheck` one file's result;
:func:`summary` writes the closing line over all files and :func:`no_equivalent` the fix given
when nothing replaces what was removed; :func:`layout_diff_line` the closing pointer at
``layout --diff`` for the same releases. The checks are in :mod:`.parallel_state_uses` and
:mod:`.grid_uses`; the package re-exports these names. The check: docs/tools.md#upgrade-check.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from parallel_state_ng.releases import Release
from parallel_state_ng.tools.common import plural
from parallel_state_ng.tools.layout.check import diff_command
from parallel_state_ng.tools.port.table import PARALLEL_STATE

__all__ = ["NO_EQUIVALENT", "KINDS", "Finding", "FileCheck", "no_equivalent", "summary", "layout_diff_line"]

NO_EQUIVALENT = "removed, no equivalent"
#: Kinds of breaking findings, in the order the summary lists them.
KINDS = (
    "positional shift",
    "removed keyword",
    "removed init argument",
    "removed function",
    "removed global",
    "changed default",
    "new required parameter",
    "HyperCommGrid",
)


@dataclass(frozen=True)
class Finding:
    """One use whose meaning changes between the two releases."""

    path: str
    line: int
    col: int
    kind: str  # one of KINDS
    use: str  # the use as written (shortened)
    change: str
    fix: str
    fixed_call: str | None = None  # the call as it should read for TO (keyword form, removed arguments dropped)

    def format(self) -> str:
        """``path:line: <use>: <change> -> <fix>``."""
        return f"{self.path}:{self.line}: {self.use}: {self.change} -> {self.fix}"


@dataclass
class FileCheck:
    """The findings of one file, its number of parallel_state uses and the names not covered."""

    path: str
    uses: int = 0
    grid_uses: int = 0  # HyperCommGrid method calls / imports that a change between the releases concerns
    findings: list[Finding] | None = None
    uncovered: Counter | None = None
    error: str | None = None


def no_equivalent(old: Release, new: Release) -> str:
    """The fix for something removed without replacement (worded for an upgrade or a downgrade)."""
    return NO_EQUIVALENT if new.key >= old.key else f"not in {new}, no equivalent"


def summary(checks: list[FileCheck], old: Release, new: Release) -> str:
    """The summary line: files, uses, breaking findings per kind, names the data does not cover."""
    findings = [f for c in checks for f in c.findings or []]
    by_kind = Counter(f.kind for f in findings)
    uncovered: Counter = Counter()
    for c in checks:
        uncovered.update(c.uncovered or {})
    direction = "upgrade" if new.key >= old.key else "downgrade"
    text = (
        f"{direction} {old} -> {new}: scanned {plural(len(checks), 'file')}, "
        f"{plural(sum(c.uses for c in checks), 'use')} of {PARALLEL_STATE} in "
        f"{plural(sum(1 for c in checks if c.uses), 'file')}"
    )
    grid_uses = sum(c.grid_uses for c in checks)
    if grid_uses:
        text += f" and {plural(grid_uses, 'HyperCommGrid use')} concerned by a change"
    text += ": "
    if findings:
        text += f"{len(findings)} break (" + ", ".join(f"{k}: {by_kind[k]}" for k in KINDS if by_kind[k]) + ")"
    else:
        text += "nothing breaks"
    if uncovered:
        names = ", ".join(sorted(uncovered))
        text += (
            f"; {plural(sum(uncovered.values()), 'use')} of names the release data does not cover, "
            f"not checked ({names})"
        )
    errors = sum(1 for c in checks if c.error)
    if errors:
        text += f"; {plural(errors, 'file')} could not be read or parsed"
    return text


def layout_diff_line(old: Release, new: Release) -> str:
    """The report's last line: the ``layout --diff`` command for the same two releases."""
    return (
        f"process groups that change {old.series} -> {new.series} (put your job's sizes): "
        f"{diff_command(old.series, new.series)}"
    )
