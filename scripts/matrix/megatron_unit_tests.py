"""Megatron's own unit tests of ``parallel_state`` on CPU gloo ranks, under each group setting.

Runs a test file of a user's Megatron-LM checkout (default ``test_parallel_state.py`` of
``--tests-dir``, e.g. ``Megatron-LM/tests/unit_tests``) with pytest inside each rank of a
world on localhost (started as torchrun starts ranks on one node, around a TCPStore on a free
port that this process hosts; a rank that fails does not stop the others), once per setting:

- ``mcore``: megatron-core's own ``parallel_state`` (no compat);
- ``compat``: ``compat.install()``, no group sharing;
- ``safe``: compat with ``PSNG_SHARE_GROUPS=safe``;
- ``1``: compat with ``PSNG_SHARE_GROUPS=1`` (for information: left out of the verdict).

Each rank loads :mod:`scripts.matrix.megatron_unit_tests_plugin` (CPU stand-ins for the tests'
NCCL and CUDA calls, compat when asked for, one outcome per test written as JSON); nothing in the
checkout is changed and no Megatron file is copied. The checkout's root (the first directory
above ``--tests-dir`` without ``__init__.py``, where pytest finds ``tests.unit_tests``) is first
on the ranks' ``sys.path`` after ``--megatron-path``: a checkout with ``megatron/`` serves its own
megatron-core, otherwise the installed one (or ``--megatron-path``'s) is used; the table names the
release each setting ran. The checkout's ``conftest.py`` is skipped unless ``--conftest``.

Between tests the plugin makes the ranks meet and destroys the process groups the test left
alive (renewing WORLD after a test that did not pass everywhere), so that one test's failure on
some ranks does not carry into the next. Prints the outcome counts per setting, with how many
groups the tests left alive ("groups left"), every test whose outcome differs between settings
(a test's outcome is the same on every rank, or it is listed per rank), and every test that failed
alike but with another message (object addresses left out; for information, not in the verdict).
Exit status: 0 when every test has one outcome under every verdict setting (all but ``1``), 1 when
some differ or a setting did not report, 2 on bad input.

    python -m scripts.matrix megatron_unit_tests --tests-dir ~/Megatron-LM/tests/unit_tests --nproc 8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "scripts.matrix.megatron_unit_tests_plugin"

#: setting -> (implementation, PSNG_SHARE_GROUPS or None for unset, counts in the verdict)
SETTINGS: dict[str, tuple[str, str | None, bool]] = {
    "mcore": ("mcore", None, True),
    "compat": ("compat", None, True),
    "safe": ("compat", "safe", True),
    "1": ("compat", "1", False),
}
OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")


class UsageError(ValueError):
    """Bad command-line input (exit status 2)."""


@dataclass
class SettingRun:
    """One setting's run: per test, the outcome of every rank that reported it."""

    setting: str
    ranks: dict[int, dict] = field(default_factory=dict)
    returncode: int | None = None
    seconds: float = 0.0
    note: str = ""

    def tests(self) -> dict[str, dict[int, str]]:
        """Per test id: rank -> outcome."""
        table: dict[str, dict[int, str]] = {}
        for rank, data in self.ranks.items():
            for test, result in data.get("results", {}).items():
                table.setdefault(test, {})[rank] = result["outcome"]
        return table

    def reasons(self) -> dict[str, str]:
        """Per test id: the first reason a rank gave for a failed, error or skipped outcome."""
        found: dict[str, str] = {}
        for _, data in sorted(self.ranks.items()):
            for test, result in data.get("results", {}).items():
                if result["outcome"] != "passed" and result.get("reason") and test not in found:
                    found[test] = result["reason"]
        return found

    def left_groups(self) -> int:
        """Process groups the tests left alive, summed over tests (the most any rank left)."""
        per_test: dict[str, int] = {}
        for data in self.ranks.values():
            for test, result in data.get("results", {}).items():
                per_test[test] = max(per_test.get(test, 0), int(result.get("left_groups", 0)))
        return sum(per_test.values())

    def unsynced(self) -> list[str]:
        """Tests after which some rank's between-tests barrier ran out."""
        return sorted({t for d in self.ranks.values() for t, r in d.get("results", {}).items() if r.get("unsynced")})

    def release(self) -> str:
        """The megatron-core release and the module that served ``parallel_state`` (rank 0's)."""
        if not self.ranks:
            return "-"
        data = self.ranks[min(self.ranks)]
        return f"{data.get('megatron_version', '?')} ({data.get('parallel_state', '?')})"


