"""What the hang watch costs a collective: torch's all-reduce with and without it, per operation.

Two measurements, each in rounds that alternate off / on (the fastest round of each: the machine is shared):

* **simulated**: one rank of 8 on torch's fake backend (tp2 pp2 dp2 through compat), an
  all-reduce of one float on the tp group: the collective itself does nothing, so the difference
  is the watch's recording alone (group lookup, counter, ring slot, clock);
* **gloo**: 2 CPU processes, the same all-reduce on a real tp group of 2: the recording against
  a real collective.

The watcher thread's poll is set past the run (it never wakes), so what is timed is the path
every collective takes. Figures: docs/results/performance.md ("The hang watch"); options: ``--help``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any


def _time_all_reduce(ops: int, rounds: int) -> dict[str, float]:
    """Seconds per all-reduce on this rank's tp group, watch off and on: the fastest of ``rounds``."""
    import torch
    import torch.distributed as dist

    import compat.parallel_state as ps
    from parallel_state_ng.groups.hang_watch import HangWatch

    group, x = ps.get_tensor_model_parallel_group(), torch.ones(1)
    per: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for mode in ("off", "on"):
            watch = HangWatch(3600.0, poll_s=3600.0).start() if mode == "on" else None
            try:
                if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
                    dist.barrier()
                start = time.perf_counter()
                for _ in range(ops):
                    dist.all_reduce(x, group=group)
                per[mode].append((time.perf_counter() - start) / ops)
            finally:
                if watch is not None:
                    watch.stop()
    return {mode: min(values) for mode, values in per.items()}


def simulated(ops: int, rounds: int) -> dict[str, float]:
    """The fake-backend measurement (this process is rank 0 of 8)."""
    import compat.parallel_state as ps
    from parallel_state_ng.testing.worlds import simulated_rank

    with simulated_rank(0, 8):
        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        try:
            return _time_all_reduce(ops, rounds)
        finally:
            ps.destroy_model_parallel()


def _gloo_rank(ops: int, rounds: int) -> dict[str, float]:
    import compat.parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        return _time_all_reduce(ops, rounds)
    finally:
        ps.destroy_model_parallel()


def gloo(ops: int, rounds: int) -> dict[str, float]:
    """The 2-rank gloo measurement (rank 0's figures)."""
    from scripts.harness.worlds import run_on_world

    return run_on_world(2, _gloo_rank, ops, rounds)[0]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m scripts.bench hang_watch [--ops N] [--rounds N]``."""
    from scripts.harness.header import platform_header
    from scripts.harness.output import markdown_table

    parser = argparse.ArgumentParser(prog="python -m scripts.bench hang_watch", description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=_positive, default=20000, help="all-reduces per timing (default 20000)")
    parser.add_argument("--gloo-ops", type=_positive, default=2000, help="all-reduces per gloo timing (default 2000)")
    parser.add_argument("--rounds", type=_positive, default=5, help="off/on rounds, fastest taken (default 5)")
    args = parser.parse_args(argv)
    rows: list[list[Any]] = []
    for name, figures in (
        ("simulated (fake backend, rank 0 of 8)", simulated(args.ops, args.rounds)),
        ("gloo, 2 processes", gloo(args.gloo_ops, args.rounds)),
    ):
        off, on = figures["off"] * 1e6, figures["on"] * 1e6
        rows.append([name, f"{off:.2f}", f"{on:.2f}", f"{on - off:+.2f}", f"{(on - off) / off:+.1%}"])
    print(platform_header())
    print(markdown_table(["all-reduce of 1 float on tp", "off (µs)", "on (µs)", "watch (µs/op)", "relative"], rows))
    return 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "hang_watch")
