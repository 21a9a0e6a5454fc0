"""The scripts' entry points: ``python -m scripts.<folder> NAME``, its listing and errors, and the
old per-module commands that name the new ones (scripts/harness/registry.py).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from scripts.harness import registry
from scripts.harness.header import platform_facts, platform_header
from scripts.harness.output import json_text, markdown_table
from tests.support.paths import ROOT


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


@pytest.mark.parametrize("folder", sorted(registry.FOLDERS))
def test_help_lists_every_command_with_its_claim(folder, capsys):
    assert registry.main(folder, ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m scripts.{folder} NAME")
    for name, command in registry.FOLDERS[folder].items():
        assert f"  {name} " in out
        assert command.claim.replace("`", "")[:40] in out


def test_no_name_lists_the_commands_on_stderr_with_status_2(capsys):
    assert registry.main("bench", []) == 2
    captured = capsys.readouterr()
    assert "commands:" in captured.err and "  init " in captured.err
    assert captured.out == ""


def test_an_unknown_name_is_named_with_the_valid_ones(capsys):
    assert registry.main("examples", ["dmeo"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'dmeo'" in err
    assert "valid commands: demo, " in err and all(name in err for name in registry.FOLDERS["examples"])


def test_a_command_gets_its_arguments_and_its_name_as_the_program(capsys):
    with pytest.raises(SystemExit) as exc:
        registry.main("bench", ["layout", "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m scripts.bench layout ")
    assert sys.argv[0] != "python -m scripts.bench layout"  # restored


def _source(module: str) -> str:
    """A command module's source, read (not imported: no torch or Megatron in this process)."""
    with open(os.path.join(ROOT, *module.split(".")) + ".py", encoding="utf-8") as fh:
        return fh.read()


def test_every_command_module_has_a_main_taking_argv():
    for commands in registry.FOLDERS.values():
        for command in commands.values():
            tree = ast.parse(_source(command.module))
            mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
            assert len(mains) == 1, command.module
            assert [a.arg for a in mains[0].args.args] == ["argv"], command.module
            assert mains[0].args.defaults, f"{command.module}: main's argv needs a default (None)"


def test_moved_names_the_new_command_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        registry.moved("gpu", "check")
    assert exc.value.code == 2
    assert "run: python -m scripts.gpu check" in capsys.readouterr().err
    with pytest.raises(KeyError):
        registry.moved("gpu", "nope")


@pytest.mark.multiprocess
def test_the_folder_entry_point_and_an_old_one_as_a_user_runs_them():
    listing = _python("-m", "scripts.matrix", "--help")
    assert listing.returncode == 0 and "torch_matrix" in listing.stdout and "megatron_unit_tests" in listing.stdout
    old = _python("-m", "scripts.bench.init")
    assert old.returncode == 2 and "run: python -m scripts.bench init" in old.stderr
    old = _python("-m", "scripts.examples.demo", "--tp", "2")
    assert old.returncode == 2 and "run: python -m scripts.examples demo" in old.stderr
    unknown = _python("-m", "scripts.gpu", "nope")
    assert unknown.returncode == 2 and "'nope'" in unknown.stderr and "check, split_share, world" in unknown.stderr


def test_every_old_entry_point_ends_in_moved():
    for folder, commands in registry.FOLDERS.items():
        for name, command in commands.items():
            assert f'moved("{folder}", "{name}")' in _source(command.module), command.module


def test_the_output_helpers():
    assert markdown_table(("a", "b"), [(1, "x"), ("y", 2)]) == "| a | b |\n|---|---|\n| 1 | x |\n| y | 2 |\n"
    with pytest.raises(ValueError, match="row 0 has 1 cells"):
        markdown_table(("a", "b"), [(1,)])
    assert json_text({"b": 1, "a": [1]}, indent=None) == '{"b": 1, "a": [1]}\n'


def test_the_platform_header_names_torch_python_and_cpus(monkeypatch):
    import torch

    from scripts.harness import header

    monkeypatch.setattr(header, "megatron_core_version", lambda: "9.9.9")  # no megatron import in this process
    facts = platform_facts()
    assert facts["megatron_core"] == "9.9.9"
    assert facts["torch"] == torch.__version__
    line = platform_header(facts)
    assert line.startswith(f"torch {torch.__version__}, megatron-core ")
    assert f"{facts['cpus']} CPUs" in line
    assert "not importable" in platform_header({**facts, "megatron_core": None})
