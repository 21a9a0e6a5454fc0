"""Start the ranks of a CPU run: processes joined through a ``FileStore``, results by rank.

Shared by the core loop (:mod:`scripts.examples.train_gpt`) and Megatron-LM's loop
(:mod:`scripts.examples.gpt.pretrain_cli`). Importing this module imports neither torch nor
megatron. The ranks are forked from a server that has imported torch
(:func:`parallel_state_ng.testing.forking.worker_context`), not megatron, and get the caller's
environment: each rank still imports megatron itself.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
from typing import Any


def run_ranks(world_size: int, target, args: tuple, timeout: float = 600.0) -> list[Any]:
    """Start ``world_size`` processes running ``target(rank, *args, store_path,
    results)`` (a ``FileStore`` path in a fresh temporary directory and a queue for
    ``(rank, ok, value)``); the values ordered by rank. Raises ``RuntimeError`` with the failing
    ranks' messages, or when the run exceeds ``timeout`` seconds (all processes are then killed).
    """
    from parallel_state_ng.testing.forking import run_in_environ, worker_context

    env = dict(os.environ)
    ctx = worker_context(env)  # forked from a server that has imported torch; spawn where it cannot
    tmp = tempfile.mkdtemp(prefix="psng-train-")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=run_in_environ, args=(env, target, r, *args, os.path.join(tmp, "store"), results), daemon=True
        )
        for r in range(world_size)
    ]
    grace = 10.0  # seconds each process gets to exit on its own; none after a failure
    try:
        for proc in procs:
            proc.start()
        done: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(done) + len(errors) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
                (done if ok else errors)[rank] = value
            except queue.Empty:
                for r, proc in enumerate(procs):
                    if proc.exitcode not in (None, 0) and r not in done and r not in errors:
                        errors[r] = f"process exited with code {proc.exitcode}"
            if errors:  # the other ranks may wait forever for the failed one: report soon
                deadline = min(deadline, time.monotonic() + 10)
                grace = 0.1
            if time.monotonic() > deadline:
                grace = 0.1
                if not errors:
                    raise RuntimeError(f"training did not finish in {timeout} s")
                break
        if errors:
            details = "\n".join(f"--- rank {r}:\n{msg}" for r, msg in sorted(errors.items()))
            raise RuntimeError(f"{len(errors)} rank(s) failed:\n{details}")
        return [done[r] for r in range(world_size)]
    finally:
        for proc in procs:
            proc.join(timeout=grace)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)
