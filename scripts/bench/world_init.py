"""Job init time on real gloo worlds: Megatron-Core vs ``compat`` (with and without sharing) vs the floor.

W spawned gloo processes run ``mcore``, ``compat``, ``compat_share``, ``compat_unwatched`` and
``floor`` in a rotating order each round; the job's time is the slowest rank's init plus one
all-reduce on the tensor- and data-parallel groups, with CPU, communicators and compat's split.
A benchmark, not a test: it prints figures and asserts nothing about time. What each side and
column means, and the figures: docs/results/performance.md (real gloo worlds); options: ``--help``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import time
from typing import Any

IMPLS = ("mcore", "compat", "compat_share", "compat_unwatched", "floor")
ARG_OF = {
    "tp": "tensor_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "cp": "context_parallel_size",
    "ep": "expert_model_parallel_size",
    "etp": "expert_tensor_parallel_size",
}
DEFAULT_LAYOUTS = {8: "tp2-pp2", 16: "tp2-pp2-cp2", 32: "tp2-pp2-cp2-ep2"}


def parse_layout(text: str) -> dict[str, int]:
    """``"tp2-pp2-cp2"`` -> initialize_model_parallel keyword arguments."""
    kwargs: dict[str, int] = {}
    for part in text.split("-"):
        name = part.rstrip("0123456789")
        if name not in ARG_OF or name == part:
            raise ValueError(f"bad layout part {part!r} in {text!r} (use e.g. tp2-pp2-cp2-ep2)")
        kwargs[ARG_OF[name]] = int(part[len(name) :])
    return kwargs


# --------------------------------------------------------------------------- worker side
class _Clock:
    """Wraps a function and sums the time spent in it."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.total = fn, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - t


#: Groups the floor made per rank-list digest in this process (names are never reused).
_FLOOR_NAMES: dict[str, int] = {}


def _floor_steps(kwargs: dict[str, Any]) -> list[Any]:
    """This rank's groups as compat's plan lists them, in creation order (computed untimed)."""
    import torch.distributed as dist

    from compat._release import RELEASE
    from parallel_state_ng.layout.megatron_layout import MegatronLayout
    from parallel_state_ng.layout.plan import CreateGroup, PlanOptions, group_plan

    sizes = {k: v for k, v in kwargs.items() if k != "create_gloo_process_groups"}
    layout = MegatronLayout(world_size=dist.get_world_size(), release=RELEASE.series, **sizes)
    options = PlanOptions(create_gloo_process_groups=kwargs.get("create_gloo_process_groups", True))
    return [s for s in group_plan(layout, dist.get_rank(), options) if isinstance(s, CreateGroup)]


