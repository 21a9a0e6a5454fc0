"""Per-rank measurement bodies: where one rank's time to usable groups goes, phase by phase.

:func:`rank_init_phases` runs on every rank of a world that some launcher made (a
:class:`~parallel_state_ng.testing.worlds.GlooWorld` on CPU, the one-GPU world on NCCL): it
takes plain arguments only and uses the current default process group. Per round it puts a
:class:`~parallel_state_ng.testing.store_traffic.CountingStore` in the default group's store
path, runs MCore's or compat's ``initialize_model_parallel``, then one all-reduce on each
distinct group of :data:`GETTERS` (the first collective: a lazy NCCL communicator connects
there), then destroys, and returns what each phase took and which store operations it made.
Used by ``scripts.bench.store_traffic`` and ``scripts.bench.phases``; docs/results/performance.md.
"""

from __future__ import annotations

import os
import time
from typing import Any

from scripts.bench.world_init import parse_layout

#: (getter, keyword arguments): the getters whose groups get their first collective.
GETTERS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("get_tensor_model_parallel_group", {}),
    ("get_pipeline_model_parallel_group", {}),
    ("get_data_parallel_group", {}),
    ("get_data_parallel_group", {"with_context_parallel": True}),
    ("get_context_parallel_group", {}),
    ("get_model_parallel_group", {}),
    ("get_tensor_and_data_parallel_group", {}),
    ("get_tensor_and_data_parallel_group", {"with_context_parallel": True}),
    ("get_tensor_and_context_parallel_group", {}),
    ("get_expert_model_parallel_group", {}),
    ("get_expert_tensor_parallel_group", {}),
    ("get_expert_tensor_and_model_parallel_group", {}),
    ("get_expert_tensor_model_pipeline_parallel_group", {}),
    ("get_expert_data_parallel_group", {}),
    ("get_embedding_group", {}),
    ("get_position_embedding_group", {}),
)
IMPLS = ("mcore", "compat")


