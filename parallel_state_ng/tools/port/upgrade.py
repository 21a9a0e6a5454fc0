"""``python -m parallel_state_ng port PATH --upgrade FROM:TO``: what breaks moving between releases.

Every use of ``megatron.core.parallel_state`` in PATH (found by :mod:`.source_scan`, as ``port``
finds them) whose meaning changes from release FROM to TO (any two of ``KNOWN_SERIES``, either
direction) is reported as ``file:line: <use>: <change> -> <fix>``, of one of :data:`KINDS`, from
the facts compat serves each release from; exit status 1 when something breaks. The findings and
summary are in :mod:`.upgrade_report` (re-exported here). Not followed: a function passed by
reference whose parameters moved (its removal is reported), calls through ``*args`` (reported when
a moved position may be among them). The check: docs/tools.md#upgrade-check.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
from collections import Counter
from typing import Any

from parallel_state_ng.releases import KNOWN_SERIES, Release, parse_release
from parallel_state_ng.releases import hyper_comm_grid as grid_facts
from parallel_state_ng.releases import parallel_state as facts
from parallel_state_ng.tools.common import UsageError
from parallel_state_ng.tools.port.source_scan import (
    FileImports,
    Unreadable,
    load_file,
    parse_source,
    python_files,
    shorten,
)
from parallel_state_ng.tools.port.table import PARALLEL_STATE
from parallel_state_ng.tools.port.upgrade_report import (  # noqa: F401 (re-exported)
    KINDS,
    NO_EQUIVALENT,
    FileCheck,
    Finding,
    layout_diff_line,
    summary,
)
from parallel_state_ng.tools.port.upgrade_report import no_equivalent as _no_equivalent

__all__ = ["Finding", "FileCheck", "KINDS", "parse_upgrade", "check_source", "check_file", "run"]

HYPER_COMM_GRID = "megatron.core.hyper_comm_grid"
INIT = "initialize_model_parallel"


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


# --------------------------------------------------------------------------- signatures
def _names(params: tuple) -> list[str]:
    return [name for name, _ in params]


def _value(default: Any) -> str:
    return "<required>" if default is facts.REQUIRED else repr(default)


def _api(release: Release) -> tuple[dict[str, tuple], dict[str, Any]]:
    """(callable -> parameters, global -> import value) of ``release``; ``RankGenerator`` is a callable."""
    functions = dict(facts.functions(release))
    functions["RankGenerator"] = facts.rank_generator_methods(release)["__init__"]
    return functions, facts.globals_of(release)


def _fix_removed(key: str, old: Release, new: Release) -> str:
    replacement = facts.replacement(key, new)
    return f"use {replacement}" if replacement else _no_equivalent(old, new)


class _Checker(FileImports):
    """Checks one file's uses against the two releases' facts."""

    def __init__(
        self, path: str, source: str, tree: ast.Module, package: str | None, old: Release, new: Release
    ) -> None:
        super().__init__(path, source, tree, package)
        self.old, self.new = old, new
        self.old_functions, self.old_globals = _api(old)
        self.new_functions, self.new_globals = _api(new)
        self.findings: list[Finding] = []
        self.uncovered: Counter = Counter()
        self.uses = 0
        self.grid_uses = 0

    def add(
        self, node: ast.expr | ast.stmt, kind: str, use: str, change: str, fix: str, fixed_call: str | None = None
    ) -> None:
        self.findings.append(
            Finding(self.path, node.lineno, node.col_offset, kind, shorten(use), change, fix, fixed_call)
        )

    def removed(self, node: ast.expr | ast.stmt, kind: str, use: str, name: str, note: str = "") -> None:
        """A use of ``name``, which ``TO`` lacks (``kind``: removed function or global)."""
        self.add(node, kind, use, f"{name} does not exist in {self.new}{note}", _fix_removed(name, self.old, self.new))

    def text(self, node: ast.expr | ast.stmt) -> str:
        """``node``'s source as written."""
        start = self.index.start(node)
        end = self.index.end(node)
        return self.source[start:end] or ast.unparse(node)

    # ------------------------------------------------------------ MemberUseFinder's callback
    def add_member_use(self, node: ast.expr, name: str, category: str, call: ast.Call | None = None) -> None:
        self.uses += 1
        if name in self.old_functions or name in self.new_functions:
            self.function_use(node, name, call)
        elif name in self.old_globals or name in self.new_globals:
            self.global_use(node, name, category)
        else:
            self.uncovered[name] += 1

    def imported_name(self, node: ast.ImportFrom, name: str) -> None:
        """``from megatron.core.parallel_state import name``: fails at import if ``TO`` lacks it."""
        self.uses += 1
        use = f"from {node.module or '.'} import {name}"
        if name in self.old_functions and name not in self.new_functions:
            self.removed(node, "removed function", use, name, " (ImportError)")
        elif name in self.old_globals and name not in self.new_globals:
            self.removed(node, "removed global", use, name, " (ImportError)")
        elif (
            name not in self.old_functions
            and name not in self.old_globals
            and name not in self.new_functions
            and name not in self.new_globals
        ):
            self.uncovered[name] += 1

    # ------------------------------------------------------------ functions
    def function_use(self, node: ast.expr, name: str, call: ast.Call | None) -> None:
        before, after = self.old_functions.get(name), self.new_functions.get(name)
        use = self.text(call if call is not None else node)
        if before is None:
            return  # FROM lacks it: nothing of FROM's to preserve
        if after is None:
            self.removed(node, "removed function", use, name)
            return
        if call is not None:
            self.call(name, call, before, after)

    def call(self, name: str, call: ast.Call, before: tuple, after: tuple) -> None:
        old_names, new_names = _names(before), _names(after)
        use = self.text(call)
        starred = next((i for i, a in enumerate(call.args) if isinstance(a, ast.Starred)), None)
        positional = call.args if starred is None else call.args[:starred]
        kind_removed = "removed init argument" if name == INIT else "removed keyword"
        passed: dict[str, ast.expr] = {}  # FROM's parameter -> argument
        shifted: list[str] = []
        removed: list[tuple[str, str]] = []  # (what, FROM's parameter)
        for i, arg in enumerate(positional):
            if i >= len(old_names):
                return  # too many arguments for FROM: not FROM's code
            was = old_names[i]
            passed[was] = arg
            now = new_names[i] if i < len(new_names) else None
            if was not in new_names:
                removed.append((f"argument {i + 1} ({was}) has no parameter in {self.new}", was))
            elif now != was:
                shifted.append(f"argument {i + 1} ({was}) lands on {now or 'no parameter'} in {self.new}")
        for kw in call.keywords:
            if kw.arg is None:
                continue
            if kw.arg not in old_names:
                return  # not a keyword of FROM: not FROM's code
            passed[kw.arg] = kw.value
            if kw.arg not in new_names:
                removed.append((f"keyword {kw.arg} does not exist in {self.new}", kw.arg))
        fix = self.keyword_form(call, positional, old_names, new_names)
        if starred is not None:
            hidden = facts.positional_changes(name, self.old, self.new) if name != "RankGenerator" else []
            if any(i >= len(positional) for i, _, _ in hidden):
                shifted.append(
                    f"*-arguments may land on other parameters in {self.new} (positions "
                    f"{', '.join(str(i + 1) for i, _, _ in hidden if i >= len(positional))})"
                )
        if shifted:
            self.add(call, "positional shift", use, "; ".join(shifted), fix, fix)
        for text, param in removed:
            key = f"{name}.{param}"
            replacement = facts.replacement(key, self.new)
            self.add(
                call,
                kind_removed,
                use,
                text,
                f"use {replacement} instead of {param}= ({fix})"
                if replacement
                else f"{_no_equivalent(self.old, self.new)}: drop it ({fix})",
                fix,
            )
        has_double_star = any(kw.arg is None for kw in call.keywords)
        if starred is None and not has_double_star:
            self.defaults(name, call, use, passed, before, after)
            missing = [n for n, d in after if d is facts.REQUIRED and n not in passed]
            if missing:
                self.add(
                    call,
                    "new required parameter",
                    use,
                    f"{self.new} requires {', '.join(missing)}",
                    f"pass {', '.join(m + '=...' for m in missing)}",
                )

    def keyword_form(self, call: ast.Call, positional: list, old_names: list, new_names: list) -> str:
        """The call with every positional argument from the first moved one on passed by FROM's
        parameter name, and the arguments whose parameter TO lacks dropped.
        """
        moved = [i for i in range(len(positional)) if (new_names[i] if i < len(new_names) else None) != old_names[i]]
        first = moved[0] if moved else len(positional)
        parts = [self.text(a) for a in positional[:first]]
        parts += [
            f"{old_names[i]}={self.text(a)}"
            for i, a in enumerate(positional)
            if i >= first and old_names[i] in new_names
        ]
        parts += [self.text(a) for a in call.args[len(positional) :]]
        parts += [
            f"{kw.arg}={self.text(kw.value)}" if kw.arg else f"**{self.text(kw.value)}"
            for kw in call.keywords
            if kw.arg is None or kw.arg in new_names
        ]
        return f"{self.text(call.func)}({', '.join(parts)})"

    def defaults(self, name: str, call: ast.Call, use: str, passed: dict, before: tuple, after: tuple) -> None:
        new_defaults = dict(after)
        for param, default in before:
            if param in passed or param not in new_defaults or default is facts.REQUIRED:
                continue
            if new_defaults[param] is not facts.REQUIRED and new_defaults[param] != default:
                self.add(
                    call,
                    "changed default",
                    use,
                    f"{param} defaults to {_value(new_defaults[param])} in {self.new} (was {_value(default)})",
                    f"pass {param}={default!r} to keep {self.old}'s meaning",
                )

    # ------------------------------------------------------------ globals
    def global_use(self, node: ast.expr, name: str, category: str) -> None:
        if name not in self.old_globals:
            return
        use = f"{category} {self.text(node)}"
        if name not in self.new_globals:
            self.removed(node, "removed global", use, name)
        elif self.old_globals[name] is not self.new_globals[name] and category == "read":

            def show(v: Any) -> str:
                return "None" if v is None else repr(v())

            self.add(
                node,
                "changed default",
                use,
                f"{name} is {show(self.new_globals[name])} before initialization in {self.new} "
                f"(was {show(self.old_globals[name])})",
                "do not rely on its value before initialize_model_parallel",
            )