def _floor_init(steps: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """Create ``steps``' groups member-only under stable names; returns them and the groups by key.

    Each group is ``torch.distributed.new_group(ranks, use_local_synchronization=True)`` with
    compat's backend and timeout, under a name all members agree on (rank-list digest and a
    per-list count, as compat names its groups).
    """
    from datetime import timedelta

    import torch.distributed as dist

    from parallel_state_ng.groups.creation import member_set_digest

    c10d: Any = dist.distributed_c10d
    original = c10d._process_group_name
    made, by_key = [], {}
    init_timeout = timedelta(minutes=30)  # compat's default distributed_timeout_minutes
    try:
        for step in steps:
            digest = member_set_digest(step.ranks)
            count = _FLOOR_NAMES.get(digest, 0)
            _FLOOR_NAMES[digest] = count + 1
            name = f"floor-{digest}-{count}"
            c10d._process_group_name = lambda _ranks, use_hashed_name=False, name=name: name
            group = dist.new_group(
                step.ranks,
                timeout=init_timeout if step.timeout == "init" else None,
                backend=step.backend,
                use_local_synchronization=True,
            )
            made.append(group)
            by_key.setdefault(step.key, group)
    finally:
        c10d._process_group_name = original
    return made, by_key


def _one(impl: str, mods: dict[str, Any], kwargs: dict[str, Any], clocks: dict[str, _Clock]) -> dict[str, Any]:
    import torch.distributed as dist

    if impl == "floor":
        return _one_floor(kwargs, clocks)

    try:
        from parallel_state_ng.groups import sharing
    except ImportError:  # an older checkout (for "before" figures): no sharing there
        sharing = None
        assert impl != "compat_share", "this checkout has no parallel_state_ng.groups.sharing"

    world = dist.distributed_c10d._world
    mod = mods["mcore" if impl == "mcore" else "compat"]
    if sharing is not None:
        sharing.set_group_sharing(impl == "compat_share")
    if impl == "compat_unwatched":
        os.environ["PSNG_FAILURE_TIMEOUT"] = "0"
    before = set(world.pg_map)
    dist.barrier()
    for c in clocks.values():
        c.total = 0.0
    cpu0, t0 = time.process_time(), time.perf_counter()
    mod.initialize_model_parallel(**kwargs)
    t_init = time.perf_counter() - t0
    sums = _all_reduce_ranks([mod.get_tensor_model_parallel_group(), mod.get_data_parallel_group()])
    t_total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    split = {name: c.total for name, c in clocks.items()}
    created = [pg for pg in world.pg_map if pg not in before]
    lists = getattr(mod, "_global_process_group_list", None) or []
    t1 = time.perf_counter()
    mod.destroy_model_parallel()
    t_destroy = time.perf_counter() - t1
    if impl == "mcore":  # MCore leaves its non-gloo groups alive; destroyed so rounds do not accumulate sockets
        for pg in lists:
            if pg is not None and pg in world.pg_map:
                dist.destroy_process_group(pg)
    if sharing is not None:
        sharing.set_group_sharing(None)
    os.environ.pop("PSNG_FAILURE_TIMEOUT", None)
    assert all(a == b for a, b in sums), sums
    assert not [pg for pg in world.pg_map if pg not in before], "groups left after destroy"
    return {"total": t_total, "init": t_init, "destroy": t_destroy, "communicators": len(created), "cpu": cpu, **split}


def _all_reduce_ranks(groups: list[Any]) -> list[tuple[float, float]]:
    """All-reduce each rank's number over each group: (the sum, the sum it must be) per group."""
    import torch
    import torch.distributed as dist

    sums = []
    for group in groups:
        x = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(x, group=group)
        sums.append((x.item(), float(sum(dist.get_process_group_ranks(group)))))
    return sums


def _one_floor(kwargs: dict[str, Any], clocks: dict[str, _Clock]) -> dict[str, Any]:
    """The floor's round: the same clock, all-reduces and record as :func:`_one`'s.

    Bare torch creating exactly compat's communicators and nothing else: no agreement check,
    readiness marks, layout math, state or getters.
    """
    import torch.distributed as dist

    world = dist.distributed_c10d._world
    steps = _floor_steps(kwargs)
    before = set(world.pg_map)
    dist.barrier()
    for c in clocks.values():
        c.total = 0.0
    cpu0, t0 = time.process_time(), time.perf_counter()
    made, by_key = _floor_init(steps)
    t_init = time.perf_counter() - t0
    sums = _all_reduce_ranks([by_key["tp"], by_key["dp"]])
    t_total, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    split = {name: c.total for name, c in clocks.items()}
    created = [pg for pg in world.pg_map if pg not in before]
    t1 = time.perf_counter()
    for group in made:
        dist.destroy_process_group(group)
    t_destroy = time.perf_counter() - t1
    assert all(a == b for a, b in sums), sums
    assert len(created) == len(steps), (len(created), len(steps))
    return {"total": t_total, "init": t_init, "destroy": t_destroy, "communicators": len(created), "cpu": cpu, **split}


def _worker(rank: int, world_size: int, inbox: Any, outbox: Any, impls: list[str], plan: list[dict]) -> None:
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        import warnings

        warnings.filterwarnings("ignore")  # megatron's "Transformer Engine and Apex are not installed"
        import torch.distributed as dist

        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
            outbox.put(("port", store.port))
        else:
            port = inbox.get()
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
        mods: dict[str, Any] = {}
        if "mcore" in impls:
            from megatron.core import parallel_state as mcore_ps

            mods["mcore"] = mcore_ps
        import compat.parallel_state as compat_ps
        from parallel_state_ng.groups import creation, pipeline

        mods["compat"] = compat_ps
        # every build calls the agreement check through the pipeline module's binding
        clocks = {"check": _Clock(pipeline.agree), "create": _Clock(dist.new_group)}
        pipeline.agree = clocks["check"]
        dist.new_group = clocks["create"]
        sync = [_Clock(dist.barrier)]
        dist.barrier = sync[0]
        if hasattr(creation, "_mark_ready"):
            sync.append(_Clock(creation._mark_ready))
            creation._mark_ready = sync[1]

        class _Sum:
            @property
            def total(self) -> float:
                return sum(c.total for c in sync)

            @total.setter
            def total(self, value: float) -> None:
                for c in sync:
                    c.total = value

        clocks["sync"] = _Sum()  # type: ignore[assignment]
        dist.barrier()
        records = []
        for step in plan:
            rec = _one(step["impl"], mods, step["kwargs"], clocks)
            rec.update(step)
            records.append(rec)
        dist.barrier()
        outbox.put(("done", rank, records))
        dist.destroy_process_group()
    except BaseException as exc:  # report, the parent stops the job
        import traceback

        outbox.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_world(world_size: int, impls: list[str], plan: list[dict], timeout: float) -> list[list[dict]]:
    """Run ``plan`` on ``world_size`` fresh processes; per rank, its list of records."""
    ctx = mp.get_context("spawn")
    outbox = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(world_size)]
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, inboxes[r], outbox, impls, plan), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, list[dict]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            try:
                msg = outbox.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(
                    f"world {world_size}: ranks {sorted(set(range(world_size)) - set(results))} timed out"
                ) from None
            if msg[0] == "port":
                for q in inboxes[1:]:
                    q.put(msg[1])
            elif msg[0] == "error":
                raise RuntimeError(f"rank {msg[1]} failed:\n{msg[2]}")
            else:
                results[msg[1]] = msg[2]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


