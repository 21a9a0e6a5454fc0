"""The torch matrix: the test suite and the demo on each torch release, one virtual environment each.

For every version asked for, a virtual environment under ``--cache`` (reused when it already holds
that torch) gets ``torch==VERSION`` first, then the project with its test extra (editable, from
this checkout, on every call: also in a reused venv), installed under a constraint that pins
torch, so pip can never swap the torch under test (checked after the install: the run stops when
``torch.__version__`` is not the one asked for, or the venv imports the package from elsewhere).
megatron-core 0.15+ and this project declare ``torch>=2.6``; on an older torch the test extra is
installed without them, then both with ``--no-deps``, which the table says.

Then, in that environment, from the repository root: the fast subset, the multiprocess subset, the
demo, and the torch internals the package reads (``parallel_state_ng.groups.torch_support``). A
table follows: version, passed/failed/skipped per subset, demo ok, seconds.

    python -m scripts.matrix torch_matrix                       # every version of VERSIONS
    python -m scripts.matrix torch_matrix 2.14.1 2.4.1 --subsets fast demo
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = Path.home() / ".cache" / "parallel_state_ng" / "torch-matrix"

#: The versions covered, and why each. Order = the order they run in.
VERSIONS: dict[str, str] = {
    "2.14.1": "the newest pip gives here (/etc/xdg/pip caps torch at 2.14.1)",
    "2.4.1": "the floor setup.py claimed before this matrix (torch>=2.4; now torch>=2.6)",
    "2.5.1": "the first release with torch.distributed.split_group (TORCH_FACTS)",
    "2.6.0": "megatron-core 0.15+ declare torch>=2.6",
    "2.11.0": "the GPU machine's torch",
    "2.13.0": "the CPU build CI installs (README)",
}

#: pytest -m expressions of the subsets (docs/testing.md).
SUBSETS: dict[str, str] = {
    "fast": "not slow and not multiprocess and not network",
    "multiprocess": "multiprocess and not slow and not network",
}
#: The megatron-core release the test extra pins (setup.py's TEST_REQUIRES).
TEST_MEGATRON = "megatron-core==0.16.1"
#: megatron-core releases from 0.15 on declare this floor.
MEGATRON_TORCH_FLOOR = (2, 6)


@dataclass
class SubsetResult:
    """One pytest run (or the demo): its counts, exit code and seconds."""

    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    returncode: int | None = None
    seconds: float = 0.0
    tail: str = ""


@dataclass
class VersionResult:
    """Everything measured for one torch version."""

    version: str
    installed: str = ""
    install_note: str = ""
    install_seconds: float = 0.0
    subsets: dict[str, SubsetResult] = field(default_factory=dict)
    torch_support: dict[str, object] = field(default_factory=dict)
    error: str = ""


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def _run(cmd: list[str], *, log: Path, timeout: float | None = None, env: dict[str, str] | None = None) -> int:
    """Run ``cmd`` from the repository root, appending its output to ``log``; its exit code."""
    with log.open("a", encoding="utf-8") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            return subprocess.run(
                cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=env, check=False
            ).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\n[torch_matrix] timed out after {timeout} s\n")
            return 124


def _clean_env() -> dict[str, str]:
    """The environment of the runs: no PYTHONPATH (the venv's own megatron-core), no virtualenv of ours."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _torch_in(python: Path) -> str:
    if not python.is_file():
        return ""
    done = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=False,
        env=_clean_env(),
    )
    return done.stdout.strip() if done.returncode == 0 else ""


def _points_here(python: Path) -> bool:
    """Whether ``python`` imports parallel_state_ng and compat from this checkout (an editable
    install made from another checkout would test that one's code in the subprocesses).
    """
    done = subprocess.run(
        [
            str(python),
            "-c",
            "import compat, parallel_state_ng; print(parallel_state_ng.__file__); print(compat.__file__)",
        ],
        cwd="/",
        capture_output=True,
        text=True,
        check=False,
        env=_clean_env(),
    )
    files = done.stdout.split()
    return done.returncode == 0 and len(files) == 2 and all(Path(f).resolve().is_relative_to(ROOT) for f in files)


