"""Cost of the cross-rank agreement check that runs before initialize_model_parallel.

    python scripts/bench_agreement.py                 # gloo worlds of 4 and 8 CPU processes
    python scripts/bench_agreement.py --worlds 2,4,8,16 --repeats 50 --store tcp

Each world is a set of local processes (gloo). ``--store file`` rendezvous through a
``FileStore`` in a temporary directory; ``--store tcp`` through a ``TCPStore`` on a free
loopback port (what ``torchrun`` uses). Every rank runs
:func:`parallel_state_ng.core.agreement.measure_agreement_check` (a barrier, then one check, repeated);
the table shows the median and max time of a check over ranks, the store operations of a
waiting rank (constant: it does not grow with the world) and of the one comparing rank, and
the time of a mismatch verdict (one rank passes another tensor-parallel size).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, store_kind: str, where: str, repeats: int, out_dir: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    from parallel_state_ng.core import agreement

    if store_kind == "tcp":
        store = dist.TCPStore("127.0.0.1", int(where), world, is_master=rank == 0, wait_for_workers=True)
    else:
        store = dist.FileStore(where, world)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    result = agreement.measure_agreement_check(repeats)
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="4,8", help="comma-separated world sizes (default 4,8)")
    parser.add_argument("--repeats", type=int, default=30, help="checks per rank (default 30)")
    parser.add_argument("--store", choices=("file", "tcp"), default="tcp", help="rendezvous store (default tcp)")
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
    print(f"{'world':>6} {'median ms':>10} {'max ms':>8} {'ops waiting':>12} {'ops comparing':>14} {'mismatch ms':>12}  verdict")
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
    sys.exit(main())
