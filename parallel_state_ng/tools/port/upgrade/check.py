"""``port PATH --upgrade FROM:TO``'s command: releases parsed, files checked, report printed.

:func:`parse_upgrade` reads ``FROM:TO``; :func:`check_source` and :func:`check_file` run both
checks (:mod:`.parallel_state_uses`, :mod:`.grid_uses`) over one source; :func:`run` prints every
file's findings and the summary (:mod:`.report`).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from typing import Any

from parallel_state_ng.releases import KNOWN_SERIES, Release, parse_release
from parallel_state_ng.tools.common import UsageError
from parallel_state_ng.tools.port.source_scan import Unreadable, load_file, parse_source, python_files
from parallel_state_ng.tools.port.table import PARALLEL_STATE
from parallel_state_ng.tools.port.upgrade.grid_uses import grid_checks
from parallel_state_ng.tools.port.upgrade.parallel_state_uses import UseChecker
from parallel_state_ng.tools.port.upgrade.report import KINDS, FileCheck, layout_diff_line, summary

__all__ = ["parse_upgrade", "check_source", "check_file", "run"]


def parse_upgrade(text: str) -> tuple[Release, Release]:
    """``"0.13:0.19"`` (patch versions allowed) -> the two releases; both must be known series.

    Raises:
        UsageError: not ``FROM:TO``, not a version, or a series the data does not know.
    """
    parts = text.split(":")
    if len(parts) != 2:
        raise UsageError(f"expected FROM:TO (e.g. 0.14:0.19), got {text!r}", "--upgrade")
    releases = []
    for part in parts:
        try:
            release = parse_release(part)
        except ValueError:
            raise UsageError(
                f"{part!r} is not a megatron-core release (expected e.g. 0.19 or 0.19.2)", "--upgrade"
            ) from None
        if release.series not in KNOWN_SERIES:
            raise UsageError(
                f"megatron-core {part} is not a release the data knows ({', '.join(KNOWN_SERIES)})", "--upgrade"
            )
        releases.append(release)
    return releases[0], releases[1]


# --------------------------------------------------------------------------- files
def check_source(
    source: str, old: Release, new: Release, path: str = "<string>", package: str | None = None
) -> FileCheck:
    """The findings for Python ``source`` moving from release ``old`` to ``new``."""
    result = FileCheck(path=path, findings=[], uncovered=Counter())
    tree, result.error = parse_source(source, path)
    if tree is None:
        return result
    checker = UseChecker(path, source, tree, package, old, new)
    checker.find_uses()
    for node in checker.imports:
        if isinstance(node, ast.ImportFrom) and checker.module_of(node) == PARALLEL_STATE:
            for alias in node.names:
                if alias.name != "*":
                    checker.imported_name(node, alias.name)
    grid_checks(checker)
    result.uses = checker.uses
    result.grid_uses = checker.grid_uses
    result.findings = sorted(checker.findings, key=lambda f: (f.line, f.col, KINDS.index(f.kind)))
    result.uncovered = checker.uncovered
    return result


def check_file(path: str, old: Release, new: Release) -> FileCheck:
    """:func:`check_source` on a file (relative imports resolved from its ``__init__.py`` parents)."""
    try:
        source, _, package = load_file(path)
    except Unreadable as err:
        return FileCheck(path=path, findings=[], uncovered=Counter(), error=str(err))
    return check_source(source, old, new, path, package)


def run(args: argparse.Namespace, stdout: Any) -> int:
    """``port PATH --upgrade FROM:TO``: print the findings and the summary; 1 if something breaks."""
    if args.rewrite or args.apply:
        raise UsageError("--upgrade reports only; it cannot be combined with --rewrite or --apply", "--upgrade")
    old, new = parse_upgrade(args.upgrade)
    checks = [check_file(p, old, new) for p in python_files(args.path)]
    for check in checks:
        if check.error:
            print(check.error, file=sys.stderr)
        for finding in check.findings or []:
            print(finding.format(), file=stdout)
    print(summary(checks, old, new), file=stdout)
    print(layout_diff_line(old, new), file=stdout)
    return 1 if any(c.findings for c in checks) else 0
