"""Python calls one rank makes in ``initialize_model_parallel``, by part, against the floor.

Timings of a CPU-bound gloo world are too noisy to see a change of a few percent; call counts are
exact. On a real gloo world this counts, on one rank, every Python and C call of one compat init
and of the floor's creation of the same communicators, charged to the part of the init it happens
in; then ``--cpu-rounds`` rounds time the main thread's CPU in the large parts on every rank.
A measurement, not a test. Parts and figures: docs/results/performance.md (against the floor); options: ``--help``.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import sys
from typing import Any

from scripts.bench import world_init as bench  # the floor and the layouts of the benchmark

#: (function name, file name) -> the part a call inside it is charged to (innermost wins).
PARTS: dict[tuple[str, str], str] = {
    ("initialize_model_parallel", "_init.py"): "initialize_model_parallel (its own code)",
    ("agree", "pipeline.py"): "agreement check",
    ("validate_initialize_args", "validate.py"): "argument validation",
    ("__init__", "named_layout.py"): "layout",
    ("__init__", "megatron_layout.py"): "layout",
    ("__post_init__", "megatron_layout.py"): "layout",
    ("group_plan", "plan.py"): "group plan",
    ("create_model_groups", "megatron_groups.py"): "create_model_groups (its own code)",
    ("__init__", "liveness.py"): "closing round",
    ("finish", "liveness.py"): "closing round",
    ("_execute", "megatron_groups.py"): "per group: plan step and pool",
    ("new_member_group", "creation.py"): "per group: naming and tracking",
    ("guarded_create", "liveness.py"): "per group: bounded creation",
    ("new_group", "distributed_c10d.py"): "torch new_group",
    ("set_active", "_scoping.py"): "publishing the globals",
    ("set_global_memory_buffer", "_expert.py"): "memory buffer",
    ("_floor_init", "world_init.py"): "floor loop",
}


def _counter() -> tuple[Any, collections.Counter]:
    """A ``sys.setprofile`` hook and the counter it fills."""
    stack: list[tuple[str, Any]] = []
    counts: collections.Counter = collections.Counter()

    def hook(frame: Any, event: str, _arg: Any) -> None:
        if event == "call":
            part = PARTS.get((frame.f_code.co_name, os.path.basename(frame.f_code.co_filename)))
            if part is not None and (not stack or stack[-1][0] != part):
                stack.append((part, frame))
            counts[stack[-1][0] if stack else "other"] += 1
        elif event == "c_call":
            counts[stack[-1][0] if stack else "other"] += 1
        elif event == "return" and stack and stack[-1][1] is frame:
            stack.pop()

    return hook, counts


#: (module, attribute, part) timed by ``--cpu-rounds``: a few large parts, so that the timer's own
#: cost (two clock reads per call) stays small against them.
TIMED = (
    ("parallel_state_ng.groups.pipeline", "agree", "agreement check"),
    ("compat._init", "MegatronLayout", "layout"),
    ("parallel_state_ng.groups.megatron_groups", "group_plan", "group plan"),
    ("parallel_state_ng.groups.liveness.InitWatch", "finish", "closing round"),
    ("compat._scoping", "set_active", "publishing the globals"),
    ("torch.distributed.distributed_c10d", "_set_pg_timeout", "per group: timeout restore"),
    ("torch.distributed", "new_group", "torch new_group"),
)


def _install_timers(spent: dict[str, float]) -> None:
    """Wrap the :data:`TIMED` functions so that their thread CPU adds up in ``spent``."""
    import importlib
    import time

    for where, attr, part in TIMED:
        module_name, _, cls = where.partition(".InitWatch")
        owner: Any = importlib.import_module(module_name)
        if cls or where.endswith("InitWatch"):
            owner = owner.InitWatch
        fn = getattr(owner, attr)

        def timed(*args: Any, _fn: Any = fn, _part: str = part, **kw: Any) -> Any:
            start = time.thread_time()
            try:
                return _fn(*args, **kw)
            finally:
                spent[_part] = spent.get(_part, 0.0) + time.thread_time() - start

        setattr(owner, attr, timed)


def _init_once(impl: str, kwargs: dict, ps: Any, on_start: Any) -> float:
    """One init of ``impl`` between two world barriers, then its destroy; its thread CPU (s).

    ``on_start()`` runs right before the init and profiling is switched off right after it.
    """
    import time

    import torch.distributed as dist

    steps = bench._floor_steps(kwargs)
    dist.barrier()
    start = time.thread_time()
    on_start()
    if impl == "floor":
        made, by_key = bench._floor_init(steps)
    else:
        ps.initialize_model_parallel(**kwargs)
    sys.setprofile(None)
    took = time.thread_time() - start
    dist.barrier()
    if impl == "floor":
        for group in made:
            dist.destroy_process_group(group)
        del made, by_key  # freed here, not inside the next round's clock
    else:
        ps.destroy_model_parallel()
    return took


def _worker(rank: int, world: int, port_box: Any, out: Any, kwargs: dict, counted_rank: int, cpu_rounds: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        for _ in range(world - 1):
            port_box.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", port_box.get(), world, is_master=False)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    import compat.parallel_state as ps

    result = {}
    for round_ in range(2):  # the first round warms up (imports, caches); the second is counted
        for impl in ("compat", "floor"):
            hook, counts = _counter()
            if rank == counted_rank and round_ == 1:
                _init_once(impl, kwargs, ps, lambda hook=hook: sys.setprofile(hook))
            else:
                _init_once(impl, kwargs, ps, lambda: None)
            result[impl] = dict(counts)

    spent: dict[str, float] = {}
    _install_timers(spent)
    cpu: dict[str, list[dict[str, float]]] = {"compat": [], "floor": []}
    for round_ in range(cpu_rounds):
        for impl in ("compat", "floor") if round_ % 2 == 0 else ("floor", "compat"):
            spent.clear()
            took = _init_once(impl, kwargs, ps, spent.clear)
            cpu[impl].append({**spent, "total": took})
    dist.barrier()
    out.put((rank, result if rank == counted_rank else None, cpu))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, count on one rank of a real gloo world and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=16, help="number of processes (8, 16 or 32 have default layouts)")
    p.add_argument("--layout", help="e.g. tp2-pp2-cp2 (default: the benchmark's layout for --world)")
    p.add_argument("--gloo", choices=("on", "off"), default="off", help="create_gloo_process_groups")
    p.add_argument("--rank", type=int, default=3, help="the rank whose calls are counted")
    p.add_argument("--cpu-rounds", type=int, default=12, help="rounds that time the main parts' thread CPU (0: none)")
    a = p.parse_args(argv)
    layout = a.layout or bench.DEFAULT_LAYOUTS.get(a.world, "tp2-pp2")
    kwargs = {**bench.parse_layout(layout), "create_gloo_process_groups": a.gloo == "on"}
    ctx = mp.get_context("spawn")
    port_box, out = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, a.world, port_box, out, kwargs, a.rank, a.cpu_rounds), daemon=True)
        for r in range(a.world)
    ]
    for proc in procs:
        proc.start()
    replies = [out.get(timeout=900) for _ in range(a.world)]
    for proc in procs:
        proc.join(timeout=60)
    result = next(counts for _, counts, _ in replies if counts is not None)
    print(f"Python calls on rank {a.rank} of {a.world} processes, {layout}, gloo twins {a.gloo}")
    totals = {impl: sum(counts.values()) for impl, counts in result.items()}
    for impl in ("compat", "floor"):
        print(f"{impl}: {totals[impl]} calls")
        for part, n in sorted(result[impl].items(), key=lambda item: -item[1]):
            print(f"  {part:<44} {n:6d}")
    print(f"compat / floor: {totals['compat'] / totals['floor']:.2f}x the calls")
    if a.cpu_rounds:
        _print_cpu([cpu for _, _, cpu in replies], a.cpu_rounds)
    return 0


def _print_cpu(per_rank: list[dict[str, list[dict[str, float]]]], rounds: int) -> None:
    """Per part: the median over ranks of each rank's median thread CPU over the rounds (ms)."""
    import statistics

    def typical(impl: str, part: str) -> float:
        return 1e3 * statistics.median(statistics.median(r.get(part, 0.0) for r in rank[impl]) for rank in per_rank)

    print(f"main-thread CPU per init, ms: median over {len(per_rank)} ranks of each rank's median of {rounds} rounds")
    for impl in ("compat", "floor"):
        total = typical(impl, "total")
        parts = {part: typical(impl, part) for _, _, part in TIMED}
        print(f"{impl}: {total:.3f} ms")
        for part, ms in parts.items():
            if ms:
                print(f"  {part:<44} {ms:7.3f}")
        print(f"  {'the rest (per-group glue, validation, ...)':<44} {total - sum(parts.values()):7.3f}")


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "count_init_calls")
