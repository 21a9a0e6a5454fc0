"""scripts/README.md's command tables, generated from the registry (:mod:`scripts.harness.registry`).

Each folder's table sits between two markers in the README::

    <!-- commands: bench (generated: python -m scripts.harness.readme --write) -->
    ...
    <!-- end of commands: bench -->

``python -m scripts.harness.readme`` checks that the README holds the generated tables (exit 1
and the folders that differ when it does not); ``--write`` rewrites them in place. The rest of
the README is written by hand.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from scripts.harness.output import markdown_table
from scripts.harness.registry import FOLDERS, command_line

#: scripts/README.md, the file the tables live in.
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
_BLOCK = re.compile(
    r"(<!-- commands: (?P<folder>\w+) \(generated: python -m scripts\.harness\.readme --write\) -->\n)"
    r"(?P<body>.*?)"
    r"(<!-- end of commands: (?P=folder) -->)",
    flags=re.S,
)


def command_table(folder: str) -> str:
    """The markdown table of ``folder``'s subcommands: name, claim, module, example commands."""
    rows = []
    for command in FOLDERS[folder].values():
        examples = [" ".join(filter(None, (command_line(folder, command.name), command.example))), *command.also]
        module = command.module.replace(".", "/") + ".py"
        rows.append((f"`{command.name}`", command.claim, f"`{module}`", ", ".join(f"`{e}`" for e in examples)))
    return markdown_table(("command", "what it shows", "module", "example"), rows)


def render(text: str) -> str:
    """``text`` (the README) with every marked table replaced by the generated one.

    Raises:
        ValueError: a folder of the registry has no marked table in ``text``, or a marker names
            no folder of the registry.
    """
    found = [m.group("folder") for m in _BLOCK.finditer(text)]
    unknown = sorted(set(found) - set(FOLDERS))
    missing = sorted(set(FOLDERS) - set(found))
    if unknown or missing:
        raise ValueError(f"scripts/README.md's command tables: missing for {missing}, unknown folders {unknown}")
    return _BLOCK.sub(lambda m: m.group(1) + command_table(m.group("folder")) + m.group(4), text)


def stale_folders(text: str) -> list[str]:
    """The folders whose table in ``text`` differs from the generated one."""
    current = {m.group("folder"): m.group("body") for m in _BLOCK.finditer(text)}
    return [folder for folder in FOLDERS if current.get(folder) != command_table(folder)]


def main(argv: Sequence[str] | None = None) -> int:
    """Check scripts/README.md's tables (exit 1 when stale), or rewrite them with ``--write``."""
    parser = argparse.ArgumentParser(prog="python -m scripts.harness.readme", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the tables in scripts/README.md")
    args = parser.parse_args(argv)
    with open(README, encoding="utf-8") as fh:
        text = fh.read()
    try:
        new = render(text)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.write:
        if new != text:
            with open(README, "w", encoding="utf-8") as fh:
                fh.write(new)
        print(f"{README}: tables of {', '.join(FOLDERS)} written")
        return 0
    stale = stale_folders(text)
    if stale:
        print(f"{README}: stale tables: {', '.join(stale)}; run: python -m scripts.harness.readme --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
