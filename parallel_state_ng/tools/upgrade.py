"""``python -m parallel_state_ng port PATH --upgrade FROM:TO``: what breaks moving between releases.

For every use of ``megatron.core.parallel_state`` in PATH (found by :mod:`.source_scan`, the
scanner ``port`` uses too: any import style, aliases, names imported from the module,
Megatron's relative imports) whose meaning changes between megatron-core release ``FROM`` and
release ``TO``, report ``file:line: <use>: <what changes> -> <fix>``:

* ``positional shift`` — a positional argument lands on another parameter in ``TO`` (0.15 put
  ``check_initialized`` before ``with_context_parallel`` in
  ``get_tensor_and_data_parallel_group``; 0.19 put ``with_gtp_remat`` second in the
  data-parallel getters); fix: the keyword form, with ``FROM``'s parameter names;
* ``removed keyword`` — an argument (by keyword or position) whose parameter ``TO`` lacks;
* ``removed init argument`` — the same for ``initialize_model_parallel``;
* ``removed function`` — a call, reference or import of a function ``TO`` lacks, with its
  replacement or "removed, no equivalent";
* ``removed global`` — a read, write or import of a module global ``TO`` lacks;
* ``changed default`` — a parameter left to its default whose default differs in ``TO``
  (fix: pass ``FROM``'s value); also a global whose import-time value differs;
* ``new required parameter`` — ``TO`` requires a parameter the call does not pass;
* ``HyperCommGrid`` — ``megatron.core.hyper_comm_grid``: the module missing in ``TO``, and
  removed methods / keywords / shifted positions of methods called on objects the file builds
  with ``HyperCommGrid(...)`` (or annotates as ``HyperCommGrid``).

Every fact comes from :mod:`parallel_state_ng.releases.parallel_state` and
:func:`parallel_state_ng.releases.hyper_comm_grid.differences` — the data compat serves each
release from — so the check and compat cannot disagree. Any two releases the data knows
(``KNOWN_SERIES``, 0.12 … 0.19) work, in either direction (a downgrade reports what the older
release lacks). The summary line counts uses, breaking changes per kind and uses of names the
data does not cover (private helpers); the exit status is 1 when something breaks, else 0.

The findings, per-file results and summary line are in :mod:`.upgrade_report` (re-exported here).

Not followed: a function passed around by reference whose parameters moved (only its removal
is reported), calls through ``*args`` (reported when a moved position may be among them).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import sys
from collections import Counter
from typing import Any

from parallel_state_ng.releases import KNOWN_SERIES, Release, parse_release
from parallel_state_ng.releases import hyper_comm_grid as grid_facts
from parallel_state_ng.releases import parallel_state as facts
from parallel_state_ng.tools import UsageError
from parallel_state_ng.tools.port_table import PARALLEL_STATE
from parallel_state_ng.tools.source_scan import (
    FileImports,
    LineIndex,
    MemberUseFinder,
    canonical_module,
    from_import_module,
    iter_python_files,
    package_of,
    parse_source,
    read_source,
    shorten,
)
from parallel_state_ng.tools.upgrade_report import KINDS, NO_EQUIVALENT, FileCheck, Finding, summary  # noqa: F401 (re-exported)
from parallel_state_ng.tools.upgrade_report import no_equivalent as _no_equivalent

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


class _Checker:
    """Checks one file's uses against the two releases' facts."""

    def __init__(self, path: str, source: str, old: Release, new: Release) -> None:
        self.path, self.source, self.old, self.new = path, source, old, new
        self.index = LineIndex(source)
        self.old_functions, self.old_globals = _api(old)
        self.new_functions, self.new_globals = _api(new)
        self.findings: list[Finding] = []
        self.uncovered: Counter = Counter()
        self.uses = 0
        self.grid_uses = 0
        self.bindings: dict[str, str] = {}  # the file's bindings (FileImports.collect_bindings)

    def add(
        self, node: ast.expr | ast.stmt, kind: str, use: str, change: str, fix: str, fixed_call: str | None = None
    ) -> None:
        self.findings.append(
            Finding(self.path, node.lineno, node.col_offset, kind, shorten(use), change, fix, fixed_call)
        )

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
            self.add(
                node,
                "removed function",
                use,
                f"{name} does not exist in {self.new} (ImportError)",
                _fix_removed(name, self.old, self.new),
            )
        elif name in self.old_globals and name not in self.new_globals:
            self.add(
                node,
                "removed global",
                use,
                f"{name} does not exist in {self.new} (ImportError)",
                _fix_removed(name, self.old, self.new),
            )
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
            self.add(
                node,
                "removed function",
                use,
                f"{name} does not exist in {self.new}",
                _fix_removed(name, self.old, self.new),
            )
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
            self.add(
                node,
                "removed global",
                use,
                f"{name} does not exist in {self.new}",
                _fix_removed(name, self.old, self.new),
            )
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
def _grid_checks(checker: _Checker, tree: ast.Module, scanner: FileImports) -> None:
    """Imports of ``megatron.core.hyper_comm_grid`` and method calls on grids the file builds."""
    old, new = checker.old, checker.new
    grid_names: set[str] = set()
    for alias, target in scanner.bindings.items():
        if target in (HYPER_COMM_GRID, f"{HYPER_COMM_GRID}.HyperCommGrid") or target.startswith(HYPER_COMM_GRID + "."):
            grid_names.add(alias)
    imports = [n for n in scanner.imports if _imports_grid(n, scanner.package)]
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
        qualified = _qualify(expr, scanner.bindings)
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


def _imports_grid(node: ast.Import | ast.ImportFrom, package: str | None) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name == HYPER_COMM_GRID for a in node.names)
    module = from_import_module(node, package)
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
    scanner = FileImports(path, source, tree, package)
    scanner.collect_bindings()
    checker = _Checker(path, source, old, new)
    checker.bindings = scanner.bindings
    MemberUseFinder(checker).visit(tree)
    for node in scanner.imports:
        if isinstance(node, ast.ImportFrom) and canonical_module(from_import_module(node, package)) == PARALLEL_STATE:
            for alias in node.names:
                if alias.name != "*":
                    checker.imported_name(node, alias.name)
    _grid_checks(checker, tree, scanner)
    result.uses = checker.uses
    result.grid_uses = checker.grid_uses
    result.findings = sorted(checker.findings, key=lambda f: (f.line, f.col, KINDS.index(f.kind)))
    result.uncovered = checker.uncovered
    return result


def check_file(path: str, old: Release, new: Release) -> FileCheck:
    """:func:`check_source` on a file (relative imports resolved from its ``__init__.py`` parents)."""
    try:
        source, _ = read_source(path)
    except (OSError, UnicodeDecodeError, SyntaxError) as err:
        return FileCheck(path=path, findings=[], uncovered=Counter(), error=f"{path}:0: cannot read ({err}); skipped")
    return check_source(source, old, new, path, package_of(path))


def run(args: argparse.Namespace, stdout: Any) -> int:
    """``port PATH --upgrade FROM:TO``: print the findings and the summary; 1 if something breaks."""
    if args.rewrite or args.apply:
        raise UsageError("--upgrade reports only; it cannot be combined with --rewrite or --apply", "--upgrade")
    old, new = parse_upgrade(args.upgrade)
    if not os.path.exists(args.path):
        raise UsageError(f"no such file or directory: {args.path!r}", "PATH")
    checks = [check_file(p, old, new) for p in iter_python_files(args.path)]
    for check in checks:
        if check.error:
            print(check.error, file=sys.stderr)
        for finding in check.findings or []:
            print(finding.format(), file=stdout)
    print(summary(checks, old, new), file=stdout)
    return 1 if any(c.findings for c in checks) else 0
