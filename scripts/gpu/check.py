"""The one-GPU proof (issue 27): NCCL world size 1, lazy and device-bound, then the fast tests.

Per mode, in a fresh process: the creation path chosen, MCore's and compat's NCCL options
side by side, a few GPT steps under MCore and under compat (bit-identical), destroy leaving
no group. Then ``pytest -m "not slow and not multiprocess and not network" tests``. The report
goes to stdout and to ``--output`` (default ``$OUT/gpu_check.txt``). Exit code 0: all checks
pass; 1: a check failed; 2: no CUDA GPU (without ``--cpu-dry-run``) or bad options.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

from parallel_state_ng.testing.megatron_cpu import MEGATRON_PATH_ENV, use_megatron_path
from scripts.examples.gpt.processes import run_ranks
from scripts.gpu.world_report import DEFAULT_WORLD_CHECKS, WORLD_CHECKS, WORLD_SLACK_S, WorldPlan
from scripts.gpu.world_training import LAYOUT_NAMES

MODES = ("lazy", "bound")
#: The creation path each mode must get on NCCL (docs/results/gpus.md).
EXPECTED_PATH = {"lazy": "member", "bound": "split"}
FAST_TESTS = ["-m", "not slow and not multiprocess and not network", "tests"]
#: Seconds allowed for the check's own start (imports, the environment) in its worst case.
START_S = 15.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cpu-dry-run",
        "--dry-run",
        action="store_true",
        help="no GPU: gloo instead of NCCL, a stand-in for NCCL's options, training on the CPU; "
        "the lazy mode only (gloo binds no device)",
    )
    p.add_argument("--output", default=None, help="report file (default: $OUT/gpu_check.txt when $OUT is set)")
    p.add_argument(
        "--megatron-path",
        default=None,
        help=f"unzipped megatron-core wheel put first on sys.path, also for the tests (default: ${MEGATRON_PATH_ENV})",
    )
    p.add_argument("--modes", default=None, help="comma-separated modes (default: lazy,bound; dry run: lazy)")
    p.add_argument("--no-tests", action="store_true", help="skip the fast test subset")
    p.add_argument("--pytest-workers", type=int, default=0, help="pytest -n N (pytest-xdist); 0: no -n")
    p.add_argument("--mode-timeout", type=float, default=150.0, help="seconds for each mode's process")
    p.add_argument("--tests-timeout", type=float, default=180.0, help="seconds for the test subset")
    p.add_argument(
        "--world",
        default=None,
        help="comma-separated world sizes of N ranks on one GPU (scripts/gpu/world.py), each in --world-modes; "
        "default 8,16 on a GPU, none in the dry run; 0: none",
    )
    p.add_argument(
        "--world-timeout",
        type=float,
        default=None,
        help="seconds for each groups or death world; default on a GPU twice the slowest measured 8-rank world "
        "(51.6 s, H200, 2026-11-28) times size/8 for larger worlds, rounded up to 10 s: 110 s at 8 ranks, "
        "210 s at 16; in the dry run 150 s at 8 ranks, scaled the same way",
    )
    p.add_argument("--world-only", action="store_true", help="skip the world-size-1 modes (with --world)")
    p.add_argument("--world-modes", default="lazy,bound", help="comma-separated modes of the N-rank worlds")
    p.add_argument(
        "--world-checks",
        default=",".join(DEFAULT_WORLD_CHECKS),
        help=f"comma-separated N-rank checks, of {', '.join(WORLD_CHECKS)}: groups and builders share a world, "
        "training has its own, death and death-nonblocking run in the bound mode at the first size; recovery, "
        "ladder, sharing and sleep run once per mode, in the order given, after the others (recovery, sharing and "
        "sleep at the first size)",
    )
    p.add_argument("--recovery-timeout", type=float, default=90.0, help="seconds for the recovery world")
    p.add_argument(
        "--ladder-sizes", default="8,16,32,48,64", help="the ladder's world sizes, in order (4 or multiples of 8)"
    )
    p.add_argument(
        "--ladder-timeout",
        type=float,
        default=150.0,
        help="seconds for the whole ladder (it stops at a size that would not fit)",
    )
    p.add_argument(
        "--sharing-values",
        default="0,safe,1",
        help="PSNG_SHARE_GROUPS values compared (0: off; unset: the variable removed, the path's default)",
    )
    p.add_argument(
        "--sharing-training",
        default="safe",
        help="PSNG_SHARE_GROUPS value of the sharing world's training (MCore against compat, dense); empty: none",
    )
    p.add_argument("--sharing-timeout", type=float, default=90.0, help="seconds for the sharing world")
    p.add_argument("--sleep-timeout", type=float, default=90.0, help="seconds for the sleep world")
    p.add_argument(
        "--training-layouts",
        default=",".join(LAYOUT_NAMES),
        help="dense (tp2 pp2 dp rest), moe (tp1 pp2 ep2, 4 experts) or both; world sizes a multiple of 4",
    )
    p.add_argument(
        "--training-timeout",
        type=float,
        default=None,
        help="seconds for each N-rank training world; default on a GPU twice the slowest measured 8-rank "
        "training world (58.2 s, H200, 2026-11-28) times size/8 for larger worlds, rounded up to 10 s: "
        "120 s at 8 ranks, 240 s at 16; in the dry run 300 s at 8 ranks, scaled the same way",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="refuse to start (exit 2) when the worst case of the selected parts exceeds this many seconds",
    )
    args = p.parse_args(argv)
    text = args.world if args.world is not None else ("" if args.cpu_dry_run else "8,16")
    try:
        args.world = [int(n) for n in text.split(",") if n.strip() and int(n) != 0]
    except ValueError:
        p.error(f"--world takes comma-separated ints, got {text!r}")
    if any(n < 2 for n in args.world):
        p.error(f"--world sizes must be at least 2, got {args.world}")
    default = ("lazy",) if args.cpu_dry_run else MODES
    args.modes = tuple(m for m in args.modes.split(",") if m) if args.modes else default
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes:
        p.error(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
    if args.cpu_dry_run and "bound" in args.modes:
        p.error("--cpu-dry-run cannot run the bound mode: init_process_group binds only an accelerator")
    args.world_modes = _choices(p, "--world-modes", args.world_modes, MODES)
    args.world_checks = _choices(p, "--world-checks", args.world_checks, WORLD_CHECKS)
    args.training_layouts = _choices(p, "--training-layouts", args.training_layouts, LAYOUT_NAMES)
    if "training" in args.world_checks and any(n % 4 for n in args.world):
        p.error(f"--world-checks training needs world sizes that are multiples of 4, got {args.world}")
    _once_options(p, args)
    worst = worst_case(args)
    if args.budget is not None and worst > args.budget:
        p.error(f"the selected parts may take {worst:.0f} s, over --budget {args.budget:.0f} s: {budget_text(args)}")
    return args


def _once_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Parse and check the options of the recovery, ladder, sharing and sleep checks."""
    try:
        args.ladder_sizes = tuple(int(n) for n in args.ladder_sizes.split(",") if n.strip())
    except ValueError:
        p.error(f"--ladder-sizes takes comma-separated ints, got {args.ladder_sizes!r}")
    if not args.ladder_sizes or any(n != 4 and (n < 8 or n % 8) for n in args.ladder_sizes):
        p.error(f"--ladder-sizes must be 4 (tp1 pp2 ep2) or multiples of 8 (tp2 pp2 ep2), got {args.ladder_sizes}")
    args.sharing_values = tuple(v.strip() for v in args.sharing_values.split(",") if v.strip())
    args.sharing_training = args.sharing_training.strip()
    if "ladder" in args.world_checks and not args.world:
        p.error("--world-checks ladder runs with the N-rank checks: give --world (its sizes are --ladder-sizes)")
    once = [c for c in args.world_checks if c in ("recovery", "sharing", "sleep")]
    if once and (not args.world or args.world[0] % 4 or (args.world[0] > 4 and args.world[0] % 8)):
        p.error(f"--world-checks {','.join(once)} needs a first --world size of 4 or 8k, got {args.world}")
    if "sharing" in args.world_checks and not args.sharing_values:
        p.error("--sharing-values is empty")


