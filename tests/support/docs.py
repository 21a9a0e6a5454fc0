"""The code blocks of README.md and docs/**/*.md: found, classified and run (tests/docs).

The rules (docs/testing.md states them for writers) are in the comment below the imports.
``python -m tests.support.docs`` prints the blocks per page and the totals;
``python -m tests.support.docs run-python`` runs every python block and prints one JSON
result per block (what tests/docs/test_docs_blocks.py does).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.paths import ROOT

# Rules:
# * Every fenced block has an info string. ``python`` blocks run; ``bash`` / ``sh`` / ``shell``
#   blocks run in bash (they must exit 0); ``console`` blocks are shell sessions: each ``$ command``
#   (a trailing backslash continues it) runs, and the output shown under it must appear in the real output, each
#   stretch between ``...`` lines contiguous and in order. ``text`` and ``json`` blocks are output or
#   data and are not run (``json`` must parse).
# * HTML comments on the lines right above a block steer it:
#   ``<!-- docs-test: skip (REASON) -->`` (not run: too expensive for CI, or illustrative; counted
#   and reported with its reason), ``<!-- docs-test: fake-world rank=R size=W -->`` (a python block
#   runs on simulated rank R of a W-rank world, torch's fake backend), ``<!-- docs-test: exit=N -->``
#   (a console command is expected to exit with N) and ``<!-- docs-test: same-as PATH -->`` (a
#   ``json`` / ``text`` block shows that file, which must be equal).
# * In a python block, an expression statement whose trailing comment starts with a Python literal
#   is an assertion: ``lay.coord(5)  # {'tp': 1, 'dp': 0, 'pp': 1}`` must evaluate to that literal.
#   The literal is the longest prefix of the comment that parses as one, cut before a space, ``:``,
#   ``;``, ``=`` or ``(`` (and not ending in a comma: ``# [1, 3], computed ...`` is the list).
# * Each python block is independent: it runs in its own process (forked from one runner that has
#   imported torch, the packages and megatron-core once), from the repository root.

PYTHON = frozenset({"python", "py"})
SHELL = frozenset({"bash", "sh", "shell"})
CONSOLE = frozenset({"console"})
OUTPUT = frozenset({"text", "json"})
#: Seconds one block may take before it counts as failed.
BLOCK_TIMEOUT = 120

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
_DIRECTIVE = re.compile(r"^<!--\s*docs-test:\s*(?P<body>.*?)\s*-->$")
_SKIP = re.compile(r"^skip\s*\((?P<reason>[^)].*)\)$")
_WORLD = re.compile(r"^fake-world\s+rank=(?P<rank>\d+)\s+size=(?P<size>\d+)$")
_EXIT = re.compile(r"^exit=(?P<code>\d+)$")
_SAME_AS = re.compile(r"^same-as\s+(?P<path>\S+)$")


class DocBlockError(ValueError):
    """A markdown page breaks the rules above (named by page and line)."""


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page.

    Attributes:
        page: path relative to the repository root (``docs/engine.md``).
        line: 1-based line of the opening fence.
        lang: the info string's first word.
        code: the block's text (ends with a newline).
        skip: the reason given by a ``skip`` directive, or None.
        world: ``(rank, size)`` of a ``fake-world`` directive, or None.
        exit_code: the exit code a console command must end with (default 0).
        same_as: the file a data block must equal, or None.
    """

    page: str
    line: int
    lang: str
    code: str
    skip: str | None = None
    world: tuple[int, int] | None = None
    exit_code: int = 0
    same_as: str | None = None

    @property
    def kind(self) -> str:
        """``python``, ``shell``, ``console`` or ``output``."""
        for kind, langs in (("python", PYTHON), ("shell", SHELL), ("console", CONSOLE), ("output", OUTPUT)):
            if self.lang in langs:
                return kind
        raise AssertionError(self.lang)  # parse() admits no other info string

    @property
    def where(self) -> str:
        """``page:line``, for messages and test ids."""
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        """Whether the docs test executes this block."""
        return self.kind != "output" and self.skip is None


def doc_pages(root: str = ROOT) -> list[str]:
    """README.md and every ``docs/**/*.md`` (guides, reference, results), relative to ``root``."""
    docs = sorted(p.relative_to(root).as_posix() for p in Path(root, "docs").rglob("*.md"))
    return ["README.md"] + docs


