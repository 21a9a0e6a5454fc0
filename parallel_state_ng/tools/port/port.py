"""``python -m parallel_state_ng port PATH``: move a codebase from Megatron's parallel_state to compat.

Finds every use of ``megatron.core.parallel_state`` (:mod:`.source_scan`: imports in any style,
calls and references through any alias, reads, writes and deletions of module globals) and
prints ``file:line: <what> -> <equivalent>``: the ``compat.parallel_state`` spelling and the
named-grid one (:mod:`.named_grid_hints`); names compat lacks are flagged ``UNKNOWN``.
``--rewrite`` prints the diff switching the imports to compat, ``--apply`` writes it;
``--upgrade FROM:TO`` is :mod:`.upgrade`. The tool: docs/tools.md#port-tool.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, cast

from parallel_state_ng.tools.common import plural
from parallel_state_ng.tools.port.named_grid_hints import getter_hint, global_hint
from parallel_state_ng.tools.port.source_scan import (
    FileImports,
    Unreadable,
    canonical_module,
    load_file,
    parse_source,
    python_files,
    shorten,
)
from parallel_state_ng.tools.port.table import (
    _PS_NAMES_IN_CORE,
    COMPAT_PARALLEL_STATE,
    GETTER_VARIANTS,
    MEGATRON_CORE,
    NAMED_GRID_GETTERS,
    PARALLEL_STATE,
    compat_api,
    named_grid_equivalent,
)
from parallel_state_ng.tools.port.upgrade import run as run_upgrade

__all__ = [
    "add_arguments",
    "run",
    "scan_file",
    "scan_source",
    "rewrite_source",
    "unified_diff",
    "compat_api",
    "named_grid_equivalent",
    "NAMED_GRID_GETTERS",
    "GETTER_VARIANTS",
    "Use",
    "FileScan",
    "PARALLEL_STATE",
    "COMPAT_PARALLEL_STATE",
]

# The tables (getter -> group kind, compat's names) live in table, the machinery that finds
# the uses (shared with upgrade) in source_scan, the named-grid hints in named_grid_hints.


# --------------------------------------------------------------------------- scanning
@dataclass(frozen=True)
class Use:
    """One use of ``megatron.core.parallel_state`` in a file."""

    path: str
    line: int
    col: int
    category: str  # import, call, reference, read, write, delete
    what: str
    equivalent: str
    name: str | None = None  # the module member used (None for an import statement)
    known: bool = True

    def format(self) -> str:
        """``path:line: <what> -> <equivalent>``."""
        return f"{self.path}:{self.line}: {self.what} -> {self.equivalent}"


@dataclass
class _Edit:
    start: int  # character offsets in the source
    end: int
    text: str


@dataclass
class FileScan:
    """The uses found in one file, and the edits switching its imports to compat."""

    path: str
    source: str = ""
    encoding: str = "utf-8"
    uses: list[Use] = field(default_factory=list)
    edits: list[_Edit] = field(default_factory=list)
    error: str | None = None

    @property
    def imports_to_switch(self) -> int:
        """Number of import statements the rewrite changes."""
        return sum(1 for u in self.uses if u.category == "import")


class _FileScanner(FileImports):
    """Scan of one parsed file: bindings, uses and import edits."""

    def __init__(self, path: str, source: str, tree: ast.Module, package: str | None) -> None:
        super().__init__(path, source, tree, package)
        self.uses: list[Use] = []
        self.edits: list[_Edit] = []
        self.chain_spans: list[tuple[ast.expr, str]] = []  # (module expression, its root name)

    # ---------------------------------------------------------------- uses
    def add_member_use(self, node: ast.expr, name: str, category: str, call: ast.Call | None = None) -> None:
        expr = self._segment(node)[2] or name
        api = compat_api()
        known = name in api
        if isinstance(node, ast.Attribute) and not isinstance(node.value, ast.Name):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name):
                self.chain_spans.append((node.value, root.id))
        if category == "call":
            what = f"call {shorten(self._segment(cast(ast.Call, call))[2])}"  # a call use comes with its call
        elif category == "read" and known and self._is_function(name):
            category, what = "reference", f"reference {expr}"
        else:
            what = f"{category} {expr}"
        if not known:
            equivalent = f"UNKNOWN: {COMPAT_PARALLEL_STATE} has no {name!r}"
        else:
            target = f"{COMPAT_PARALLEL_STATE}.{name}"
            if category == "call":
                target += shorten(self._call_arguments(node, call), 70)
            hint = getter_hint(name, call) if category in ("call", "reference") else global_hint(name)
            note = ""
            if category in ("write", "delete"):
                note = " (compat's getters read the module globals, so this still takes effect)"
            elif category == "read" and isinstance(node, ast.Name) and name.startswith("_"):
                note = " (imported by name: a copy taken at import time)"
            equivalent = target + note + (f" | {hint}" if hint else "")
        self.add_use(node, category, what, equivalent, name, known)

    def add_use(
        self,
        node: ast.expr | ast.stmt,
        category: str,
        what: str,
        equivalent: str,
        name: str | None = None,
        known: bool = True,
    ) -> None:
        """Record a :class:`Use` at ``node``."""
        self.uses.append(Use(self.path, node.lineno, node.col_offset, category, what, equivalent, name, known))

    def _call_arguments(self, func: ast.expr, call: ast.Call | None) -> str:
        """The ``(...)`` part of ``call`` as written."""
        if call is None:
            return "()"
        start = self.index.end(func)
        end = self.index.end(call)
        return self.source[start:end].strip() or "()"

    @staticmethod
    def _is_function(name: str) -> bool:
        import compat.parallel_state as ps

        return callable(getattr(ps, name, None))

    # ---------------------------------------------------------------- imports
    def _segment(self, node: ast.expr | ast.stmt) -> tuple[int, int, str]:
        """(start offset, end offset, source text) of a node."""
        start = self.index.start(node)
        end = self.index.end(node)
        return start, end, self.source[start:end]

    def _joiner(self, node: ast.stmt) -> str:
        prefix = self.index.line_prefix(node.lineno, node.col_offset)
        return "\n" + prefix if prefix.strip() == "" else "; "

    @staticmethod
    def _alias_text(name: str, asname: str | None) -> str:
        return f"{name} as {asname}" if asname else name

    def _from_text(self, node: ast.ImportFrom, names: list[str]) -> str:
        module = "." * node.level + (node.module or "")
        text = f"from {module} import {', '.join(names)}"
        if len(text) > 99:
            indent = self.index.line_prefix(node.lineno, node.col_offset)
            body = "".join(f"{indent}    {n},\n" for n in names)
            text = f"from {module} import (\n{body}{indent})"
        return text

    def rewrite_imports(self) -> None:
        """Record the import uses and the edits switching them to compat."""
        plain_ps_import = any(
            isinstance(n, ast.Import)
            and any(canonical_module(a.name) == PARALLEL_STATE and not a.asname for a in n.names)
            for n in self.imports
        )
        chain_roots = [root for _, root in self.chain_spans]
        add_compat_to: ast.Import | ast.ImportFrom | None = None
        if chain_roots and not plain_ps_import:
            add_compat_to = self._statement_binding(chain_roots[0])
        root_uses = self._root_name_uses()
        for node in self.imports:
            self._flag_unknown_imported_names(node)
            new = self._rewrite_statement(node, root_uses, add_compat=node is add_compat_to)
            if new is None:
                continue
            start, end, _old = self._segment(node)
            self.edits.append(_Edit(start, end, new))
            prefix = self.index.line_prefix(node.lineno, node.col_offset)
            self.add_use(node, "import", shorten(ast.unparse(node), 120), shorten(_one_line(new, prefix), 160))
        for expr, _ in self.chain_spans:
            start, end, _old = self._segment(expr)
            self.edits.append(_Edit(start, end, COMPAT_PARALLEL_STATE))

    def _flag_unknown_imported_names(self, node: ast.stmt) -> None:
        if not isinstance(node, ast.ImportFrom) or self.module_of(node) != PARALLEL_STATE:
            return
        api = compat_api()
        for alias in node.names:
            if alias.name != "*" and alias.name not in api:
                unknown = f"UNKNOWN: {COMPAT_PARALLEL_STATE} has no {alias.name!r}"
                self.add_use(node, "name", f"import of {alias.name}", unknown, alias.name, known=False)

    def _statement_binding(self, name: str) -> ast.Import | ast.ImportFrom | None:
        for node in self.imports:
            for alias in node.names:
                bound = alias.asname or (alias.name.split(".")[0] if isinstance(node, ast.Import) else alias.name)
                if bound == name:
                    return node
        return None

    def _root_name_uses(self) -> dict[str, int]:
        """Loads of each bound name that are not the root of a parallel_state chain."""
        chain_roots = {id(_root(expr)) for expr, _ in self.chain_spans}
        counts: dict[str, int] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and id(node) not in chain_roots:
                counts[node.id] = counts.get(node.id, 0) + 1
        return counts

    def _rewrite_statement(
        self, node: ast.Import | ast.ImportFrom, root_uses: dict[str, int], add_compat: bool
    ) -> str | None:
        joiner = self._joiner(node)
        if isinstance(node, ast.Import):
            kept: list[str] = []
            compat: list[str] = []
            for alias in node.names:
                if canonical_module(alias.name) == PARALLEL_STATE:
                    compat.append(self._alias_text(COMPAT_PARALLEL_STATE, alias.asname))
                    root = alias.name.split(".")[0]
                    if not alias.asname and root_uses.get(root, 0) and not self._other_binding(node, root):
                        kept.append(self._alias_text(alias.name, None))
                else:
                    kept.append(self._alias_text(alias.name, alias.asname))
            if add_compat and not any(c == COMPAT_PARALLEL_STATE for c in compat):
                compat.append(COMPAT_PARALLEL_STATE)
            if not compat:
                return None
            parts = ([f"import {', '.join(kept)}"] if kept else []) + [f"import {c}" for c in compat]
            return joiner.join(parts)

        module = self.module_of(node)
        tail = [f"import {COMPAT_PARALLEL_STATE}"] if add_compat else []
        if module == PARALLEL_STATE:
            _, _, old = self._segment(node)
            new = re.sub(r"^from\s+[.\w]+", f"from {COMPAT_PARALLEL_STATE}", old, count=1)
            return joiner.join([new, *tail])
        if module == MEGATRON_CORE:
            ps_aliases = [a for a in node.names if a.name in _PS_NAMES_IN_CORE]
            if not ps_aliases:
                return joiner.join([self._segment(node)[2], *tail]) if tail else None
            others = [self._alias_text(a.name, a.asname) for a in node.names if a.name not in _PS_NAMES_IN_CORE]
            compat_names = [
                self._alias_text("parallel_state", a.asname or (None if a.name == "parallel_state" else a.name))
                for a in ps_aliases
            ]
            if not others and all(a.name == "parallel_state" for a in ps_aliases):
                _, _, old = self._segment(node)
                first = re.sub(r"^from\s+[.\w]+", "from compat", old, count=1)
            else:
                first = f"from compat import {', '.join(compat_names)}"
            parts = [first] + ([self._from_text(node, others)] if others else [])
            return joiner.join(parts + tail)
        if tail:
            return joiner.join([self._segment(node)[2], *tail])
        return None

    def _other_binding(self, node: ast.stmt, root: str) -> bool:
        """Whether another import statement (not switched) binds ``root`` too."""
        for other in self.imports:
            if other is node or not isinstance(other, ast.Import):
                continue
            for alias in other.names:
                if (
                    not alias.asname
                    and alias.name.split(".")[0] == root
                    and canonical_module(alias.name) != PARALLEL_STATE
                ):
                    return True
        return False


def _one_line(text: str, indent: str) -> str:
    """Statements (as they will be written at ``indent``) on one line, comments dropped."""
    if indent.strip() == "" and indent:
        text = text.replace("\n" + indent, "\n")
    try:
        return "; ".join(ast.unparse(stmt) for stmt in ast.parse(text).body)
    except SyntaxError:
        return " ".join(text.split())


def _root(expr: ast.AST) -> ast.AST:
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return expr


def scan_source(source: str, path: str = "<string>", package: str | None = None) -> FileScan:
    """Scan Python ``source`` (``package``: its dotted package, for relative imports)."""
    result = FileScan(path=path, source=source)
    tree, result.error = parse_source(source, path)
    if tree is None:
        return result
    scanner = _FileScanner(path, source, tree, package)
    scanner.find_uses()
    scanner.rewrite_imports()
    result.uses = sorted(scanner.uses, key=lambda u: (u.line, u.col, u.category != "import"))
    result.edits = sorted(scanner.edits, key=lambda e: e.start)
    return result


def scan_file(path: str) -> FileScan:
    """Scan one file on disk (relative imports resolved from its ``__init__.py`` parents)."""
    try:
        source, encoding, package = load_file(path)
    except Unreadable as err:
        return FileScan(path=path, error=str(err))
    result = scan_source(source, path, package)
    result.encoding = encoding
    return result


def rewrite_source(scan: FileScan) -> str:
    """The file's source with its imports switched to compat (unchanged when there is nothing to do)."""
    out, pos = [], 0
    for edit in scan.edits:
        out.append(scan.source[pos : edit.start])
        out.append(edit.text)
        pos = edit.end
    out.append(scan.source[pos:])
    return "".join(out)