# --------------------------------------------------------------------------- parent side
def make_plan(layout: str, gloo_modes: list[bool], impls: list[str], rounds: int) -> list[dict]:
    """Rounds of every (gloo mode, implementation), the implementation order rotating."""
    plan = []
    kwargs = parse_layout(layout)
    for r in range(rounds):
        for gloo in gloo_modes:
            order = impls[r % len(impls) :] + impls[: r % len(impls)]
            for impl in order:
                plan.append(
                    {
                        "impl": impl,
                        "layout": layout,
                        "gloo": gloo,
                        "round": r,
                        "kwargs": {**kwargs, "create_gloo_process_groups": gloo},
                    }
                )
    return plan


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """One row per (layout, gloo, impl): job time stats, communicators, compat's split."""
    rows: dict[tuple, dict] = {}
    for step in range(len(per_rank[0])):
        recs = [per_rank[r][step] for r in range(len(per_rank))]
        slowest = max(recs, key=lambda x: x["total"])
        key = (recs[0]["layout"], recs[0]["gloo"], recs[0]["impl"])
        row = rows.setdefault(
            key,
            {
                "layout": key[0],
                "gloo": key[1],
                "impl": key[2],
                "jobs": [],
                "slowest": [],
                "communicators": [],
                "destroy": [],
                "cpus": [],
            },
        )
        row["jobs"].append(slowest["total"])
        row["cpus"].append(sum(x.get("cpu", 0.0) for x in recs))
        row["slowest"].append(slowest)
        row["communicators"].append(statistics.median(x["communicators"] for x in recs))
        row["destroy"].append(max(x["destroy"] for x in recs))
    out = []
    for row in rows.values():
        s = row.pop("slowest")
        row.update(
            median=statistics.median(row["jobs"]),
            min=min(row["jobs"]),
            max=max(row["jobs"]),
            communicators=statistics.median(row["communicators"]),
            cpu=statistics.median(row["cpus"]),
            destroy=statistics.median(row["destroy"]),
            check=statistics.median(x["check"] for x in s),
            create=statistics.median(x["create"] for x in s),
            sync=statistics.median(x["sync"] for x in s),
        )
        row["rest"] = max(0.0, row["median"] - row["check"] - row["create"] - row["sync"])
        out.append(row)
    return out


def _ratios(row: dict, rows: list[dict], impl: str, series: str = "jobs") -> tuple[float | None, float | None]:
    """``row``'s median of ``series`` over ``impl``'s (same gloo mode), and the median of the per-round ratios.

    ``series``: ``"jobs"`` (job times) or ``"cpus"`` (CPU seconds of all ranks together).
    """
    ref = next((x for x in rows if x["impl"] == impl and x["gloo"] == row["gloo"]), None)
    if ref is None:
        return None, None
    paired = statistics.median(a / b for a, b in zip(row[series], ref[series], strict=False))
    return statistics.median(row[series]) / statistics.median(ref[series]), paired


def _ratio_text(pair: tuple[float | None, float | None]) -> str:
    return f"{pair[0]:7.2f}x {pair[1]:5.2f}x" if pair[0] is not None else f"{'—':>8} {'—':>6}"


