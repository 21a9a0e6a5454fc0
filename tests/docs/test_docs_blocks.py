"""Every code block of README.md and docs/**/*.md is run, or marked as not run (tests/support/docs.py).

Python blocks run in one runner process that forks a child per block; shell and console blocks
run as written in bash from the repository root; a console block's shown output must appear in
the real output. Blocks too expensive for CI carry ``<!-- docs-test: skip (reason) -->``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import docs
from tests.support.paths import ROOT

BLOCKS = docs.all_blocks()
COMMANDS = [b for b in BLOCKS if b.runs and b.kind in ("shell", "console")]
#: Pages that no longer exist, named only by CHANGELOG.md's history (renamed, merged or moved).
FORMER_PAGES: frozenset[str] = frozenset(
    {
        "docs/compatibility.md",
        "docs/failure-recovery.md",
        "docs/performance.md",
        "docs/gpus.md",
        "docs/gpu-runs",
        "docs/training.md",
        "docs/torch.md",
        "docs/regression-testing.md",
    }
)
#: Folders never scanned for cited docs paths (environments, caches, build output).
_NOT_SCANNED = frozenset({".git", "site", ".ci-site", "build", "dist", "__pycache__", ".pytest_cache", ".megatron"})


def test_every_block_is_run_or_marked():
    kinds = {b.kind for b in BLOCKS}
    assert kinds <= {"python", "shell", "console", "output"}
    assert sum(b.runs for b in BLOCKS) >= 20, docs.summary(BLOCKS)
    for block in BLOCKS:
        assert block.runs or block.kind == "output" or block.skip, block.where
        assert block.skip is None or len(block.skip) >= 10, f"{block.where}: say why it is not run"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_python_blocks():
    expected = [b.where for b in BLOCKS if b.kind == "python" and b.runs]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.docs", "run-python"],
        cwd=ROOT,
        env=docs.shell_env(),
        capture_output=True,
        text=True,
        timeout=docs.BLOCK_TIMEOUT * 3,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["where"] for r in results] == expected
    failed = [f"{r['where']}:\n{r['error']}" for r in results if not r["ok"]]
    assert not failed, "\n\n".join(failed)
    assert sum(r["checked"] for r in results) > 0  # the literal comments are asserted


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("block", COMMANDS, ids=[b.where for b in COMMANDS])
def test_command_block(block):
    run = docs.run_console_block if block.kind == "console" else docs.run_shell_block
    problems = run(block)
    assert not problems, "\n".join(problems)


def test_output_blocks():
    problems = [f"{b.where}: {p}" for b in BLOCKS if b.kind == "output" for p in docs.check_output_block(b)]
    assert not problems, "\n".join(problems)


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page`` (lower case, punctuation dropped, spaces to -)."""
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # headings only outside code blocks
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_resolve():
    broken = []
    root = Path(ROOT).resolve()
    for page in docs.doc_pages():
        source = root / page
        text = re.sub(r"^```.*?^```", "", source.read_text(encoding="utf-8"), flags=re.S | re.M)
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path = (source.parent / target).resolve() if target else source
            if not path.exists():
                broken.append(f"{page}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page}: {target}#{anchor}")
    assert not broken, broken


def _cited_docs_paths() -> dict[str, list[str]]:
    """Each ``docs/...`` path cited in the repository's text files -> where (``file:line``)."""
    cited: dict[str, list[str]] = {}
    root = Path(ROOT)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if d not in _NOT_SCANNED and not d.startswith(".venv") and "egg-info" not in d
        ]
        for filename in filenames:
            if not filename.endswith((".py", ".md", ".toml", ".yml", ".cfg")) and filename != "run":
                continue
            path = Path(dirpath, filename)
            for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                for found in re.findall(r"(?<![\w./*-])docs/[\w./-]*[\w/]", line):
                    cited.setdefault(found.rstrip("/"), []).append(f"{path.relative_to(root).as_posix()}:{number}")
    return cited


def test_every_cited_docs_path_exists():
    """A ``docs/...`` path named anywhere (code, comments, docstrings, pages, CHANGELOG) exists."""
    cited = _cited_docs_paths()
    assert len(cited) > 20, sorted(cited)  # the scan finds the citations
    missing = {
        path: where[:3]
        for path, where in cited.items()
        if not Path(ROOT, path).exists()
        and not (
            path in FORMER_PAGES
            and all(w.startswith(("CHANGELOG.md:", "tests/docs/test_docs_blocks.py:")) for w in where)
        )
    }
    assert not missing, missing


def test_rules_are_enforced(tmp_path):
    (tmp_path / "docs").mkdir()
    cases = {
        "```\nx = 1\n```\n": "needs an info string",
        "```rust\nfn main() {}\n```\n": "unknown info string",
        "<!-- docs-test: skip (because) -->\n\ntext\n": "right above a code block",
        "<!-- docs-test: frobnicate -->\n```python\n1\n```\n": "unknown docs-test directive",
        "<!-- docs-test: fake-world rank=1 size=4 -->\n```bash\ntrue\n```\n": "fake-world is for python",
        "Text.\n\n    indented code\n": "indented code block",
        "```python\nx = 1\n": "never closed",
    }
    for text, message in cases.items():
        (tmp_path / "README.md").write_text(text)
        with pytest.raises(docs.DocBlockError, match=message):
            docs.parse("README.md", str(tmp_path))
    (tmp_path / "README.md").write_text(
        "* item\n\n    continued item text\n\n<!-- docs-test: skip (costly) -->\n```bash\nx\n```\n"
    )
    [block] = docs.parse("README.md", str(tmp_path))
    assert block.skip == "costly" and not block.runs


def test_literal_comments_are_assertions():
    assert docs.literal_prefix(" [1, 5]: first and last stage") == (True, [1, 5])
    assert docs.literal_prefix(" [[0, 2], [1, 3]] == RankGenerator.get_ranks('dp')") == (True, [[0, 2], [1, 3]])
    assert docs.literal_prefix(" {'tp': 1, 'dp': 0}") == (True, {"tp": 1, "dp": 0})
    assert docs.literal_prefix(" GroupHandle: ranks, first/last") == (False, None)
    assert docs.exec_block("x = [1, 2]\nlen(x)  # 2\nx  # [1, 2] as built\n", "t") == 2
    with pytest.raises(AssertionError, match="gave 3, the comment says 2"):
        docs.exec_block("1 + 2  # 2\n", "t")


def test_console_output_matching():
    [cmd] = docs.console_commands("$ echo a \\\n  b\na b\n")
    assert cmd.text == "echo a \\\n  b" and cmd.shown == ["a b"]
    assert docs.missing_output(["a", "...", "c", "d"], "a\nb\nc\nd\n") is None
    assert docs.missing_output(["a", "c"], "a\nb\nc\n") == "a\nc"  # a stretch must be contiguous
    assert docs.missing_output(["c", "...", "a"], "a\nb\nc\n") == "a"  # and in order
