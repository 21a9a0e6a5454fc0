"""A hang named live and offline: 8 ranks, one stalls, the watch's report and ``diagnose``'s.

Every rank runs one clean training step of Megatron's shape and then a step in which one rank
stalls (``--case``): before the tp all-reduce (``tp``), before the pipeline send (``pp``),
before the dp gradient reduce (``dp``), before the ep all-to-all (``ep``, in a tp2 pp2 ep2 MoE
layout), in a sleep outside any collective (``loader``, the data-loader stand-in) or by issuing
an all-gather where its tp peer issues an all-reduce (``mismatch``). The hang watch
(:mod:`parallel_state_ng.groups.hang_watch`, bound ``--bound`` seconds) prints one report; the
stalled rank goes on once the report is in the store, so the step completes (the mismatch ends
at the groups' timeout, ``TIMEOUT_S``). Then ``parallel-state-ng diagnose`` reads the watch's
dumps. The per-rank body :func:`stall_case` is also the GPU check's (``scripts/gpu``, NCCL)
and the CPU tests' (``tests/groups/test_hang_watch_gloo.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any

#: case -> (MoE layout, culprit rank, stuck kind, its coordinates as the report writes them)
CASES: dict[str, tuple[bool, int, str, str]] = {
    "tp": (False, 3, "tp", "tp at dp=1 pp=0"),
    "pp": (False, 1, "pp", "pp at tp=1 dp=0"),
    "dp": (False, 6, "dp", "dp at tp=0 pp=1"),
    "loader": (False, 5, "tp", "tp at dp=0 pp=1"),
    "ep": (True, 4, "ep", "ep at tp=0 pp=1"),
    "mismatch": (False, 2, "tp", "tp at dp=1 pp=0"),
}
#: The groups' timeout in seconds: what ends the mismatch case (both sides then raise).
TIMEOUT_S = 4.0
#: The longest a stalled rank waits for the report before it goes on anyway.
RELEASE_S = 20.0
#: Where the reporting rank also writes the report, in the dump folder (not a dump: no rank number).
REPORT_FILE = "report.txt"


def layout_options(case: str) -> list[str]:
    """The ``diagnose`` / ``layout`` options of the case's layout."""
    return ["--world-size", "8", "--tp", "2", "--pp", "2"] + (["--ep", "2"] if CASES[case][0] else [])


