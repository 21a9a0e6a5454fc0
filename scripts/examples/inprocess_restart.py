"""nvidia-resiliency-ext's in-process restart (``inprocess.Wrapper``) on CPU, with compat or MCore.

4 spawned processes run a function wrapped as Megatron-LM's ``--inprocess-restart`` wraps
training; one rank ``SIGKILL``s itself in each of the first two iterations and the wrapper must
restart the survivors in their processes (what each iteration does: :func:`_rank_main`). Needs
``nvidia-resiliency-ext`` importable (``--nvrx-path DIR``); not a dependency of this project.
A measurement, not a test. Set-up and figures: docs/results/reliability.md (under ``inprocess.Wrapper``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

WORLD = 4
VICTIMS = {0: 3, 1: 2}  # restart iteration -> initial rank that dies in it
STEPS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, directory: str, impl: str, nvrx_path: str | None) -> None:
    """The wrapped function (``AbortTorchDistributed``, a finalize calling ``destroy_model_parallel()``).

    Each iteration joins a new gloo world (a new ``FileStore``), calls ``initialize_model_parallel``
    and all-reduces over the data-parallel group step after step; in iteration 0 the rank started as
    3 ``SIGKILL``s itself, in iteration 1 the rank started as 2. Logs, per iteration, the process
    groups in torch's registry when it starts and after the init. ``port``: the wrapper's own
    ``TCPStore`` (a local port).
    """
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"
    )
    import warnings

    warnings.filterwarnings("ignore")
    from parallel_state_ng.testing.megatron_cpu import use_megatron_path

    use_megatron_path(nvrx_path, env=None)  # the nvidia-resiliency-ext wheel and its dependencies
    import torch
    import torch.distributed as dist
    from nvidia_resiliency_ext import inprocess

    if impl == "mcore":
        from megatron.core import parallel_state as ps
    else:
        import compat.parallel_state as ps

    log = open(os.path.join(directory, f"log-{rank}.jsonl"), "a")  # noqa: SIM115 - kept open for the run

    class DestroyModelParallel(inprocess.finalize.Finalize):
        """Megatron's finalize: ``destroy_model_parallel()`` (timed, errors recorded)."""

        def __call__(self, state: Any) -> Any:
            start = time.monotonic()
            try:
                ps.destroy_model_parallel()
                error = None
            except Exception as exc:  # recorded: whether it survives the abort is the point
                error = f"{type(exc).__name__}: {exc}"
            log.write(json.dumps({"finalize_s": time.monotonic() - start, "finalize_error": error}) + "\n")
            log.flush()
            return state

    wrapper = inprocess.Wrapper(
        abort=inprocess.abort.AbortTorchDistributed(),
        finalize=DestroyModelParallel(),
        health_check=None,
        soft_timeout=timedelta(seconds=20),
        hard_timeout=timedelta(seconds=40),
        heartbeat_timeout=timedelta(seconds=6),
        barrier_timeout=timedelta(seconds=60),
        completion_timeout=timedelta(seconds=60),
        monitor_process_logfile=os.path.join(directory, "monitor-{rank}.log"),
    )

    def train(call_wrapper=None) -> int:  # noqa: ANN001 - annotated below with the class itself
        assert call_wrapper is not None
        iteration = call_wrapper.iteration
        new_rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        at_start = len(dist.distributed_c10d._world.pg_map)
        store = dist.FileStore(os.path.join(directory, f"store-{iteration}"), size)
        dist.init_process_group("gloo", rank=new_rank, world_size=size, store=store, timeout=timedelta(seconds=60))
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
        # a blocked collective must fail before the wrapper's heartbeat timeout (gloo's abort
        # cannot wake it: see docs/reliability.md)
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=3), ps.get_data_parallel_group())
        record = {
            "iteration": iteration,
            "initial_rank": rank,
            "rank": new_rank,
            "world": size,
            "groups_at_start": at_start,
            "groups_after_init": len(dist.distributed_c10d._world.pg_map),
            "time": time.time(),
        }
        log.write(json.dumps(record) + "\n")
        log.flush()
        for step in range(STEPS):
            x = torch.ones(1)
            dist.all_reduce(x, group=ps.get_data_parallel_group())
            assert x.item() == size
            if VICTIMS.get(iteration) == rank and step == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.2)
            call_wrapper.ping()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        log.write(json.dumps({"iteration": iteration, "done": True, "world": size}) + "\n")
        log.flush()
        return size

    # the wrapper finds the parameter by its annotation, which must be the class (not a string)
    train.__annotations__["call_wrapper"] = inprocess.CallWrapper
    wrapper(train)()
    log.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the 4 processes; print each rank's per-iteration log."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=("compat", "mcore"), default="compat")
    parser.add_argument("--nvrx-path", default=os.environ.get("PSNG_NVRX_PATH"))
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as directory:
        procs = [
            ctx.Process(target=_rank_main, args=(r, port, directory, args.impl, args.nvrx_path)) for r in range(WORLD)
        ]
        start = time.monotonic()
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=max(1.0, args.timeout - (time.monotonic() - start)))
            if p.is_alive():
                p.kill()
        print(f"impl {args.impl}: {time.monotonic() - start:.1f} s; exit codes {[p.exitcode for p in procs]}")
        for r in range(WORLD):
            path = os.path.join(directory, f"log-{r}.jsonl")
            lines = open(path).read().splitlines() if os.path.exists(path) else []  # noqa: SIM115
            print(f"initial rank {r}:")
            for line in lines:
                print("   ", line)
    return 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("examples", "inprocess_restart")