# --------------------------------------------------------------------------- command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``port`` command's options to ``parser``."""
    parser.add_argument("path", metavar="PATH", help="a Python file or a directory tree to scan")
    parser.add_argument(
        "--rewrite",
        action="store_true",
        help="print a unified diff switching the imports to compat (dry run; summary goes to stderr)",
    )
    parser.add_argument("--apply", action="store_true", help="write the rewritten files")
    parser.add_argument(
        "--upgrade",
        metavar="FROM:TO",
        help="instead: report every use whose meaning changes from megatron-core FROM to TO (e.g. 0.14:0.19; "
        "downgrades too), with the fix; exit status 1 when something breaks",
    )


def _diff_name(prefix: str, path: str) -> str:
    return f"{prefix}/{path}" if not os.path.isabs(path) else path


def unified_diff(path: str, old: str, new: str) -> str:
    """A unified diff of one file (``a/PATH`` -> ``b/PATH`` for relative paths, as git writes)."""
    out = []
    for line in difflib.unified_diff(
        _diff_lines(old), _diff_lines(new), fromfile=_diff_name("a", path), tofile=_diff_name("b", path)
    ):
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


def _diff_lines(text: str) -> list[str]:
    r"""Lines with their ``\n`` (the last one may lack it); only ``\n`` ends a line here."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


def run(args: argparse.Namespace, stdout: Any) -> int:
    """Run the ``port`` command for parsed ``args``; returns the exit code."""
    if getattr(args, "upgrade", None):
        return run_upgrade(args, stdout)
    scans = [scan_file(p) for p in python_files(args.path)]
    status = 0
    rewritten: list[str] = []
    for scan in scans:
        if scan.error:
            print(scan.error, file=sys.stderr)
            continue
        if not args.rewrite:
            for use in scan.uses:
                print(use.format(), file=stdout)
        if not scan.edits:
            continue
        new = rewrite_source(scan)
        if args.rewrite:
            stdout.write(unified_diff(scan.path, scan.source, new))
        if args.apply:
            try:
                ast.parse(new, filename=scan.path)
            except SyntaxError as err:
                print(f"{scan.path}: not rewritten, the result would not parse ({err.msg})", file=sys.stderr)
                status = 1
                continue
            with open(scan.path, "wb") as fh:
                fh.write(new.encode(scan.encoding))
            rewritten.append(scan.path)

    uses = [u for s in scans for u in s.uses]
    imports = sum(s.imports_to_switch for s in scans)
    unknown = sorted({u.name for u in uses if not u.known and u.name})
    files_with_uses = sum(1 for s in scans if s.uses)
    summary = (
        f"scanned {plural(len(scans), 'file')}: {plural(len(uses), 'use')} of {PARALLEL_STATE} in "
        f"{plural(files_with_uses, 'file')}, {plural(imports, 'import')} to switch, "
        + (f"{plural(len(unknown), 'unknown name')} ({', '.join(unknown)})" if unknown else "no unknown names")
    )
    errors = sum(1 for s in scans if s.error)
    if errors:
        summary += f"; {plural(errors, 'file')} could not be read or parsed"
    if args.apply:
        for path in rewritten:
            print(f"rewrote {path}", file=stdout)
        summary += f"; rewrote {plural(len(rewritten), 'file')}"
    elif not args.rewrite and imports:
        summary += " (--rewrite shows the diff, --apply writes it)"
    print(summary, file=sys.stderr if args.rewrite and not args.apply else stdout)
    return status
