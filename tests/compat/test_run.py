"""compat.run: the runner's command line, its bad input (one line, exit 2), and a program run as Python runs it.

In process, compat's install is replaced by a recorder (no global state changes); two subprocess
runs check the real thing: a script that imports Megatron sees compat, and ``-m`` runs a module.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import compat.run as runner
from tests.support.paths import ROOT


@pytest.fixture
def installs(monkeypatch):
    """The runner's install replaced by a recorder; sys.argv and sys.path restored afterwards."""
    calls: list[bool] = []
    monkeypatch.setattr(runner, "_install", calls.append)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    return calls


def _script(tmp_path: Path, body: str, name: str = "prog.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_runner_options_come_before_the_program():
    assert runner.parse_args(["--hyper-comm-grid", "train.py", "-m", "x", "--help"]) == runner.Program(
        "train.py", ("-m", "x", "--help"), hyper_comm_grid=True
    )
    assert runner.parse_args(["-m", "pkg.mod", "a", "-m"]) == runner.Program("pkg.mod", ("a", "-m"), module=True)
    assert runner.parse_args(["-mpkg.mod", "a"]) == runner.Program("pkg.mod", ("a",), module=True)
    assert runner.parse_args(["--help", "x.py"]) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "no program given: name a SCRIPT or -m MODULE"),
        (["--tp", "2", "x.py"], "unknown runner option '--tp'"),
        (["-m"], "-m needs a module name"),
        (
            ["x.py", "--lr", "1", "--hyper-comm-grid"],
            "--hyper-comm-grid comes after x.py, so it belongs to the program",
        ),
        (["-m", "pkg", "--hyper-comm-grid=1"], "--hyper-comm-grid comes after -m pkg"),
        (["no_such_dir_45/train.py"], "can't open file"),
        (["-m", "no_such_module_45.sub"], "no module named 'no_such_module_45'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_install(argv, message, installs, capsys):
    assert runner.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m compat.run: error: ") and message in err, err
    assert installs == []


def test_a_missing_submodule_or_a_package_without_main_is_refused(installs, capsys, tmp_path, monkeypatch):
    package = tmp_path / "pkg45"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert runner.main(["-m", "pkg45.missing"]) == 2
    assert runner.main(["-m", "pkg45"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors == [
        "python -m compat.run: error: no module named 'pkg45.missing'",
        "python -m compat.run: error: no module named pkg45.__main__; 'pkg45' is a package and cannot be run",
    ]


def test_the_script_runs_as_main_with_its_argv_and_directory(installs, tmp_path):
    folder = tmp_path / "job"
    folder.mkdir()
    out = tmp_path / "seen.txt"
    script = _script(
        folder,
        f"""
        import sys
        open({str(out)!r}, "w").write(repr((__name__, sys.argv, sys.path[0])))
        """,
    )
    assert runner.main(["--hyper-comm-grid", str(script), "--lr", "1e-3", "-m", "x"]) == 0
    assert ast.literal_eval(out.read_text()) == ("__main__", [str(script), "--lr", "1e-3", "-m", "x"], str(folder))
    assert installs == [True]


def test_the_exit_status_and_exceptions_pass_through(installs, tmp_path):
    with pytest.raises(SystemExit) as exited:
        runner.main([str(_script(tmp_path, "raise SystemExit(7)\n"))])
    assert exited.value.code == 7
    with pytest.raises(LookupError, match="from the program"):
        runner.main([str(_script(tmp_path, "raise LookupError('from the program')\n", "fails.py"))])
    assert installs == [False, False]


def test_the_console_script_is_the_runner():
    tree = ast.parse((Path(ROOT) / "setup.py").read_text())
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert "compat-run=compat.run:main" in strings


def _python(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_unchanged_megatron_script_runs_on_compat(tmp_path):
    pytest.importorskip("megatron.core")
    script = _script(
        tmp_path,
        """
        import sys
        from megatron.core import parallel_state as mpu
        from megatron.core.hyper_comm_grid import HyperCommGrid
        print(mpu.__name__, HyperCommGrid.__module__, __name__, sys.argv[1:])
        sys.exit(int(sys.argv[1]))
        """,
    )
    done = _python("-m", "compat.run", "--hyper-comm-grid", str(script), "3", "--x", cwd=tmp_path)
    assert done.returncode == 3, done.stderr[-3000:]
    assert done.stdout.split() == [
        "compat.parallel_state",
        "parallel_state_ng.builders.grid_releases",
        "__main__",
        "['3',",
        "'--x']",
    ], done.stdout


@pytest.mark.multiprocess
def test_a_module_runs_as_python_dash_m_runs_it(tmp_path):
    package = tmp_path / "job45"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(
        "import os, sys, compat\n"
        "print(compat.is_installed(), __name__, sys.argv[0] == os.path.abspath(__file__), sys.argv[1:], "
        "sys.path[0] == os.getcwd())\n"
    )
    done = _python("-m", "compat.run", "-m", "job45.train", "a", "--b", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "True __main__ True ['a', '--b'] True"