# --------------------------------------------------------------------------- HyperCommGrid
def _grid_checks(checker: _Checker) -> None:
    """Imports of ``megatron.core.hyper_comm_grid`` and method calls on grids the file builds."""
    old, new, tree = checker.old, checker.new, checker.tree
    grid_names: set[str] = set()
    for alias, target in checker.bindings.items():
        if target in (HYPER_COMM_GRID, f"{HYPER_COMM_GRID}.HyperCommGrid") or target.startswith(HYPER_COMM_GRID + "."):
            grid_names.add(alias)
    imports = [n for n in checker.imports if _imports_grid(n, checker)]
    if not imports:
        return
    if not grid_facts.has_class(new) and grid_facts.has_class(old):
        for statement in imports:
            checker.grid_uses += 1
            checker.add(
                statement,
                "HyperCommGrid",
                ast.unparse(statement),
                f"{HYPER_COMM_GRID} does not exist in {new}",
                _no_equivalent(old, new),
            )
        return
    if not grid_facts.has_class(old):
        return
    changed = grid_facts.differences(old, new)
    if not changed:
        return

    def is_class(expr: ast.expr) -> bool:
        qualified = _qualify(expr, checker.bindings)
        return qualified == f"{HYPER_COMM_GRID}.HyperCommGrid"

    instances: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and is_class(node.value.func):
            instances.update(ast.unparse(t) for t in node.targets)
        elif isinstance(node, ast.AnnAssign) and node.annotation is not None and is_class(node.annotation):
            instances.add(ast.unparse(node.target))
        elif isinstance(node, ast.arg) and node.annotation is not None and is_class(node.annotation):
            instances.add(node.arg)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if ast.unparse(node.func.value) not in instances or node.func.attr not in changed:
            continue
        method = node.func.attr
        before, after = changed[method]
        use = checker.text(node)
        if before is None:
            continue  # FROM lacks the method: not FROM's code
        checker.grid_uses += 1
        if after is None:
            checker.add(
                node, "HyperCommGrid", use, f"HyperCommGrid.{method} does not exist in {new}", _no_equivalent(old, new)
            )
            continue

        def positional(sig: inspect.Signature) -> list[str]:
            return [p.name for p in list(sig.parameters.values())[1:] if p.kind is p.POSITIONAL_OR_KEYWORD]

        a, b = positional(before), positional(after)
        problems = [
            f"argument {i + 1} ({a[i]}) lands on {b[i] if i < len(b) else 'no parameter'} in {new}"
            for i in range(min(len(node.args), len(a)))
            if (b[i] if i < len(b) else None) != a[i]
        ]
        swallowed = any(p.kind is p.VAR_KEYWORD for p in after.parameters.values())
        dropped = [
            kw.arg for kw in node.keywords if kw.arg and kw.arg not in after.parameters and kw.arg in before.parameters
        ]
        problems += [
            f"keyword {k} does not exist in {new}" + (" (it would go to **kwargs)" if swallowed else "")
            for k in dropped
        ]
        if problems:
            fixes = (["pass the arguments by keyword"] if len(problems) > len(dropped) else []) + [
                f"drop {k}= ({_no_equivalent(old, new)})" for k in dropped
            ]
            checker.add(node, "HyperCommGrid", use, "; ".join(problems), "; ".join(fixes))