def _directives(lines: list[str], fence_index: int, where: str) -> dict:
    """The ``docs-test`` comments on the lines right above the fence at ``fence_index``."""
    found: dict = {}
    i = fence_index - 1
    while i >= 0 and lines[i].strip() and (m := _DIRECTIVE.match(lines[i].strip())):
        body = m.group("body")
        if s := _SKIP.match(body):
            found["skip"] = s.group("reason").strip()
        elif w := _WORLD.match(body):
            found["world"] = (int(w.group("rank")), int(w.group("size")))
        elif e := _EXIT.match(body):
            found["exit_code"] = int(e.group("code"))
        elif a := _SAME_AS.match(body):
            found["same_as"] = a.group("path")
        else:
            raise DocBlockError(f"{where}: unknown docs-test directive {body!r}")
        i -= 1
    return found


def parse(page: str, root: str = ROOT) -> list[Block]:
    """Every fenced block of ``page`` (relative to ``root``), with its directives.

    Raises:
        DocBlockError: a fence without an info string or with an unknown one, an indented fence,
            an unclosed block, a directive that is not right above a block or that does not fit
            the block, or an indented (unfenced) code block.
    """
    lines = Path(root, page).read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    used_directives: set[int] = set()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            _check_not_indented_code(lines, i, f"{page}:{i + 1}")
            i += 1
            continue
        where = f"{page}:{i + 1}"
        if m.group("indent"):
            raise DocBlockError(f"{where}: a code fence must start at column 0")
        fence, info = m.group("fence"), m.group("info").strip()
        lang = info.split()[0] if info else ""
        if not lang:
            raise DocBlockError(f"{where}: a code block needs an info string (python, bash, console, text, json)")
        if lang not in PYTHON | SHELL | CONSOLE | OUTPUT:
            raise DocBlockError(f"{where}: unknown info string {lang!r}")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), None)
        if end is None:
            raise DocBlockError(f"{where}: the block is never closed")
        found = _directives(lines, i, where)
        used_directives.update(range(i - len(found), i))
        block = Block(page, i + 1, lang, "".join(line + "\n" for line in lines[i + 1 : end]), **found)
        _check_directives_fit(block)
        blocks.append(block)
        i = end + 1
    for j, line in enumerate(lines):
        if _DIRECTIVE.match(line.strip()) and j not in used_directives:
            raise DocBlockError(f"{page}:{j + 1}: a docs-test directive must be right above a code block")
    return blocks


def _check_not_indented_code(lines: list[str], i: int, where: str) -> None:
    """Refuse an indented code block (4 spaces after a blank line, outside a list)."""
    if not lines[i].startswith("    ") or not lines[i].strip() or i == 0 or lines[i - 1].strip():
        return
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    previous = lines[j] if j >= 0 else ""
    if previous.startswith((" ", "*", "-", "|")) or re.match(r"^\d+\. ", previous):
        return  # a list item's continuation
    raise DocBlockError(f"{where}: indented code block: use a fenced block with an info string")


def _check_directives_fit(block: Block) -> None:
    if block.world is not None and block.kind != "python":
        raise DocBlockError(f"{block.where}: fake-world is for python blocks")
    if block.world is not None and not 0 <= block.world[0] < block.world[1]:
        raise DocBlockError(f"{block.where}: fake-world rank must be in [0, size)")
    if block.exit_code and block.kind != "console":
        raise DocBlockError(f"{block.where}: exit= is for console blocks")
    if block.same_as is not None and block.kind != "output":
        raise DocBlockError(f"{block.where}: same-as is for text/json blocks")
    if block.skip is not None and block.kind == "output":
        raise DocBlockError(f"{block.where}: text/json blocks are never run; skip is for code")


def all_blocks(root: str = ROOT) -> list[Block]:
    """The blocks of every page, in page order."""
    return [b for page in doc_pages(root) for b in parse(page, root)]


