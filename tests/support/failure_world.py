"""Short-lived gloo worlds in which ranks die or stop on purpose (failure tests).

:class:`tests.support.gloo_world.GlooWorld` keeps its workers for many tests and is closed
as soon as one dies; failure tests need the opposite: a fresh world per test whose ranks may
``os._exit`` or ``SIGSTOP`` themselves. :func:`run_world` spawns ``world_size`` processes,
joins them in a gloo world over a ``FileStore`` in ``directory`` (no ports: ``pytest -n auto``
safe), runs ``fn(rank, directory, *args)`` on each and returns ``{rank: result}`` for the
ranks that reported (a rank that died reports nothing; a rank whose ``fn`` raised reports
``("raised", type name, message, seconds)``). Every process still alive at the end (a stopped
rank) is killed, so a test never leaves one behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def _worker(rank: int, world_size: int, directory: str, fn: Callable[..., Any], args: tuple, outbox, env: dict) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    store = dist.FileStore(os.path.join(directory, "store"), world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store, timeout=timedelta(seconds=60))
    start = time.monotonic()
    try:
        outbox.put((rank, fn(rank, directory, *args)))
    except BaseException as exc:  # reported, not raised: the parent compares outcomes
        outbox.put((rank, ("raised", type(exc).__name__, f"{exc}\n{traceback.format_exc()}", time.monotonic() - start)))
    outbox.close()
    outbox.join_thread()  # the result is sent before the process ends
    os._exit(0)  # no teardown: peers may be dead or stopped


def run_world(
    world_size: int,
    directory: str,
    fn: Callable[..., Any],
    *args: Any,
    expect: int | None = None,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
) -> dict[int, Any]:
    """Run ``fn(rank, directory, *args)`` on ``world_size`` fresh gloo ranks; ``{rank: result}``.

    Collects results until ``expect`` ranks (default: all) reported or ``timeout`` seconds
    passed, then kills every process still alive.
    """
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    full_env = {"OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, directory, fn, args, outbox, full_env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    expect = world_size if expect is None else expect
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < expect:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, value = outbox.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=0.5 if p.pid is not None else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return results