def combined(outcomes: Mapping[int, str], nproc: int) -> str:
    """One test's outcome over the ranks: the outcome when every rank agrees, else per rank.

    >>> combined({0: "passed", 1: "passed"}, 2)
    'passed'
    >>> combined({0: "passed", 1: "failed"}, 3)
    'failed[1] missing[2] passed[0]'
    """
    by_outcome: dict[str, list[int]] = {}
    for rank in range(nproc):
        by_outcome.setdefault(outcomes.get(rank, "missing"), []).append(rank)
    if len(by_outcome) == 1:
        return next(iter(by_outcome))
    return " ".join(f"{o}[{','.join(map(str, r))}]" for o, r in sorted(by_outcome.items()))


def counts(run: SettingRun, nproc: int) -> Counter[str]:
    """How many tests had each combined outcome (``mixed`` when the ranks disagree)."""
    tally: Counter[str] = Counter()
    for outcomes in run.tests().values():
        outcome = combined(outcomes, nproc)
        tally[outcome if outcome in OUTCOMES or outcome == "missing" else "mixed"] += 1
    return tally


def differences(runs: Mapping[str, SettingRun], nproc: int) -> dict[str, dict[str, str]]:
    """Tests whose combined outcome is not the same under every setting of ``runs``.

    A test one setting did not report counts as ``missing`` there.
    """
    tables = {name: run.tests() for name, run in runs.items()}
    every_test = sorted(set().union(*(set(t) for t in tables.values()))) if tables else []
    found: dict[str, dict[str, str]] = {}
    for test in every_test:
        row = {name: combined(table.get(test, {}), nproc) for name, table in tables.items()}
        if len(set(row.values())) > 1:
            found[test] = row
    return found


def _plain(reason: str) -> str:
    """A failure message without object addresses (whole, or as pytest's ``...`` cuts them)."""
    return re.sub(r"\.\.\.[0-9a-f]+>", "...>", re.sub(r"0x[0-9a-f]+", "0x", reason))


def message_differences(runs: Mapping[str, SettingRun]) -> dict[str, dict[str, str]]:
    """Tests that did not pass, with the same outcome, but whose first message differs somewhere.

    Per test, rank by rank, each setting's message (object addresses left out) against the first
    setting's; the row gives each setting's message on the first rank where they differ.
    """
    names = list(runs)
    found: dict[str, dict[str, str]] = {}
    if len(names) < 2:
        return found
    first = runs[names[0]]
    for rank, data in sorted(first.ranks.items()):
        for test, result in data.get("results", {}).items():
            if result["outcome"] == "passed" or test in found:
                continue
            row = {names[0]: _plain(result.get("reason", ""))}
            for name in names[1:]:
                other = runs[name].ranks.get(rank, {}).get("results", {}).get(test)
                if other is not None and other["outcome"] == result["outcome"]:
                    row[name] = _plain(other.get("reason", ""))
            if len(set(row.values())) > 1:
                found[test] = row
    return found