class _Clock:
    """Wraps a function; sums its seconds and counts its calls."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        self.calls += 1
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def _device() -> Any:
    import torch
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _first_use(mod: Any) -> tuple[float, int, list[str]]:
    """One all-reduce on each distinct multi-rank group of :data:`GETTERS`: (seconds, groups, bad sums)."""
    import torch
    import torch.distributed as dist

    device, seen, bad = _device(), set(), []
    start = time.perf_counter()
    for name, kwargs in GETTERS:
        getter = getattr(mod, name, None)
        try:
            group = getter(**kwargs) if getter is not None else None
        except (AssertionError, RuntimeError):  # not a member (MCore's embedding getters assert)
            group = None
        if not isinstance(group, dist.ProcessGroup) or id(group) in seen or group.size() < 2:
            continue
        seen.add(id(group))
        value = torch.tensor([float(dist.get_rank())], device=device)
        dist.all_reduce(value, group=group)
        if value.item() != float(sum(dist.get_process_group_ranks(group))):
            bad.append(name)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, len(seen), bad


def _install_clocks(path: str) -> tuple[dict[str, _Clock], Any]:
    """Clocks on the phases; returns them and a function that takes them off."""
    import torch.distributed as dist

    from parallel_state_ng.groups import creation, liveness, pipeline

    saved = {
        "agree": (pipeline, "agree", pipeline.agree),
        "new_group": (dist, "new_group", dist.new_group),
        "split_group": (dist, "split_group", getattr(dist, "split_group", None)),
        "closing": (liveness.InitWatch, "finish", liveness.InitWatch.finish),
        "readiness": (creation, "_mark_ready", creation._mark_ready),
    }
    clocks = {key: _Clock(fn) for key, (_, _, fn) in saved.items() if fn is not None}
    for key, clock in clocks.items():
        owner, attr, _ = saved[key]
        setattr(owner, attr, clock)
    if "closing" in clocks:  # a method: the clock must bind like a function
        clock = clocks["closing"]
        liveness.InitWatch.finish = lambda self: clock(self)  # type: ignore[method-assign]
    if path == "split" and "nccl" not in str(dist.get_backend()):
        from parallel_state_ng.testing import split_stand_in  # NCCL's split on gloo: collective over the world

        clocks["split_group"] = _Clock(split_stand_in.gloo_split)
        dist.split_group = clocks["split_group"]

    def restore() -> None:
        for owner, attr, fn in saved.values():
            if fn is not None:
                setattr(owner, attr, fn)

    return clocks, restore


def rank_init_phases(
    impl: str, layout: str, store: str = "launcher", path: str = "member", rounds: int = 1, gloo: bool = True
) -> list[dict[str, Any]]:
    """This rank's phases of ``rounds`` inits of ``impl`` (``mcore`` or ``compat``) at ``layout``.

    ``store``: what the counted default store forwards to (``launcher``, ``file``, ``tcp``:
    :func:`~parallel_state_ng.testing.store_traffic.counting_default_store`). ``path``: compat's
    creation path (``member`` or ``split``; on gloo the split is the stand-in of
    ``parallel_state_ng/testing/split_stand_in.py``); MCore ignores it. ``gloo``:
    ``create_gloo_process_groups``. One record per round: seconds of the init, of the agreement
    round, of the ``new_group`` / ``split_group`` calls (and their number), of the closing round
    and the readiness marks, of the first collective on every group, of destroy; the store
    traffic of the init and of the first collectives, by category.

    Raises:
        ValueError: ``impl`` or ``path`` is unknown, or ``layout`` is malformed.
    """
    import torch.distributed as dist

    from parallel_state_ng.testing.store_traffic import counting_default_store

    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if path not in ("member", "split"):
        raise ValueError(f"path must be 'member' or 'split', got {path!r}")
    kwargs = {**parse_layout(layout), "create_gloo_process_groups": gloo}
    if impl == "mcore":
        from megatron.core import parallel_state as mod
    else:
        import compat.parallel_state as mod
    records = []
    old_path = os.environ.get("PSNG_CREATION_PATH")
    os.environ["PSNG_CREATION_PATH"] = path
    world = dist.distributed_c10d._world
    try:
        for index in range(rounds):
            clocks, restore = _install_clocks(path if impl == "compat" else "member")
            try:
                with counting_default_store(store) as counter:  # type: ignore[arg-type]
                    before = set(world.pg_map)
                    dist.barrier()
                    counter.reset()
                    start = time.perf_counter()
                    mod.initialize_model_parallel(**kwargs)
                    init_s = time.perf_counter() - start
                    init_traffic = counter.reset()
                    use_s, used, bad = _first_use(mod)
                    use_traffic = counter.reset()
                    made = [pg for pg in world.pg_map if pg not in before]
                    groups, shared = len(made), len([pg for pg in made if pg.size() > 1])
                    start = time.perf_counter()
                    mod.destroy_model_parallel()
                    destroy_s = time.perf_counter() - start
                    for pg in [pg for pg in world.pg_map if pg not in before]:  # MCore leaves its groups
                        dist.destroy_process_group(pg)
            finally:
                restore()
            records.append(
                {
                    "impl": impl,
                    "path": path if impl == "compat" else "-",
                    "layout": layout,
                    "store": store,
                    "world": dist.get_world_size(),
                    "rank": dist.get_rank(),
                    "round": index,
                    "backend": str(dist.get_backend()),
                    "init_s": init_s,
                    "agreement_s": clocks["agree"].seconds,
                    "new_group_s": clocks["new_group"].seconds,
                    "new_group_calls": clocks["new_group"].calls,
                    "split_s": clocks["split_group"].seconds if "split_group" in clocks else 0.0,
                    "split_calls": clocks["split_group"].calls if "split_group" in clocks else 0,
                    "closing_s": clocks["closing"].seconds,
                    "readiness_s": clocks["readiness"].seconds,
                    "first_use_s": use_s,
                    "first_use_groups": used,
                    "bad_sums": bad,
                    "groups": groups,
                    "multi_rank_groups": shared,
                    "destroy_s": destroy_s,
                    "total_s": init_s + use_s,
                    "init_traffic": init_traffic.by_category(),
                    "use_traffic": use_traffic.by_category(),
                }
            )
    finally:
        if old_path is None:
            os.environ.pop("PSNG_CREATION_PATH", None)
        else:
            os.environ["PSNG_CREATION_PATH"] = old_path
    return records
