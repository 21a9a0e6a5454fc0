"""Finding uses of ``megatron.core.parallel_state`` in Python source: what ``port`` and ``port --upgrade`` share.

Files (:func:`python_files`, :func:`load_file`, :func:`parse_source`, :func:`package_of`),
imports (:class:`FileImports`: the names a file binds to ``megatron`` modules and members, any
import style, relative imports inside Megatron; :func:`canonical_module`), uses
(:class:`MemberUseFinder` reports every call, reference, read, write or deletion of a member to a
:class:`MemberUseSink`: :mod:`.port`'s scanner or :mod:`.upgrade`'s checker) and positions
(:class:`LineIndex`, :func:`shorten`). The tool: docs/tools.md#port-tool.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from collections.abc import Iterator
from typing import Protocol, cast

from parallel_state_ng.tools.common import UsageError
from parallel_state_ng.tools.port.table import _MODULE_ALIASES, PARALLEL_STATE

__all__ = [
    "FileImports",
    "LineIndex",
    "MemberUseFinder",
    "MemberUseSink",
    "Unreadable",
    "canonical_module",
    "from_import_module",
    "iter_python_files",
    "load_file",
    "package_of",
    "parse_source",
    "python_files",
    "read_source",
    "shorten",
]


# --------------------------------------------------------------------------- files
def read_source(path: str) -> tuple[str, str]:
    """``(text, encoding)`` of the Python file ``path`` (encoding from its coding cookie / BOM)."""
    with open(path, "rb") as fh:
        data = fh.read()
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding), encoding


class Unreadable(Exception):
    """A Python file that cannot be read or decoded; ``str()`` is its line in a report."""


def load_file(path: str) -> tuple[str, str, str | None]:
    """``(text, encoding, package)`` of the Python file ``path`` (:func:`read_source`, :func:`package_of`).

    Raises:
        Unreadable: the file cannot be read or decoded (``path:0: cannot read (...); skipped``).
    """
    try:
        source, encoding = read_source(path)
    except (OSError, UnicodeDecodeError, SyntaxError) as err:
        raise Unreadable(f"{path}:0: cannot read ({err}); skipped") from None
    return source, encoding, package_of(path)


def parse_source(source: str, path: str) -> tuple[ast.Module | None, str | None]:
    """``(tree, None)`` for Python ``source``, or ``(None, message)`` when it does not parse."""
    try:
        return ast.parse(source, filename=path), None
    except SyntaxError as err:
        return None, f"{path}:{err.lineno or 0}: cannot parse ({err.msg}); skipped"


def package_of(path: str) -> str | None:
    """Dotted package of a file, from the ``__init__.py`` files above it (None: not in a package)."""
    parts: list[str] = []
    directory = os.path.dirname(os.path.abspath(path))
    while os.path.isfile(os.path.join(directory, "__init__.py")):
        parts.append(os.path.basename(directory))
        parent = os.path.dirname(directory)
        if parent == directory:
            break
        directory = parent
    if parts and os.path.basename(directory) == "megatron":
        parts.append("megatron")  # Megatron's wheels ship ``megatron`` as a namespace package (no __init__.py)
    return ".".join(reversed(parts)) or None


def iter_python_files(path: str) -> Iterator[str]:
    """``path`` itself if it is a file, else the ``*.py`` files below it (sorted; hidden dirs,
    ``__pycache__`` and virtual environments skipped).
    """
    if os.path.isfile(path):
        yield path
        return
    for directory, dirs, files in os.walk(path):
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".")
            and d != "__pycache__"
            and not os.path.isfile(os.path.join(directory, d, "pyvenv.cfg"))
        )
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(directory, name)


def python_files(path: str) -> list[str]:
    """:func:`iter_python_files` of the command's ``PATH``.

    Raises:
        UsageError: ``path`` does not exist (names ``PATH``).
    """
    if not os.path.exists(path):
        raise UsageError(f"no such file or directory: {path!r}", "PATH")
    return list(iter_python_files(path))


# --------------------------------------------------------------------------- positions
class LineIndex:
    """Converts ast (line, UTF-8 byte column) positions to character offsets."""

    def __init__(self, source: str) -> None:
        self.lines = re.split(r"(?<=\r\n)|(?<=\n)|(?<=\r)(?!\n)", source)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        """Character offset in the source of ast position (``lineno``, byte column ``col``)."""
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8", errors="replace"))

    def start(self, node: ast.expr | ast.stmt) -> int:
        """Character offset where ``node`` starts."""
        return self.offset(node.lineno, node.col_offset)

    def end(self, node: ast.expr | ast.stmt) -> int:
        """Character offset where ``node`` ends."""
        # typeshed allows None for the end position; ast.parse always sets it
        return self.offset(cast(int, node.end_lineno), cast(int, node.end_col_offset))

    def line_prefix(self, lineno: int, col: int) -> str:
        """The text of line ``lineno`` before byte column ``col``."""
        line = self.lines[lineno - 1]
        return line.encode("utf-8")[:col].decode("utf-8", errors="replace")


def shorten(text: str, limit: int = 90) -> str:
    """``text`` on one line (whitespace runs collapsed), cut to ``limit`` characters with ``...``."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- imports