def _constraint_file(venv: Path, version: str) -> Path:
    """A constraints file pinning torch, plus the machine's own constraints (pip's -c replaces them)."""
    lines = [f"torch=={version}"]
    machine = Path("/etc/xdg/pip/constraints.txt")
    if machine.is_file():
        lines += [line for line in machine.read_text().splitlines() if line and not line.startswith("torch")]
    path = venv / "torch-constraint.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def install(version: str, cache: Path, log: Path) -> VersionResult:
    """Create (or reuse) the venv of ``version`` with torch and the project's test extra.

    A venv that already holds the torch asked for is kept; the project's install (editable, from
    this checkout, with the test extra) runs every time, so that a venv made from another
    checkout or before a test requirement was added tests this checkout with all of them.
    """
    result = VersionResult(version)
    venv = cache / f"torch-{version}"
    python = venv / "bin" / "python"
    marker = venv / "matrix-installed.json"
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    env = _clean_env()
    start = time.perf_counter()
    reused = _torch_in(python).split("+")[0] == version
    if not reused:
        if venv.exists():
            shutil.rmtree(venv)
        venv.parent.mkdir(parents=True, exist_ok=True)
        if _run([sys.executable, "-m", "venv", str(venv)], log=log) != 0:
            result.error = "python -m venv failed"
            return result
    constraint = _constraint_file(venv, version)
    if not reused and _run([*pip, f"torch=={version}", "-c", str(constraint)], log=log, env=env) != 0:
        result.error = f"pip install torch=={version} failed"
        return result
    note = "test extra"
    if _version_tuple(version)[:2] >= MEGATRON_TORCH_FLOOR:
        code = _run([*pip, "-e", ".[test]", "-c", str(constraint)], log=log, env=env)
    else:
        # setup.py and megatron-core 0.15+ declare torch>=2.6: the rest of the test extra as
        # declared, then this project and megatron-core without their dependencies.
        code = _run([*pip, *_test_requires_without_megatron(), "-c", str(constraint)], log=log, env=env)
        if code == 0:
            code = _run([*pip, "--no-deps", "-e", ".", TEST_MEGATRON, "packaging"], log=log, env=env)
        note = f"test extra; this project and {TEST_MEGATRON} --no-deps (both declare torch>=2.6)"
    if code != 0:
        result.error = "pip install of the test extra failed (see the log)"
        return result
    result.installed = _torch_in(python)
    if result.installed.split("+")[0] != version:
        result.error = f"pip swapped torch: asked for {version}, the venv has {result.installed or 'none'}"
        return result
    if not _points_here(python):
        result.error = f"the venv's parallel_state_ng is not this checkout's ({ROOT})"
        return result
    result.install_note = note + (" (venv reused)" if reused else "")
    result.install_seconds = time.perf_counter() - start
    marker.write_text(json.dumps({"installed": result.installed, "note": note}), encoding="utf-8")
    return result


def _test_requires_without_megatron() -> list[str]:
    """setup.py's TEST_REQUIRES less megatron-core, read from the file (setup.py must not be imported)."""
    text = (ROOT / "setup.py").read_text(encoding="utf-8")
    block = re.search(r"TEST_REQUIRES = \[(.*?)\]", text, flags=re.S)
    if block is None:
        raise RuntimeError("setup.py has no TEST_REQUIRES list")
    names = re.findall(r'"([^"]+)"', re.sub(r"#.*", "", block.group(1)))
    return [name for name in names if not name.startswith("megatron-core")]


_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|error)")


def parse_summary(text: str) -> SubsetResult:
    """The counts of pytest's closing line (``== 3 failed, 1481 passed, 2 skipped in 9.1s ==``)."""
    result = SubsetResult()
    lines = [line for line in text.splitlines() if re.search(r"\b(passed|failed|no tests ran)\b", line)]
    if lines:
        for number, word in _COUNT.findall(lines[-1]):
            key = "errors" if word.startswith("error") else word
            setattr(result, key, int(number))
    return result


def run_pytest(python: Path, marker: str, workers: int, log: Path, timeout: float) -> SubsetResult:
    """One subset of the suite in the venv, from the repository root."""
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, "tests"]
    if workers > 0:
        cmd[4:4] = ["-n", str(workers)]
    sub_log = log.with_suffix(f".{marker.split()[0]}.log")
    sub_log.write_text("", encoding="utf-8")
    start = time.perf_counter()
    code = _run(cmd, log=sub_log, timeout=timeout, env=_clean_env())
    text = sub_log.read_text(encoding="utf-8", errors="replace")
    result = parse_summary(text)
    result.returncode, result.seconds = code, time.perf_counter() - start
    result.tail = "\n".join(line for line in text.splitlines() if re.match(r"(FAILED|ERROR)\b", line))[-4000:]
    return result