def _report(w: int, per_rank: list[list[dict]]) -> list[dict]:
    """Print the table rows of one world; return them."""
    rows = summarize(per_rank)
    for row in rows:
        row["world"], row["rounds"] = w, len(row["jobs"])
        row["vs_mcore"], row["paired"] = _ratios(row, rows, "mcore")
        row["vs_floor"], row["paired_floor"] = _ratios(row, rows, "floor")
        row["cpu_vs_floor"], row["cpu_paired_floor"] = _ratios(row, rows, "floor", "cpus")
        split = (
            f"{row['check']:6.3f} {row['create']:6.3f} {row['sync']:6.3f} {row['rest']:6.3f}"
            if row["impl"] != "mcore"
            else f"{'':6} {row['create']:6.3f} {row['sync']:6.3f} {'':6}"
        )
        vs_mcore, vs_floor = (row["vs_mcore"], row["paired"]), (row["vs_floor"], row["paired_floor"])
        ratios = f"{_ratio_text(vs_mcore)} {_ratio_text(vs_floor)}"
        print(
            f"{w:>3} {row['layout']:<16} {'on' if row['gloo'] else 'off':<4} {row['impl']:<13} {row['median']:7.3f} "
            f"{row['min']:7.3f} {row['max']:7.3f} {row['communicators']:5.0f} {ratios} | {split} | "
            f"{row['destroy']:7.3f} | {row['cpu']:6.3f} {_ratio_text((row['cpu_vs_floor'], row['cpu_paired_floor']))}"
        )
    sys.stdout.flush()
    return rows


def _load() -> str:
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the benchmark and print its table; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="8,16,32", help="comma-separated numbers of processes")
    p.add_argument("--layouts", default="", help="W:layout,... (default 8:tp2-pp2, 16:tp2-pp2-cp2, 32:tp2-pp2-cp2-ep2)")
    p.add_argument("--rounds", default="9,7,4", help="rounds per world (one value, or one per world)")
    p.add_argument("--gloo", choices=("on", "off", "both"), default="both", help="create_gloo_process_groups")
    p.add_argument(
        "--impls",
        default=",".join(IMPLS),
        help="subset of "
        + ",".join(IMPLS)
        + " (compat_share: group sharing on; compat_unwatched: PSNG_FAILURE_TIMEOUT=0)",
    )
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per world")
    p.add_argument("--json", help="write every record and the summary to this file")
    p.add_argument("--from-json", help="print the table of a file written by --json (no run)")
    a = p.parse_args(argv)
    worlds = [int(w) for w in a.worlds.split(",")]
    rounds = [int(x) for x in a.rounds.split(",")]
    rounds = rounds + [rounds[-1]] * (len(worlds) - len(rounds))
    layouts = dict(DEFAULT_LAYOUTS)
    for item in filter(None, a.layouts.split(",")):
        w, lay = item.split(":")
        layouts[int(w)] = lay
    impls = [i for i in a.impls.split(",") if i]
    gloo_modes = {"on": [True], "off": [False], "both": [True, False]}[a.gloo]
    started, load_before = time.time(), _load()
    print(
        f"job init time on real gloo worlds; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, python {platform.python_version()}; load before {load_before}"
    )
    print(
        "job = slowest rank's initialize_model_parallel + one all-reduce on tp and dp; seconds; "
        "split = compat's slowest rank: agreement check / group creation / synchronization / rest"
    )
    header = (
        f"{'W':>3} {'layout':<16} {'gloo':<4} {'impl':<13} {'median':>7} {'min':>7} {'max':>7} "
        f"{'comms':>5} {'vs mcore':>8} {'paired':>6} {'vs floor':>8} {'paired':>6} | "
        f"{'check':>6} {'create':>6} {'sync':>6} {'rest':>6} | {'destroy':>7} | "
        f"{'cpu':>6} {'vs floor':>8} {'paired':>6}"
    )
    print(header)
    print("-" * len(header))
    all_rows, raw = [], {}
    if a.from_json:
        with open(a.from_json) as f:
            saved = json.load(f)
        for w, per_rank in saved["records"].items():
            all_rows += _report(int(w), per_rank)
        print(
            f"(re-rendered from {a.from_json}; load before the run {saved['load_before']}, after {saved['load_after']})"
        )
        return 0
    for w, n in zip(worlds, rounds, strict=False):
        layout = layouts.get(w, "tp2-pp2")
        per_rank = run_world(w, impls, make_plan(layout, gloo_modes, impls, n), a.timeout)
        raw[w] = per_rank
        all_rows += _report(w, per_rank)
    print(
        f"vs mcore / vs floor = the median job time over MCore's / the floor's; paired = median over rounds of the "
        f"same ratio within a round (same processes, minutes apart at most); comms = communicators per rank; "
        f"cpu = CPU seconds of all ranks together (every thread: user + system), median over rounds; "
        f"load after {_load()}; "
        f"took {time.time() - started:.0f} s"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"rows": all_rows, "records": raw, "load_before": load_before, "load_after": _load()}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "world_init")