def canonical_module(qualified: str | None) -> str | None:
    """``qualified`` with a module alias of parallel_state (``megatron.core.mpu``) replaced by
    the module's own name; other names unchanged.
    """
    if qualified is None:
        return None
    for alias, target in _MODULE_ALIASES.items():
        if qualified == alias or qualified.startswith(alias + "."):
            return target + qualified[len(alias) :]
    return qualified


def from_import_module(node: ast.ImportFrom, package: str | None) -> str | None:
    """Absolute module of a ``from X import ...`` (relative ones resolved against ``package``;
    None when that is not possible).
    """
    if not node.level:
        return node.module
    if package is None:
        return None
    parts = package.split(".")
    if node.level - 1 >= len(parts):
        return None
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class FileImports:
    """The import statements of one parsed file and the ``megatron`` names they bind.

    Attributes:
        path, source, tree: the file, its text and its parse tree.
        package: the file's dotted package (for relative imports), or None.
        index: a :class:`LineIndex` over ``source``.
        imports: every ``import`` / ``from ... import`` statement, in source order.
        bindings: local name -> the qualified ``megatron`` module or member it stands for
            (filled by :meth:`collect_bindings`).
    """

    def __init__(self, path: str, source: str, tree: ast.Module, package: str | None) -> None:
        self.path = path
        self.source = source
        self.tree = tree
        self.package = package
        self.index = LineIndex(source)
        self.bindings: dict[str, str] = {}
        self.imports: list[ast.Import | ast.ImportFrom] = [
            n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
        ]
        self.imports.sort(key=lambda n: (n.lineno, n.col_offset))

    def module_of(self, node: ast.ImportFrom) -> str | None:
        """The module of a ``from X import ...`` in this file, absolute and canonical (or None)."""
        return canonical_module(from_import_module(node, self.package))

    def collect_bindings(self) -> None:
        """Fill :attr:`bindings` from the imports of ``megatron`` modules and their members."""
        for node in self.imports:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != "megatron":
                        continue
                    if alias.asname:
                        self.bindings[alias.asname] = alias.name
                    else:
                        self.bindings[alias.name.split(".")[0]] = alias.name.split(".")[0]
            else:
                module = from_import_module(node, self.package)
                if module is None or module.split(".")[0] != "megatron":
                    continue
                for alias in node.names:
                    if alias.name != "*":
                        self.bindings[alias.asname or alias.name] = f"{module}.{alias.name}"

    def find_uses(self) -> None:
        """Fill :attr:`bindings`, then pass every use of a parallel_state member in the file to
        :meth:`add_member_use`.
        """
        self.collect_bindings()
        MemberUseFinder(self).visit(self.tree)

    def add_member_use(self, node: ast.expr, name: str, category: str, call: ast.Call | None = None) -> None:
        """Record one use (:meth:`MemberUseSink.add_member_use`): the port scanner's and the upgrade
        checker's own.
        """
        raise NotImplementedError


# --------------------------------------------------------------------------- uses
class MemberUseSink(Protocol):
    """What :class:`MemberUseFinder` reports to: the file's bindings, and a callback per use."""

    bindings: dict[str, str]

    def add_member_use(self, node: ast.expr, name: str, category: str, call: ast.Call | None = None) -> None:
        """Record a use of member ``name`` at ``node``: ``category`` is ``call`` (``call``
        the call node), ``read``, ``write`` or ``delete``.
        """


class MemberUseFinder(ast.NodeVisitor):
    """Finds uses of parallel_state's members (attribute chains and imported names) in a tree
    and reports each to ``sink``.
    """

    def __init__(self, sink: MemberUseSink) -> None:
        self.sink = sink

    def qualify(self, node: ast.AST) -> str | None:
        """The qualified ``megatron`` name ``node`` (a name or attribute chain) stands for, or None."""
        if isinstance(node, ast.Name):
            return self.sink.bindings.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualify(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def member(self, node: ast.AST) -> str | None:
        """The member name when ``node`` denotes ``parallel_state.<member>``."""
        if not isinstance(node, (ast.Name, ast.Attribute)):
            return None
        qualified = canonical_module(self.qualify(node))
        if qualified and qualified.startswith(PARALLEL_STATE + "."):
            rest = qualified[len(PARALLEL_STATE) + 1 :]
            if "." not in rest:
                return rest
        return None

    def visit_Import(self, node: ast.Import) -> None:
        """Skip: the names an import binds are not uses (:class:`FileImports` reads them)."""
        return

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        """Skip: the names an import binds are not uses (:class:`FileImports` reads them)."""
        return

    def visit_Call(self, node: ast.Call) -> None:
        """Report a call of a member (then visit its arguments), else visit the call's parts."""
        name = self.member(node.func)
        if name is None:
            self.generic_visit(node)
            return
        self.sink.add_member_use(node.func, name, "call", call=node)
        for child in [*node.args, *node.keywords]:
            self.visit(child)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        """Report a member reached through a module (read, write or delete), else visit inside."""
        name = self.member(node)
        if name is None:
            self.generic_visit(node)
            return
        category = {ast.Store: "write", ast.Del: "delete"}.get(type(node.ctx), "read")
        self.sink.add_member_use(node, name, category)

    def visit_Name(self, node: ast.Name) -> None:
        """Report a read of a name bound to a member (``from ... import name``)."""
        if isinstance(node.ctx, ast.Load):
            name = self.member(node)
            if name is not None:
                self.sink.add_member_use(node, name, "read")
