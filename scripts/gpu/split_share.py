"""What NCCL's split sharing saves in the one-GPU world: the same init with and without it.

NCCL shares a split's resources when the *parent* communicator's config has ``splitShare``
(NVIDIA/nccl ``src/init.cc``: ``ncclCommSplit`` reads ``comm->config.splitShare`` of the
communicator being split; docs/results/gpus.md, "Split sharing"). The parent of compat's splits is the
default group's communicator, made by ``init_process_group``: its config gets ``splitShare``
from ``NCCL_COMM_SPLIT_SHARE_RESOURCES=1`` in the rank's environment before that call (NCCL
reads its parameters once per process). Two worlds of :func:`scripts.gpu.world.run_world`,
bound (every group a split), the same compat init in each, one with the variable and one
without; every rank (:func:`rank_memory`): the device's free memory, its own host RSS and its
thread count before the init, with every group used once (an all-reduce: the communicator
connected) and after destroy; rank 0 also reads its NCCL log (``NCCL_DEBUG=INFO``, subsystems
INIT, ENV, ALLOC): the lines naming split share (the parent's config shows there) and the
allocations NCCL reports, with their bytes.

``python3 -m scripts.gpu split_share --megatron-path .megatron/0.19.2`` (GPU; ``--cpu-dry-run``:
the same worlds on gloo, where the variable means nothing) prints the worst case first, then
one row per world, and writes ``$OUT/split_share.json``. Not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from scripts.bench.world_init import parse_layout
from scripts.gpu.world import RankContext, WorldError, run_world

#: NCCL's own switch: every communicator's config gets splitShare (the default group's too).
ENV_NCCL_SHARE = "NCCL_COMM_SPLIT_SHARE_RESOURCES"
#: The two worlds: label -> extra environment of every rank.
WORLDS = {"no sharing": {}, "NCCL_COMM_SPLIT_SHARE_RESOURCES=1": {ENV_NCCL_SHARE: "1"}}
#: Seconds per world over its timeout (starting the ranks; killing them after a timeout).
SLACK_S = 15.0
_ALLOC = re.compile(r"Alloc Size (\d+)", re.IGNORECASE)
_SHARE = re.compile(r"split ?share", re.IGNORECASE)


def _host() -> tuple[float, int]:
    """This process's resident host memory (MiB) and thread count, from ``/proc/self/status``."""
    rss, threads = 0.0, 0
    with open("/proc/self/status", encoding="utf-8") as stream:
        for line in stream:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return round(rss, 1), threads


def _point(ctx: RankContext) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    if ctx.backend == "nccl":
        torch.cuda.synchronize()
    dist.barrier()
    free = torch.cuda.mem_get_info()[0] // 2**20 if ctx.backend == "nccl" else None
    rss, threads = _host()
    return {"free_mib": free, "rss_mib": rss, "threads": threads}


def rank_memory(ctx: RankContext, layout: str) -> dict[str, Any]:
    """Compat's init on this rank, every group used once, destroy: the three points (module docstring)."""
    import torch.distributed as dist

    from parallel_state_ng.testing.megatron_cpu import use_megatron_path
    from scripts.gpu.options import touch_groups

    use_megatron_path()
    import compat.parallel_state as ps

    before_groups = set(dist.distributed_c10d._world.pg_map)
    start = time.monotonic()
    points = {"before": _point(ctx)}
    ps.initialize_model_parallel(**parse_layout(layout), create_gloo_process_groups=False)
    used = touch_groups(before_groups, ctx.device.type)
    points["in use"] = _point(ctx)
    ps.destroy_model_parallel()
    points["after"] = _point(ctx)
    out: dict[str, Any] = {"rank": ctx.rank, "points": points, "groups_used": used}
    out["seconds"] = round(time.monotonic() - start, 2)
    log = os.environ.get("NCCL_DEBUG_FILE")
    if ctx.rank == 0 and log:
        out["nccl_log"] = _log_summary(log.replace("%p", str(os.getpid())))
    return out


def _log_summary(path: str) -> dict[str, Any]:
    """Rank 0's NCCL log: lines naming split share, allocations reported and their bytes."""
    if not os.path.exists(path):
        return {"lines": 0}
    with open(path, encoding="utf-8", errors="replace") as stream:
        lines = stream.read().splitlines()
    sizes = [int(m.group(1)) for m in map(_ALLOC.search, lines) if m]
    shares = [line.split("NCCL INFO", 1)[-1].strip() for line in lines if _SHARE.search(line)]
    return {
        "lines": len(lines),
        "split_share_lines": len(shares),
        "split_share_first": shares[:3],
        "allocations": len(sizes),
        "allocated_mib": round(sum(sizes) / 2**20, 1),
    }