def find_root(tests_dir: Path) -> Path:
    """The directory pytest puts on ``sys.path`` for ``tests_dir``.

    That is the first directory upwards from ``tests_dir`` (itself included) without ``__init__.py``.
    """
    path = tests_dir.resolve()
    while (path / "__init__.py").exists() and path.parent != path:
        path = path.parent
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked: :class:`UsageError` names the option and the value."""
    parser = argparse.ArgumentParser(prog="python -m scripts.matrix megatron_unit_tests", description=__doc__)
    parser.add_argument("--tests-dir", required=True, help="Megatron-LM's tests/unit_tests (or any test directory)")
    parser.add_argument("--test-file", default="test_parallel_state.py", help="relative to --tests-dir")
    parser.add_argument("--nproc", type=int, default=8, help="ranks (WORLD_SIZE); Megatron's tests expect 8")
    parser.add_argument("--settings", default="mcore,compat,safe,1", help=f"comma-separated, of {list(SETTINGS)}")
    parser.add_argument("--megatron-path", default=None, help="a directory holding megatron/ (an unzipped wheel)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per setting before its ranks are killed")
    parser.add_argument("--collective-timeout", type=float, default=120.0, help="gloo timeout of the ranks' groups (s)")
    parser.add_argument("--conftest", action="store_true", help="load the checkout's conftest.py files too")
    parser.add_argument("--json", default=None, help="write every setting's per-rank outcomes here")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest's -k: only the tests it selects")
    parser.add_argument("--work-dir", default=None, help="keep each setting's rank logs and JSON here")
    args = parser.parse_args(argv)
    tests_dir = Path(args.tests_dir).expanduser()
    if not tests_dir.is_dir():
        raise UsageError(f"--tests-dir {args.tests_dir!r}: not a directory")
    test_file = tests_dir / args.test_file
    if not test_file.is_file():
        raise UsageError(f"--test-file {args.test_file!r}: no such file in --tests-dir {str(tests_dir)!r}")
    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc}: must be at least 1")
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or not settings:
        raise UsageError(f"--settings {args.settings!r}: unknown {unknown}; known: {list(SETTINGS)}")
    if args.megatron_path and not all(Path(p).is_dir() for p in args.megatron_path.split(os.pathsep) if p):
        raise UsageError(f"--megatron-path {args.megatron_path!r}: not a directory")
    if args.timeout <= 0 or args.collective_timeout <= 0:
        raise UsageError(f"--timeout {args.timeout} / --collective-timeout {args.collective_timeout}: must be > 0")
    args.tests_dir, args.test_file, args.settings = tests_dir.resolve(), test_file.resolve(), settings
    return args


def _command(args: argparse.Namespace, root: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", str(args.test_file.relative_to(root)), "-p", PLUGIN, "-q"]
    cmd += ["-p", "no:cacheprovider", "--rootdir", str(root), "-c", os.devnull]
    cmd += ["-W", "ignore::pytest.PytestUnknownMarkWarning"]
    if args.keyword:
        cmd += ["-k", args.keyword]
    return cmd if args.conftest else [*cmd, "--noconftest"]


def _rank_env(args: argparse.Namespace, setting: str, out: Path, root: Path, port: int) -> dict[str, str]:
    """What torchrun would give a rank on one node, with this setting's switches."""
    impl, share, _ = SETTINGS[setting]
    env = dict(os.environ)
    paths = [*(args.megatron_path.split(os.pathsep) if args.megatron_path else []), str(root), str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    env.update(PSNG_MUT_IMPL=impl, PSNG_MUT_OUT=str(out), PSNG_MUT_COLLECTIVE_TIMEOUT=str(args.collective_timeout))
    env.update(WORLD_SIZE=str(args.nproc), LOCAL_WORLD_SIZE=str(args.nproc), GROUP_RANK="0", OMP_NUM_THREADS="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    env.pop("PSNG_SHARE_GROUPS", None)
    if share is not None:
        env["PSNG_SHARE_GROUPS"] = share
    return env


def run_setting(args: argparse.Namespace, setting: str, out: Path) -> SettingRun:
    """Run the test file on ``args.nproc`` ranks under ``setting``; collect each rank's JSON.

    The ranks are started here as torchrun would start them on one node (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` naming a TCPStore this process
    hosts, ``TORCHELASTIC_USE_AGENT_STORE``), but a rank that exits does not stop the others, and
    each rank has its own log (``log<RANK>.txt``).
    """
    import torch.distributed as dist

    root = find_root(args.tests_dir)
    out.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, args.nproc, True, wait_for_workers=False)
    base = _rank_env(args, setting, out, root, store.port)
    run = SettingRun(setting)
    start = time.monotonic()
    procs = []
    for rank in range(args.nproc):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        with (out / f"log{rank}.txt").open("w") as sink:
            procs.append(
                subprocess.Popen(
                    _command(args, root),
                    cwd=root,
                    env=env,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    deadline = start + args.timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            run.note = f"killed after --timeout {args.timeout:g} s"
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run.returncode = max(p.returncode for p in procs)
    run.seconds = time.monotonic() - start
    del store
    for path in sorted(out.glob("rank*.json")):
        data = json.loads(path.read_text())
        run.ranks[int(data["rank"])] = data
    running = sorted({d["running"] for d in run.ranks.values() if d.get("running")})
    if running:
        run.note += f"; unfinished: {', '.join(running)}"
    if len(run.ranks) < args.nproc and not run.note:
        tail = (out / "log0.txt").read_text().strip().splitlines()[-3:]
        run.note = f"{len(run.ranks)} of {args.nproc} ranks reported; {out}/log0.txt: " + " | ".join(tail)
    return run


def report(runs: Mapping[str, SettingRun], nproc: int) -> tuple[str, bool]:
    """The outcome-count table, the differing tests, and whether the verdict settings agree."""
    head = ["setting", "release (parallel_state)", "tests", *OUTCOMES, "mixed", "groups left", "seconds"]
    lines = ["| " + " | ".join(head) + " |"]
    lines.append("|---" * (len(OUTCOMES) + 6) + "|")
    for name, run in runs.items():
        tally = counts(run, nproc)
        cells = " | ".join(str(tally[o]) for o in OUTCOMES)
        tail = f"{tally['mixed']} | {run.left_groups()} | {run.seconds:.0f}"
        lines.append(f"| {name} | {run.release()} | {sum(tally.values())} | {cells} | {tail} |")
    for name, run in runs.items():
        if run.note:
            lines.append(f"{name}: {run.note}")
        if run.unsynced():
            missed = run.unsynced()
            lines.append(f"{name}: the ranks did not meet after {len(missed)} tests: {', '.join(missed)}")
    verdict_runs = {n: r for n, r in runs.items() if SETTINGS[n][2]}
    verdict = differences(verdict_runs, nproc)
    every = differences(runs, nproc)
    agree = not verdict and all(not r.note and r.ranks for r in verdict_runs.values())
    lines.append("")
    if every:
        lines.append(f"tests whose outcome differs ({len(every)}):")
        for test, row in every.items():
            lines.append(f"- {test}: " + "; ".join(f"{n}={o}" for n, o in row.items()))
            for name, run in runs.items():
                reason = run.reasons().get(test)
                if reason and row[name] != "passed":
                    lines.append(f"    {name}: {reason}")
    messages = message_differences(runs)
    if messages:
        lines.append(f"tests with one outcome but other failure messages ({len(messages)}):")
        for test, row in messages.items():
            lines.append(f"- {test}: " + "; ".join(f"{n}: {m}" for n, m in row.items()))
    else:
        lines.append("every test that did not pass failed with the same message under every setting")
    names = ", ".join(verdict_runs)
    lines.append(
        f"verdict: every test has one outcome under {names}"
        if agree
        else f"verdict: outcomes differ (or a setting did not report) under {names}"
    )
    return "\n".join(lines), agree


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run every setting, print the report; the exit status (see the module docstring)."""
    try:
        args = parse_args(argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    runs: dict[str, SettingRun] = {}
    with tempfile.TemporaryDirectory(prefix="psng-mut-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        for setting in args.settings:
            print(f"running {args.test_file} on {args.nproc} ranks: {setting} ...", flush=True)
            runs[setting] = run_setting(args, setting, work / setting)
    text, agree = report(runs, args.nproc)
    print(text)
    if args.json:
        data = {n: {"ranks": r.ranks, "seconds": r.seconds, "note": r.note} for n, r in runs.items()}
        Path(args.json).write_text(json.dumps(data, indent=1, sort_keys=True))
    return 0 if agree else 1


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("matrix", "megatron_unit_tests")