def run_demo(python: Path, log: Path, timeout: float) -> SubsetResult:
    """The demo (scripts/examples/demo.py) in the venv; ok = exit code 0."""
    start = time.perf_counter()
    code = _run([str(python), "-m", "scripts.examples", "demo"], log=log, timeout=timeout, env=_clean_env())
    return SubsetResult(returncode=code, seconds=time.perf_counter() - start)


def probe_torch_support(python: Path) -> dict[str, object]:
    """The torch internals the package reads, as ``parallel_state_ng.groups.torch_support`` finds them."""
    done = subprocess.run(
        [str(python), "-c", "import json; from parallel_state_ng.groups import torch_support as t; "
         "print(json.dumps(t.report()))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env=_clean_env(),
    )  # fmt: skip
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def format_table(results: list[VersionResult], subsets: list[str]) -> str:
    """The results as a Markdown table."""
    head = ["torch", *[f"{name} passed/failed/skipped" for name in subsets if name != "demo"]]
    head += ["demo ok"] if "demo" in subsets else []
    head += ["seconds (tests + demo)", "install"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        if res.error:
            rows.append(f"| {res.version} | " + " | ".join(["—"] * (len(head) - 2)) + f" | {res.error} |")
            continue
        cells = [res.installed]
        for name in subsets:
            sub = res.subsets.get(name)
            if name == "demo":
                continue
            if sub is None:
                cells.append("not run")
                continue
            crashed = f" (exit {sub.returncode})" if sub.returncode not in (0, 1) else ""
            errors = f", {sub.errors} errors" if sub.errors else ""
            cells.append(f"{sub.passed}/{sub.failed}/{sub.skipped}{errors}{crashed}")
        if "demo" in subsets:
            demo = res.subsets.get("demo")
            ok = demo is not None and demo.returncode == 0
            cells.append("not run" if demo is None else ("yes" if ok else f"no (exit {demo.returncode})"))
        cells.append(f"{sum(sub.seconds for sub in res.subsets.values()):.0f}")
        cells.append(res.install_note)
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Install and run each version; print the table; exit 1 when any run failed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", default=list(VERSIONS), help="torch versions (default: %(default)s)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the venvs live (default: %(default)s)")
    parser.add_argument(
        "--subsets", nargs="+", default=["fast", "multiprocess", "demo"], choices=[*SUBSETS, "demo"],
        help="what to run in each venv (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers (0: none; default 2)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per subset (default 3600)")
    parser.add_argument("--install-only", action="store_true", help="create the venvs, run nothing")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    results: list[VersionResult] = []
    for version in args.versions:
        log = args.cache / f"torch-{version}.log"
        log.write_text("", encoding="utf-8")
        print(f"[torch_matrix] torch {version}: installing (log: {log})", flush=True)
        res = install(version, args.cache, log)
        results.append(res)
        if res.error or args.install_only:
            print(f"[torch_matrix] torch {version}: {res.error or 'installed ' + res.installed}", flush=True)
            continue
        python = args.cache / f"torch-{version}" / "bin" / "python"
        res.torch_support = probe_torch_support(python)
        for name in args.subsets:
            print(f"[torch_matrix] torch {version}: {name}", flush=True)
            if name == "demo":
                res.subsets[name] = run_demo(python, log, args.timeout)
            else:
                res.subsets[name] = run_pytest(python, SUBSETS[name], args.workers, log, args.timeout)
            sub = res.subsets[name]
            print(f"[torch_matrix]   {asdict(sub) | {'tail': sub.tail[-1500:]}}", flush=True)
        if args.json:
            args.json.write_text(json.dumps([asdict(r) for r in results], indent=1), encoding="utf-8")
    print(format_table(results, args.subsets))
    for res in results:
        if res.torch_support:
            print(f"torch {res.installed or res.version}: {json.dumps(res.torch_support)}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1), encoding="utf-8")
    failed = any(res.error or any(sub.returncode not in (0, None) for sub in res.subsets.values()) for res in results)
    return 1 if failed else 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("matrix", "torch_matrix")