def summarize(label: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """One world's figures: device MiB held by all ranks' groups (rank 0's view of the shared
    device), host RSS and threads added over all ranks, rank 0's NCCL log summary.
    """
    first = results[0]["points"]

    def held(key: str) -> float | None:
        if first["before"]["free_mib"] is None:
            return None
        return float(first["before"]["free_mib"] - first[key]["free_mib"])

    def added(field: str) -> float:
        return round(sum(r["points"]["in use"][field] - r["points"]["before"][field] for r in results), 1)

    return {
        "world": label,
        "device_held_mib": held("in use"),
        "device_left_after_destroy_mib": held("after"),
        "host_rss_added_mib": added("rss_mib"),
        "threads_added": added("threads"),
        "groups_used_rank0": results[0]["groups_used"],
        "slowest_s": max(r["seconds"] for r in results),
        "nccl_log_rank0": results[0].get("nccl_log"),
    }


def world_env(extra: dict[str, str], backend: str, logdir: str) -> dict[str, str]:
    """A world's environment: the sharing switch and, on NCCL, each rank's debug log in ``logdir``
    (NCCL opens it at its first message, inside ``init_process_group``: set before torch starts).
    """
    env = dict(extra)
    if backend == "nccl":
        env.update(
            {
                "NCCL_DEBUG": "INFO",
                "NCCL_DEBUG_SUBSYS": "INIT,ENV,ALLOC",
                "NCCL_DEBUG_FILE": os.path.join(logdir, "nccl.%p.log"),
            }
        )
    return env


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (``--help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-dry-run", "--dry-run", action="store_true", help="gloo ranks on the CPU")
    p.add_argument("--megatron-path", default=None, help="unzipped megatron-core wheel (as scripts.gpu.check takes it)")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--layout", default="tp2-pp2-ep2")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds for each world")
    p.add_argument("--output", default=None, help="JSON file (default: $OUT/split_share.json when $OUT is set)")
    p.add_argument("--budget", type=float, default=None, help="refuse to start when the worst case exceeds it")
    args = p.parse_args(argv)
    parse_layout(args.layout)  # a bad layout: refused now
    worst = worst_case_s(args)
    if args.budget is not None and worst > args.budget:
        p.error(f"the two worlds may take {worst:.0f} s, over --budget {args.budget:.0f} s")
    return args


def worst_case_s(args: argparse.Namespace) -> float:
    """Seconds the call may take at most: each world's timeout plus :data:`SLACK_S`."""
    return len(WORLDS) * (args.timeout + SLACK_S)


def main(argv: Sequence[str] | None = None) -> int:
    """Run both worlds; exit 0 when both ran (the figures are the result), 1 when one failed."""
    args = parse_args(argv)
    from parallel_state_ng.testing.megatron_cpu import MEGATRON_PATH_ENV, use_megatron_path

    dirs = use_megatron_path(args.megatron_path)
    if dirs:
        os.environ[MEGATRON_PATH_ENV] = os.pathsep.join(dirs)  # the ranks inherit it
    backend = "gloo" if args.cpu_dry_run else "nccl"
    print(
        f"worst case {worst_case_s(args):.0f} s: {len(WORLDS)} worlds of {args.world} ranks, {args.timeout:.0f} s each"
    )
    rows, failed = [], 0
    logdir = tempfile.mkdtemp(prefix="psng-split-share-")
    for label, extra in WORLDS.items():
        env = world_env(extra, backend, os.path.join(logdir, str(len(rows) + failed)))
        os.makedirs(os.path.join(logdir, str(len(rows) + failed)))
        try:
            results = run_world(
                args.world, rank_memory, (args.layout,), backend=backend, mode="bound", timeout=args.timeout, env=env
            )
        except WorldError as err:
            failed += 1
            print(f"{label}: FAILED: {str(err).splitlines()[0]}")
            continue
        row = summarize(label, results)
        rows.append(row)
        print(json.dumps(row))
    shutil.rmtree(logdir, ignore_errors=True)
    path = args.output or (os.path.join(os.environ["OUT"], "split_share.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w", encoding="utf-8") as stream:
            json.dump(rows, stream, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("gpu", "split_share")