def _choices(p: argparse.ArgumentParser, flag: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [x for x in chosen if x not in allowed]
    if bad or not chosen:
        p.error(f"{flag} takes a comma-separated selection of {', '.join(allowed)}, got {text!r}")
    return chosen


def world_plan(args: argparse.Namespace) -> WorldPlan:
    """The N-rank worlds the options select (:class:`scripts.gpu.world_report.WorldPlan`)."""
    return WorldPlan(
        tuple(args.world),
        args.world_modes,
        args.world_checks,
        args.training_layouts,
        args.world_timeout,
        args.training_timeout,
        args.recovery_timeout,
        args.ladder_sizes,
        args.ladder_timeout,
        args.sharing_values,
        args.sharing_training,
        args.sharing_timeout,
        args.sleep_timeout,
    )


def _parts(args: argparse.Namespace) -> list[tuple[str, float]]:
    """(part, its time limit in seconds) of everything the options run."""
    parts = [("start", START_S)]
    if not args.world_only:
        parts += [(f"mode {m}", args.mode_timeout + WORLD_SLACK_S) for m in args.modes]
    backend = "gloo" if args.cpu_dry_run else "nccl"
    if args.world:
        parts += [(f"{n} {m} {what}", t + WORLD_SLACK_S) for n, m, what, t in world_plan(args).worlds(backend)]
    if not args.no_tests:
        parts.append(("fast tests", args.tests_timeout))
    return parts


def worst_case(args: argparse.Namespace) -> float:
    """Seconds the run may take at most: every part's limit (plus starting and killing slack)."""
    return sum(t for _, t in _parts(args))


def budget_text(args: argparse.Namespace) -> str:
    """Each part with its limit, for the report and for ``--budget``'s refusal."""
    return ", ".join(f"{name} {t:.0f} s" for name, t in _parts(args))


def environment(device: str) -> list[str]:
    """Date, Python, torch, CUDA, NCCL, the GPU and the megatron-core found."""
    import importlib.metadata

    import torch

    lines = [
        f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"host: {platform.node()}  python {platform.python_version()}  torch {torch.__version__}",
        f"CUDA (torch build): {torch.version.cuda}  cuda available: {torch.cuda.is_available()}",
    ]
    if device == "cuda":
        nccl = torch.cuda.nccl.version()
        lines.append(f"NCCL: {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}")
        props = torch.cuda.get_device_properties(0)
        lines.append(f"GPU: {props.name}, {props.total_memory // 2**20} MiB, {torch.cuda.device_count()} device(s)")
    else:
        lines.append("NCCL: none (CPU dry run: gloo)")
        lines.append("GPU: none (CPU dry run)")
    try:
        lines.append(f"megatron-core: {importlib.metadata.version('megatron-core')}")
    except importlib.metadata.PackageNotFoundError:
        lines.append("megatron-core: not found")
    lines.append(f"PSNG_CREATION_PATH: {os.environ.get('PSNG_CREATION_PATH', '(unset)')}")
    return lines


def run_mode(mode: str, device: str, workdir: str) -> dict[str, Any]:
    """One mode's checks in this process's initialized world of one rank."""
    import torch.distributed as dist

    from parallel_state_ng.groups.split import creation_path, world_splits
    from scripts.gpu.options import compare_options
    from scripts.gpu.train import train_both

    default = dist.distributed_c10d._get_default_group()
    out: dict[str, Any] = {
        "backend": dist.get_backend(),
        "bound_device": str(getattr(default, "bound_device_id", None)),
        "split_group_available": hasattr(dist, "split_group"),
        "world_splits": world_splits(),
        "creation_path": creation_path(),
    }
    start = time.monotonic()
    out["options"] = compare_options(workdir, device)
    out["options_seconds"] = round(time.monotonic() - start, 2)
    start = time.monotonic()
    out["training"] = train_both(device)
    out["training_seconds"] = round(time.monotonic() - start, 2)
    out["groups_left"] = len(dist.distributed_c10d._world.pg_map) - 1
    return out


def _mode_main(rank: int, mode: str, device: str, store_path: str, results: Any) -> None:
    """A fresh process of world size 1 (see :func:`run_ranks`): init, :func:`run_mode`, destroy."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    warnings.filterwarnings("ignore")
    try:
        import torch
        import torch.distributed as dist

        use_megatron_path()
        kwargs: dict[str, Any] = {}
        if device == "cuda":
            torch.cuda.set_device(0)
            torch.use_deterministic_algorithms(True, warn_only=True)
            if mode == "bound":
                kwargs["device_id"] = torch.device("cuda", 0)
        else:
            torch.set_num_threads(1)
        store = dist.FileStore(store_path, 1)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=1, store=store, **kwargs)
        try:
            results.put((rank, True, run_mode(mode, device, os.path.dirname(store_path))))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # the parent reports it
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def mode_checks(mode: str, r: dict[str, Any], dry_run: bool) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for one mode's result."""
    expected = "member" if dry_run else EXPECTED_PATH[mode]
    opts, train = r["options"], r["training"]
    counts = opts["counts"]
    mcore, ours = train["mcore"], train["compat"]
    return [
        (f"{mode}: creation path", r["creation_path"] == expected, f"{r['creation_path']} (expected {expected})"),
        (
            f"{mode}: NCCL options and timeouts equal MCore's",
            opts["mismatches"] == 0,
            f"{opts['mismatches']} mismatch(es) over {opts['mcore_calls']} MCore / {opts['compat_calls']} compat calls",
        ),
        (
            f"{mode}: compat's destroy frees every group",
            counts["after_destroy"] == counts["before"],
            f"registered groups {counts['before']} -> {counts['after_init']} after init -> "
            f"{counts['after_destroy']} after destroy ({counts.get('touched', 0)} used once)",
        ),
        (
            f"{mode}: training bit-identical to MCore",
            train["identical"],
            f"{train['steps']} steps on {ours['param_device']}; "
            f"losses MCore {mcore['losses']} compat {ours['losses']}; "
            f"digest MCore {mcore['digest'][:16]} compat {ours['digest'][:16]}",
        ),
        (
            f"{mode}: megatron's training code used compat",
            train["compat_resolved"],
            f"parallel_state {ours['parallel_state']}, schedules' {ours['schedules_parallel_state']}",
        ),
        (
            f"{mode}: no group left after compat's training",
            ours["leaked_groups"] == 0 and r["groups_left"] == 0,
            f"compat left {ours['leaked_groups']}, world holds {r['groups_left']} besides the default "
            f"(MCore left {mcore['leaked_groups']} in training, {opts['mcore_leaked']} after its init)",
        ),
    ]


def mode_lines(mode: str, r: dict[str, Any]) -> list[str]:
    """The facts of one mode and the options table."""
    from scripts.gpu.options import options_table

    opts = r["options"]
    counts = opts["counts"]
    lines = [
        f"backend {r['backend']}, bound device {r['bound_device']}, torch split_group available: "
        f"{r['split_group_available']}, world splits: {r['world_splits']}, creation path: {r['creation_path']}",
        f"NCCL options: {'NCCL' if opts['real_nccl_options'] else 'stand-in'} ProcessGroupNCCL.Options; "
        f"compat's calls by kind {opts['compat_calls_by_kind']}; {opts['mismatches']} mismatch(es)",
    ]
    if counts.get("free_mib_before") is not None:
        lines.append(
            f"free GPU memory (MiB): {counts['free_mib_before']} before compat's init, "
            f"{counts['free_mib_after_init']} with its groups used once, "
            f"{counts['free_mib_after_destroy']} after destroy"
        )
    lines.append(f"seconds: options {r['options_seconds']}, training {r['training_seconds']}")
    return lines + ["", *options_table(opts)]


def run_tests(workers: int, timeout: float, megatron_dirs: list[str]) -> tuple[bool, str, list[str]]:
    """The fast test subset in a subprocess; (passed, totals line, last lines of output)."""
    cmd = [sys.executable, "-m", "pytest", "-q", *FAST_TESTS]
    if workers:
        cmd += ["-n", str(workers)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*megatron_dirs, ROOT, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("PSNG_CREATION_PATH", None)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"did not finish in {timeout:.0f} s", []
    output = (proc.stdout + proc.stderr).strip().splitlines()
    totals = next((line for line in reversed(output) if re.search(r"\d+ (passed|failed|error)", line)), "no totals")
    return proc.returncode == 0, f"{' '.join(cmd[1:])}: rc {proc.returncode}; {totals.strip('= ')}", output[-15:]


def _output_path(args: argparse.Namespace) -> str | None:
    if args.output:
        return str(args.output)
    out = os.environ.get("OUT")
    return os.path.join(out, "gpu_check.txt") if out else None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (exit codes: the module docstring)."""
    args = parse_args(argv)
    import torch

    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("error: no CUDA GPU found (torch.cuda.is_available() is False); use --cpu-dry-run to check on CPU")
        return 2
    device = "cpu" if args.cpu_dry_run else "cuda"
    dirs = use_megatron_path(args.megatron_path)
    if dirs:
        os.environ[MEGATRON_PATH_ENV] = os.pathsep.join(dirs)  # the mode processes and the tests
    title = "GPU check (CPU DRY RUN: gloo, stand-in NCCL options)" if args.cpu_dry_run else "GPU check"
    lines = [f"# {title}", *environment(device)]
    lines.append(f"worst case {worst_case(args):.0f} s: {budget_text(args)}")
    print(lines[-1], file=sys.stderr, flush=True)  # first, before anything runs
    checks: list[tuple[str, bool, str]] = []
    for mode in () if args.world_only else args.modes:
        lines += ["", f"## mode {mode}: init_process_group({'nccl' if device == 'cuda' else 'gloo'}"]
        lines[-1] += ", device_id=cuda:0)" if mode == "bound" else ")  (lazy)"
        start = time.monotonic()
        try:
            (result,) = run_ranks(1, _mode_main, (mode, device), args.mode_timeout)
        except RuntimeError as exc:
            checks.append((f"{mode}: the mode's process", False, str(exc).splitlines()[0]))
            lines += [f"FAILED: {exc}"]
            continue
        lines += mode_lines(mode, result)
        lines.append(f"mode wall time: {time.monotonic() - start:.1f} s")
        checks += mode_checks(mode, result, args.cpu_dry_run)
    if args.world:
        from scripts.gpu.world_report import world_section

        backend = "gloo" if args.cpu_dry_run else "nccl"
        lines += ["", f"## N ranks on one {'CPU (gloo dry run)' if args.cpu_dry_run else 'GPU'}: {args.world}"]
        world_lines, world_checks = world_section(world_plan(args), backend)
        lines += world_lines
        checks += world_checks
    if args.no_tests:
        lines += ["", "## fast tests: skipped (--no-tests)"]
    else:
        start = time.monotonic()
        ok, totals, tail = run_tests(args.pytest_workers, args.tests_timeout, dirs)
        checks.append(("fast tests", ok, totals))
        lines += ["", f"## fast tests ({time.monotonic() - start:.0f} s)", *(tail if not ok else [totals])]
    failed = sum(not ok for _, ok, _ in checks)
    lines += ["", "## checks", *(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}" for name, ok, detail in checks)]
    lines.append(f"summary: {len(checks) - failed} passed, {failed} failed")
    text = "\n".join(lines) + "\n"
    path = _output_path(args)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as stream:
            stream.write(text)
    print(text + (f"report written to {path}" if path else "report not written (no --output, no $OUT)"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("gpu", "check")