# --------------------------------------------------------------------------- python blocks
def literal_prefix(comment: str) -> tuple[bool, object]:
    """``(True, value)`` when ``comment`` starts with a Python literal (the longest such prefix)."""
    text = comment.strip()
    cuts = [len(text)] + [k for k in range(len(text) - 1, 0, -1) if text[k] in " :;=("]
    for k in cuts:
        if text[:k].rstrip().endswith(","):
            continue  # "[1, 3], computed ..." is the list, not a tuple
        try:
            return True, ast.literal_eval(text[:k].strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return False, None


def _comment_of(line: str) -> str:
    """The trailing ``#`` comment of one source line ('' if none), found with the tokenizer."""
    import io
    import tokenize

    try:
        for tok in tokenize.generate_tokens(io.StringIO(line).readline):
            if tok.type == tokenize.COMMENT:
                return tok.string[1:]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return ""


def exec_block(code: str, filename: str, first_line: int = 1) -> int:
    """Run ``code`` statement by statement; return how many literal comments were asserted.

    ``first_line`` is the page line of the code's first line (tracebacks name page lines).

    Raises:
        AssertionError: an expression differs from the literal in its comment.
    """
    tree = ast.parse(code, filename)
    lines = code.splitlines()
    scope: dict = {"__name__": "__docs__"}
    checked = 0
    for node in tree.body:
        comment = _comment_of(lines[node.end_lineno - 1])  # type: ignore[operator]
        source = ast.get_source_segment(code, node)
        ast.increment_lineno(node, first_line - 1)
        if isinstance(node, ast.Expr):
            ok, expected = literal_prefix(comment)
            value = eval(compile(ast.Expression(node.value), filename, "eval"), scope)
            if ok:
                assert value == expected, f"line {node.lineno}: {source} gave {value!r}, the comment says {expected!r}"
                checked += 1
        else:
            exec(compile(ast.Module([node], []), filename, "exec"), scope)
    return checked


def _run_in_child(block: Block) -> dict:
    """Body of one forked child: the fake world if asked, then the block."""
    os.chdir(ROOT)
    if block.world is not None:
        from parallel_state_ng.testing.worlds import init_simulated_rank

        rank, size = block.world  # a simulated rank: gloo groups asked for get fake-backend stand-ins
        init_simulated_rank(rank, size)
    checked = exec_block(block.code, block.page, block.line + 1)
    return {"checked": checked}


def run_python_blocks(blocks: list[Block], timeout: float = BLOCK_TIMEOUT) -> list[dict]:
    """Run each block in a child forked from this process; one result dict per block.

    A result holds ``where``, ``ok``, ``seconds``, ``checked`` (literal comments asserted) and,
    when it failed, ``error`` (the child's traceback or the timeout).
    """
    results = []
    for block in blocks:
        start = time.perf_counter()
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            os.close(read_fd)
            os.dup2(2, 1)  # what the block prints goes to stderr: stdout carries the results
            try:
                outcome = {"ok": True, **_run_in_child(block)}
            except BaseException:  # report everything, SystemExit included
                outcome = {"ok": False, "checked": 0, "error": traceback.format_exc()}
            with os.fdopen(write_fd, "w") as out:
                json.dump(outcome, out)
            os._exit(0)
        os.close(write_fd)
        outcome = _wait_child(pid, read_fd, timeout)
        outcome.update(where=block.where, seconds=round(time.perf_counter() - start, 3))
        results.append(outcome)
    return results


def _wait_child(pid: int, read_fd: int, timeout: float) -> dict:
    import selectors

    chunks = []
    with os.fdopen(read_fd) as pipe, selectors.DefaultSelector() as sel:
        sel.register(pipe, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                return {"ok": False, "checked": 0, "error": f"timed out after {timeout} s"}
            chunk = pipe.read()
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    try:
        return json.loads("".join(chunks))
    except ValueError:
        return {"ok": False, "checked": 0, "error": f"the child died (wait status {status}) without a result"}


def _preload() -> None:
    """Import what the blocks share once, before forking (megatron-core only where installed)."""
    import torch.distributed  # noqa: F401

    import compat.parallel_state  # noqa: F401
    import parallel_state_ng  # noqa: F401

    try:
        import megatron.core.parallel_state  # noqa: F401
        import megatron.core.process_groups_config  # noqa: F401
    except ImportError:
        pass


# --------------------------------------------------------------------------- shell and console blocks
@dataclass
class Command:
    """One ``$ command`` of a console block and the output shown under it."""

    text: str
    shown: list[str] = field(default_factory=list)


def console_commands(code: str) -> list[Command]:
    """The commands of a console block, each with the output lines shown after it."""
    commands: list[Command] = []
    continued = False
    for line in code.splitlines():
        if continued:
            commands[-1].text += "\n" + line
            continued = line.endswith("\\")
        elif line.startswith("$ "):
            commands.append(Command(line[2:]))
            continued = line.endswith("\\")
        elif commands:
            commands[-1].shown.append(line.rstrip())
        elif line.strip():
            raise DocBlockError(f"output before the first '$ ' command: {line!r}")
    return commands


def shell_env() -> dict[str, str]:
    """The environment blocks run in: ``python`` is this interpreter, the repository is importable."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def missing_output(shown: list[str], actual: str) -> str | None:
    """None if every stretch of ``shown`` (split at ``...`` lines) appears in ``actual`` in order."""
    out = [line.rstrip() for line in actual.splitlines()]
    stretches: list[list[str]] = [[]]
    for line in shown:
        if line.strip() == "...":
            stretches.append([])
        else:
            stretches[-1].append(line)
    at = 0
    for stretch in (s for s in stretches if s):
        found = next((k for k in range(at, len(out) - len(stretch) + 1) if out[k : k + len(stretch)] == stretch), None)
        if found is None:
            return "\n".join(stretch)
        at = found + len(stretch)
    return None


def _bash(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``bash *args`` from the repository root with the docs' environment; stdout and stderr together."""
    return subprocess.run(
        ["bash", *args],
        cwd=ROOT,
        env=shell_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def run_console_block(block: Block, timeout: float = BLOCK_TIMEOUT) -> list[str]:
    """Run a console block's commands; the problems found (empty: the block is true)."""
    problems = []
    for command in console_commands(block.code):
        proc = _bash(["-c", command.text], timeout)
        if proc.returncode != block.exit_code:
            problems.append(f"$ {command.text}: exit {proc.returncode}, expected {block.exit_code}:\n{proc.stdout}")
        elif (stretch := missing_output(command.shown, proc.stdout)) is not None:
            problems.append(f"$ {command.text}: output lacks\n{stretch}\n--- real output:\n{proc.stdout}")
    return problems


def run_shell_block(block: Block, timeout: float = BLOCK_TIMEOUT) -> list[str]:
    """Run a bash block (``set -euo pipefail``); the problems found."""
    proc = _bash(["-euo", "pipefail", "-c", block.code], timeout)
    return [] if proc.returncode == 0 else [f"exit {proc.returncode}:\n{proc.stdout}"]


def check_output_block(block: Block) -> list[str]:
    """A json block must parse; a ``same-as`` block must equal its file."""
    problems = []
    if block.lang == "json":
        try:
            data = json.loads(block.code)
        except ValueError as e:
            return [f"not JSON: {e}"]
    if block.same_as is not None:
        path = Path(ROOT, block.same_as)
        if not path.is_file():
            return [f"same-as {block.same_as}: no such file"]
        text = path.read_text(encoding="utf-8")
        equal = json.loads(text) == data if block.lang == "json" else text.strip() == block.code.strip()
        if not equal:
            problems.append(f"differs from {block.same_as}")
    return problems


# --------------------------------------------------------------------------- command line
def summary(blocks: list[Block], executed: set[str] | None = None) -> str:
    """Counts per kind: executed, skipped (with reasons) and output blocks.

    ``executed``: the ``where`` of the blocks a test run executed with success; None: all
    runnable blocks (what the docs test executes).
    """
    runnable = [b for b in blocks if b.runs]
    ran = runnable if executed is None else [b for b in runnable if b.where in executed]
    skipped = [b for b in blocks if b.skip is not None]
    per_kind = ", ".join(f"{k} {sum(b.kind == k for b in ran)}" for k in ("python", "shell", "console"))
    text = [
        f"docs code blocks: {len(ran)} executed ({per_kind}), {len(skipped)} skipped (marked), "
        f"{sum(b.kind == 'output' for b in blocks)} output/data blocks (not executed)"
        + (f"; {len(runnable) - len(ran)} runnable ones not run or failed" if len(ran) < len(runnable) else "")
    ]
    text += [f"  skipped {b.where} ({b.lang}): {b.skip}" for b in skipped]
    return "\n".join(text)


def main(argv: list[str]) -> int:
    """``run-python [PAGE ...]``: run the python blocks (of those pages), print JSON lines; no argument:
    list and count.
    """
    if argv[:1] == ["run-python"]:
        blocks = [b for page in argv[1:] for b in parse(page)] if argv[1:] else all_blocks()
        _preload()
        for result in run_python_blocks([b for b in blocks if b.kind == "python" and b.runs]):
            print(json.dumps(result), flush=True)
        return 0
    blocks = all_blocks()
    for page in doc_pages():
        mine = [b for b in blocks if b.page == page]
        kinds = ", ".join(f"{b.line}:{b.lang}{'' if b.runs or b.kind == 'output' else ' (skip)'}" for b in mine)
        print(f"{page}: {kinds or 'no code blocks'}")
    print(summary(blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
