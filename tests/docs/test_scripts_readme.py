"""scripts/README.md's command tables are the registry's, and every runnable script is in one.

Regenerate the tables after changing a command: ``python -m scripts.harness.readme --write``.
"""

from __future__ import annotations

import os

from scripts.harness import readme
from scripts.harness.registry import FOLDERS
from tests.support.paths import ROOT

#: Modules with a ``__main__`` block that are no command of the registry, and why.
NOT_COMMANDS = {
    # run by path under a launcher: torchrun -m compat.run scripts/examples/gpt/pretrain_gpt.py
    "scripts/examples/gpt/pretrain_gpt.py",
    # the README generator itself: python -m scripts.harness.readme --write
    "scripts/harness/readme.py",
}


def _main_blocks() -> set[str]:
    """Every module under scripts/ with a ``if __name__ == "__main__":`` block (folder entry points aside)."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, "scripts")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for filename in filenames:
            path = os.path.relpath(os.path.join(dirpath, filename), ROOT).replace(os.sep, "/")
            if filename.endswith(".py") and filename != "__main__.py":
                with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
                    if 'if __name__ == "__main__":' in fh.read():
                        found.add(path)
    return found


def test_the_committed_readme_holds_the_generated_tables():
    with open(readme.README, encoding="utf-8") as fh:
        text = fh.read()
    assert readme.stale_folders(text) == [], (
        "stale tables in scripts/README.md; run: python -m scripts.harness.readme --write"
    )
    assert readme.render(text) == text


def test_every_module_with_a_main_block_is_a_command():
    commands = {c.module.replace(".", "/") + ".py" for cmds in FOLDERS.values() for c in cmds.values()}
    assert _main_blocks() - NOT_COMMANDS == commands


def test_every_command_module_exists_and_every_folder_has_an_entry_point():
    for folder, cmds in FOLDERS.items():
        assert os.path.isfile(os.path.join(ROOT, "scripts", folder, "__main__.py")), folder
        for command in cmds.values():
            assert os.path.isfile(os.path.join(ROOT, *command.module.split(".")) + ".py"), command
            assert command.claim and "\n" not in command.claim, command.name
