"""Short-lived gloo worlds in which ranks die or stop on purpose (failure tests).

:class:`parallel_state_ng.testing.worlds.GlooWorld` keeps its workers for many tests and is closed as
soon as one dies; failure tests need the opposite: a fresh world per test whose ranks may
``os._exit`` or ``SIGSTOP`` themselves (:func:`run_world`). :func:`lose_rank` kills a rank and
has the others detect and agree on it; :func:`kept_after_shrink` checks the outcome of a
restart at tp 2 × dp 2.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from parallel_state_ng.testing.forking import worker_context


def _worker(rank: int, world_size: int, directory: str, fn: Callable[..., Any], args: tuple, outbox, env: dict) -> None:
    os.environ.clear()  # the parent's environment plus the test's, as a spawned process gets it
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

    The processes are forked from the fork server of :mod:`parallel_state_ng.testing.forking`, which has
    imported torch (spawned where that cannot serve the environment), and join a gloo world over
    a ``FileStore`` in ``directory`` (no ports: ``pytest -n auto`` safe). A rank that died
    reports nothing; a rank whose ``fn`` raised reports ``("raised", type name, message,
    seconds)``. Collects results until ``expect`` ranks (default: all) reported or ``timeout``
    seconds passed, then kills every process still alive (a stopped rank), so a test never
    leaves one behind.
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    ctx = worker_context(full_env)  # forked from the fork server that has imported torch
    outbox = ctx.Queue()
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


#: The restart tests' case: 4 ranks (tp 2 x dp 2), rank 3 dies; the collective timeout after
#: the loss; how long survivors wait for each other's marks (more than the timeout plus seconds
#: of load: the ranks next to the dead one raise at once, the others only at the timeout).
RESTART_CASE = (4, 3, 1.5, 6.0)


def lose_rank(rank: int, world: int, lost: int, detect_s: float, agree_s: float) -> dict[str, Any]:
    """Rank ``lost`` exits; the others detect it and agree on the dead (on every survivor).

    Every group of the engine and the default group get a collective timeout of ``detect_s``;
    after a barrier, ``lost`` exits and the survivors all-reduce over the default group (gloo
    raises at once next to the dead rank, the others time out), then agree through the store
    (:func:`parallel_state_ng.groups.liveness.agree_on_survivors`, waiting up to ``agree_s``:
    more than ``detect_s``, since a survivor that timed out marks late). ``{"detected", "detect_s", "dead"}``.
    """
    import torch
    import torch.distributed as dist

    from parallel_state_ng.groups import creation
    from parallel_state_ng.groups.liveness import agree_on_survivors

    for group in [None, *creation.live_groups()]:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=detect_s), group)
    dist.barrier()
    if rank == lost:
        os._exit(1)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        detected = False
    except RuntimeError:
        detected = True
    seconds = time.monotonic() - start
    alive = agree_on_survivors(dist.distributed_c10d._get_default_store(), rank, world, wait_s=agree_s)
    return {"detected": detected, "detect_s": seconds, "dead": sorted(set(range(world)) - set(alive))}


def kept_after_shrink(results: dict[int, Any], lost: int = 3) -> dict[int, dict[str, Any]]:
    """Check a restart of 4 ranks at tp 2 × dp 2 after ``lost`` (3) died; the kept ranks' results.

    Every survivor reported a dict with ``detected``, ``dead`` == [lost], ``abort_s`` < 3 and
    ``new_rank``; the tp groups are [0, 1] and [2, 3], so replica 0 (ranks 0, 1) goes on at
    the same ranks with its own state (``source``) and the other rank of replica 1 leaves.
    """
    assert lost in (2, 3), "a rank of replica 1, so that replica 0 survives"
    assert sorted(results) == [r for r in range(4) if r != lost], results
    for rank, r in results.items():
        assert isinstance(r, dict), (rank, r)
        assert r["detected"] and r["dead"] == [lost] and r["abort_s"] < 3.0, r
    kept = {rank: r for rank, r in results.items() if r["new_rank"] is not None}
    other = 5 - lost  # the other rank of replica 1
    assert sorted(kept) == [0, 1] and results[other]["new_rank"] is None, results
    for rank, r in kept.items():
        assert r["new_rank"] == rank and r["source"] == rank, r  # its own state, nothing to move
    return kept