def _imports_grid(node: ast.Import | ast.ImportFrom, file: FileImports) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name == HYPER_COMM_GRID for a in node.names)
    module = file.module_of(node)
    return module == HYPER_COMM_GRID or (
        module == "megatron.core" and any(a.name == "hyper_comm_grid" for a in node.names)
    )


def _qualify(expr: ast.expr, bindings: dict[str, str]) -> str | None:
    if isinstance(expr, ast.Name):
        return bindings.get(expr.id)
    if isinstance(expr, ast.Attribute):
        base = _qualify(expr.value, bindings)
        return None if base is None else f"{base}.{expr.attr}"
    return None


# --------------------------------------------------------------------------- files
def check_source(
    source: str, old: Release, new: Release, path: str = "<string>", package: str | None = None
) -> FileCheck:
    """The findings for Python ``source`` moving from release ``old`` to ``new``."""
    result = FileCheck(path=path, findings=[], uncovered=Counter())
    tree, result.error = parse_source(source, path)
    if tree is None:
        return result
    checker = _Checker(path, source, tree, package, old, new)
    checker.find_uses()
    for node in checker.imports:
        if isinstance(node, ast.ImportFrom) and checker.module_of(node) == PARALLEL_STATE:
            for alias in node.names:
                if alias.name != "*":
                    checker.imported_name(node, alias.name)
    _grid_checks(checker)
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