def _wait_for(watch: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if watch.reported():
            return True
        time.sleep(0.05)
    return False


def _step(ps: Any, watch: Any, stall: str | None, culprit: int, marks: dict, device: Any) -> None:
    """One training step's communication, in Megatron's order; ``stall`` makes ``culprit`` stall."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()

    def hold(where: str) -> None:
        if stall == where and rank == culprit:
            marks["stalled_at"] = time.monotonic()
            marks["released"] = _wait_for(watch, RELEASE_S)
            marks["report_after_s"] = time.monotonic() - marks["stalled_at"]

    x = torch.ones(4, device=device)
    hold("loader")
    tp = ps.get_tensor_model_parallel_group()
    if stall == "mismatch" and rank == culprit:
        dist.all_gather_into_tensor(torch.empty(8, device=device), x, group=tp)
    else:
        hold("tp")
        dist.all_reduce(x, group=tp)
    if ps.get_expert_model_parallel_world_size() > 1:
        hold("ep")
        dist.all_to_all_single(torch.empty(4, device=device), x, group=ps.get_expert_model_parallel_group())
    hold("pp")
    pp = ps.get_pipeline_model_parallel_group()
    ranks, act = dist.get_process_group_ranks(pp), torch.ones(4, device=device)
    if ps.get_pipeline_model_parallel_rank() == 0:
        ops = [dist.P2POp(dist.isend, act, ranks[1], group=pp)]
    else:
        ops = [dist.P2POp(dist.irecv, act, ranks[0], group=pp)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    hold("dp")
    dist.all_reduce(torch.ones(4, device=device), group=ps.get_data_parallel_group(), async_op=True).wait()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def stall_case(case: str, dump_dir: str | None, fr_dir: str | None, bound_s: float = 1.0, device: Any = None) -> dict:
    """One rank of a case (call on every rank of an 8-rank world): the report, if this rank made it.

    Returns ``report`` (the text, on the one rank that printed it, else ``None``), ``error`` (the
    exception's type name when the step raised: the mismatch case), and on the culprit
    ``released`` and ``report_after_s`` (seconds from its stall to the report).
    """
    import compat.parallel_state as ps
    from parallel_state_ng.groups.hang_watch import HangWatch
    from parallel_state_ng.layout.megatron_layout import MegatronLayout

    if case not in CASES:
        raise ValueError(f"case must be one of {sorted(CASES)}, got {case!r}")
    moe, culprit, _, _ = CASES[case]
    ep = 2 if moe else 1
    ps.initialize_model_parallel(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=ep,
        distributed_timeout_minutes=TIMEOUT_S / 60,
    )
    reports: list[str] = []
    marks: dict = {}
    note = "data loader" if case == "loader" else ""

    def on_report(text: str) -> None:
        reports.append(text)
        if dump_dir is not None:  # kept should the rank die after (NCCL's watchdog, the mismatch)
            with open(os.path.join(dump_dir, REPORT_FILE), "w", encoding="utf-8") as handle:
                handle.write(text)

    watch = HangWatch(
        bound_s,
        layout=MegatronLayout(8, 2, 2, expert_model_parallel_size=ep),
        on_report=on_report,
        dump_dir=dump_dir,
        fr_dump_dir=fr_dir,
        note=lambda: note,
    ).start()
    error = ""
    try:
        _step(ps, watch, None, culprit, marks, device)
        try:
            _step(ps, watch, case, culprit, marks, device)
        except Exception as err:  # the mismatch: the groups' timeout ends both sides
            error = type(err).__name__
        _wait_for(watch, RELEASE_S)
    finally:
        watch.stop()
        ps.destroy_model_parallel()
    return {"report": reports[0] if reports else None, "error": error, **marks}


def names_case(first_line: str, case: str) -> bool:
    """Whether a report's first line names the case's culprit and, among the stuck group's kinds
    (a shared group names several: ``dp_cp at tp=0 pp=1; dp at tp=0 pp=1``), its kind and coordinates.
    """
    _, culprit, _, where = CASES[case]
    if f"likely culprit rank {culprit} " not in first_line or "stuck group " not in first_line:
        return False
    places = first_line.split("stuck group ", 1)[1].split(" (", 1)[0]
    return where in places.split("; ")


def offline(dump_dir: str, case: str) -> tuple[int, str]:
    """``parallel-state-ng diagnose DUMP_DIR`` with the case's layout: exit code and output."""
    from parallel_state_ng.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["diagnose", dump_dir, *layout_options(case)])
    return code, out.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m scripts.examples hang [--case NAME] [--bound S]``."""
    from scripts.harness.worlds import run_on_world

    parser = argparse.ArgumentParser(prog="python -m scripts.examples hang", description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=sorted(CASES), default="pp", help="where a rank stalls (default pp)")
    parser.add_argument("--bound", type=float, default=1.0, help="the watch's bound in seconds (default 1)")
    args = parser.parse_args(argv)
    if not args.bound > 0:
        parser.error(f"argument --bound: must be > 0, got {args.bound}")
    with tempfile.TemporaryDirectory() as dumps:
        results = run_on_world(8, stall_case, args.case, dumps, None, args.bound, timeout=90)
        report = next(r["report"] for r in results if r["report"])
        culprit = CASES[args.case][1]
        after = results[culprit].get("report_after_s")
        timing = f"{after:.1f} s after the stall" if after is not None else "the culprit issued the odd collective"
        print(f"# live: the watch's report (bound {args.bound:g} s), {timing}")
        print(report)
        code, text = offline(dumps, args.case)
        print(f"\n# offline: parallel-state-ng diagnose DUMP_DIR {' '.join(layout_options(args.case))}")
        print(text, end="")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("examples", "hang")
