"""The upgrade check of one file's ``megatron.core.parallel_state`` uses: :class:`UseChecker`.

Each use found by :mod:`~parallel_state_ng.tools.port.source_scan` (calls, keywords, positional
arguments, globals, imported names) is compared between the two releases' facts
(:mod:`parallel_state_ng.releases.parallel_state`) and becomes a
:class:`~.report.Finding` when its meaning changes.
"""

from __future__ import annotations

import ast
from collections import Counter
from typing import Any

from parallel_state_ng.releases import Release
from parallel_state_ng.releases import parallel_state as facts
from parallel_state_ng.tools.port.source_scan import FileImports, shorten
from parallel_state_ng.tools.port.upgrade.report import Finding, no_equivalent

__all__ = ["INIT", "UseChecker"]

INIT = "initialize_model_parallel"


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
    return f"use {replacement}" if replacement else no_equivalent(old, new)


class UseChecker(FileImports):
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
        """Record one finding at ``node``."""
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
        """One use of a module member: a function (called or not) or a global."""
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
        """A function used: removed in the new release, or its call checked."""
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
        """A call of a function both releases have: moved positions, removed keywords, new required ones."""
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
                else f"{no_equivalent(self.old, self.new)}: drop it ({fix})",
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
        """Defaults the call relies on that changed value between the releases."""
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
        """A module global used: removed in the new release, or its import-time value changed."""
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
