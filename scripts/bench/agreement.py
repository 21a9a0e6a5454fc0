"""Cost of the cross-rank agreement check that runs before initialize_model_parallel.

Every rank of a local gloo world runs :func:`measure_agreement_check`; the table shows the median
and max time of a check over ranks, the store operations of a waiting rank and of the comparing
rank, and the time of a mismatch verdict (one rank passes another tensor-parallel size).
Figures: docs/results/reliability.md; command: scripts/README.md; options: ``--help``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Mapping
from typing import Any


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _example_fields() -> dict[str, Any]:
    """A typical set of ``initialize_model_parallel`` arguments (what the check compares)."""
    return {
        "tensor_model_parallel_size": 8,
        "pipeline_model_parallel_size": 4,
        "virtual_pipeline_model_parallel_size": None,
        "pipeline_model_parallel_comm_backend": None,
        "use_sharp": False,
        "context_parallel_size": 2,
        "hierarchical_context_parallel_sizes": None,
        "hybrid_context_parallel": False,
        "expert_model_parallel_size": 8,
        "num_distributed_optimizer_instances": 1,
        "expert_tensor_parallel_size": None,
        "nccl_communicator_config_path": None,
        "distributed_timeout_minutes": 30,
        "order": "tp-cp-ep-dp-pp",
        "get_embedding_ranks": None,
        "get_position_embedding_ranks": None,
        "create_gloo_process_groups": True,
        "high_priority_stream_groups": None,
        "sharp_enabled_group": None,
        "create_all_gather_group": False,
    }


def measure_agreement_check(
    repeats: int = 20,
    *,
    fields: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    barrier: bool = True,
) -> dict[str, Any]:
    """Time :func:`check_agreement` on this rank; call it on EVERY rank of the world.

    Runs ``repeats`` checks of ``fields`` (default: a typical set of
    ``initialize_model_parallel`` arguments), each after a barrier when ``barrier`` (so the
    time is the check's, not the ranks' skew). Returns per-call seconds (``times_s``,
    ``median_s``, ``mean_s``, ``min_s``, ``max_s``), the world size, the store operations of
    a rank that did not compare (``store_ops_waiting``, constant) and of the comparing rank
    (``store_ops_comparing``; ``None`` if this rank never compared). ``timeout`` defaults
    to the check's default (:data:`parallel_state_ng.groups.agreement.DEFAULT_TIMEOUT_S`).
    """
    import torch.distributed as dist

    from parallel_state_ng.groups.agreement import DEFAULT_TIMEOUT_S, check_agreement

    timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    fields = _example_fields() if fields is None else fields
    times: list[float] = []
    waiting: int | None = None
    comparing: int | None = None
    for _ in range(repeats):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        result = check_agreement(fields, name="agreement-benchmark", timeout=timeout)
        times.append(time.perf_counter() - t0)
        if result.compared:
            comparing = result.store_ops
        else:
            waiting = result.store_ops
    return {
        "world_size": dist.get_world_size(),
        "rank": dist.get_rank(),
        "repeats": repeats,
        "times_s": times,
        "median_s": statistics.median(times),
        "mean_s": statistics.fmean(times),
        "min_s": min(times),
        "max_s": max(times),
        "store_ops_waiting": waiting,
        "store_ops_comparing": comparing,
    }


def _worker(rank: int, world: int, store_kind: str, where: str, repeats: int, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    from parallel_state_ng.groups import agreement

    if store_kind == "tcp":
        store = dist.TCPStore("127.0.0.1", int(where), world, is_master=rank == 0, wait_for_workers=True)
    else:
        store = dist.FileStore(where, world)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    result = measure_agreement_check(repeats)
    # Mismatch: the last rank asks for another tensor-parallel size.
    fields = {"tensor_model_parallel_size": 2 if rank == world - 1 else 1, "order": "tp-cp-ep-dp-pp"}
    dist.barrier()
    t0 = time.perf_counter()
    try:
        agreement.check_agreement(fields, name="bench-mismatch", timeout=30)
        verdict = "no error"
    except agreement.ParallelConfigMismatchError:
        verdict = "ParallelConfigMismatchError"
    result["mismatch_s"] = time.perf_counter() - t0
    result["mismatch_verdict"] = verdict
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)


def run_world(world: int, store_kind: str, repeats: int) -> dict:
    """Run the measurement on a fresh world of ``world`` processes; summarize over ranks."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="psng-agree-") as tmp:
        where = str(_free_port()) if store_kind == "tcp" else os.path.join(tmp, "store")
        mp.start_processes(_worker, args=(world, store_kind, where, repeats, tmp), nprocs=world, start_method="spawn")
        ranks = [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(world)]
    medians = [r["median_s"] for r in ranks]
    comparing = [r["store_ops_comparing"] for r in ranks if r["store_ops_comparing"] is not None]
    waiting = {r["store_ops_waiting"] for r in ranks if r["store_ops_waiting"] is not None}
    return {
        "world": world,
        "store": store_kind,
        "repeats": repeats,
        "median_s": statistics.median(medians),
        "max_s": max(r["max_s"] for r in ranks),
        "store_ops_waiting": sorted(waiting),
        "store_ops_comparing": sorted(set(comparing)),
        "mismatch_s": max(r["mismatch_s"] for r in ranks),
        "mismatch_verdicts": sorted({r["mismatch_verdict"] for r in ranks}),
    }


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the benchmark and print its table; returns the exit status.

    A waiting rank's store operations are constant: they do not grow with the world.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="4,8", help="comma-separated world sizes (default 4,8)")
    parser.add_argument("--repeats", type=int, default=30, help="checks per rank (default 30)")
    parser.add_argument(
        "--store",
        choices=("file", "tcp"),
        default="tcp",
        help="rendezvous store (default tcp): a FileStore in a temporary directory, or a TCPStore on a free "
        "loopback port (what torchrun uses)",
    )
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        parser.error(f"--worlds must be comma-separated ints, got {args.worlds!r}")
    if any(w < 2 for w in worlds) or args.repeats < 1:
        parser.error("--worlds entries must be >= 2 and --repeats >= 1")
    rows = [run_world(w, args.store, args.repeats) for w in worlds]
    print(f"agreement check before initialize_model_parallel, gloo CPU processes, {args.store} store")
    print(
        f"{'world':>6} {'median ms':>10} {'max ms':>8} {'ops waiting':>12} "
        f"{'ops comparing':>14} {'mismatch ms':>12}  verdict"
    )
    for r in rows:
        print(
            f"{r['world']:>6} {r['median_s'] * 1e3:>10.2f} {r['max_s'] * 1e3:>8.2f} "
            f"{','.join(map(str, r['store_ops_waiting'])):>12} {','.join(map(str, r['store_ops_comparing'])):>14} "
            f"{r['mismatch_s'] * 1e3:>12.2f}  {'/'.join(r['mismatch_verdicts'])}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(r["mismatch_verdicts"] == ["ParallelConfigMismatchError"] for r in rows) else 1


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "agreement")
