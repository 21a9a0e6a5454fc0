"""The pytest plugin each rank of :mod:`scripts.matrix.megatron_unit_tests` loads (``-p``).

It runs inside a rank started by torchrun, before the user's test module is collected, and
changes nothing in the user's files. At configure time: the CPU stand-ins for Megatron's CUDA
assumptions (:class:`parallel_state_ng.testing.megatron_cpu.CpuShims`), plus what a unit-test
harness written for one GPU per rank needs on gloo: ``torch.cuda.set_device`` does nothing,
``torch.cuda.device_count()`` is the world size, and ``init_process_group`` / ``new_group`` asked
for NCCL get gloo, every group with its timeout capped at ``--collective-timeout`` (Megatron asks
for 30 minutes), so that a rank left alone in a collective or a group's creation fails instead of
hanging. Then, when ``PSNG_MUT_IMPL=compat``, ``compat.install()``; then
``megatron.core.parallel_state`` is imported, so that the release is fixed before collection.

Between tests the ranks meet (a bounded barrier on the launcher's TCPStore, longer than the
groups' timeout) and every process group the test left behind is destroyed, after
``destroy_model_parallel()`` when the test left ``parallel_state`` initialized. Megatron's tests
assume every rank runs every line of every test: without the meeting, a test that fails on some
ranks before a collective leaves the others waiting in it, and every later test fails out of step.
Without the clean-up, MCore's ``destroy_model_parallel`` leaves its (here gloo) groups alive,
each with its own threads, and a run of the whole file slows to a stall. The number of groups
destroyed this way is recorded per test (``left_groups``); a barrier that ran out is recorded as
``unsynced``. After a test that did not pass (or skip) on every rank, WORLD is renewed too: a
rank whose WORLD collective timed out no longer counts WORLD's collectives as the others do.

It records every test's outcome (passed, failed, skipped, error, xfailed, xpassed, with a one-line
reason) and writes them, with the release and the module that served ``parallel_state``, to
``$PSNG_MUT_OUT/rank<RANK>.json`` as it goes (with the test it is in, for a run stopped by its
timeout). The rank's exit status is 0 whatever the outcomes: the JSON carries them, and a launcher
like torchrun would otherwise stop every rank when one rank's tests fail.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

#: The environment the parent sets for every rank.
ENV_IMPL = "PSNG_MUT_IMPL"
ENV_OUT = "PSNG_MUT_OUT"
ENV_TIMEOUT = "PSNG_MUT_COLLECTIVE_TIMEOUT"

#: Seconds a between-tests barrier waits beyond the groups' timeout.
SYNC_MARGIN_S = 60.0

_results: dict[str, dict[str, Any]] = {}
_info: dict[str, Any] = {}
_sync: dict[str, Any] = {"store": None, "index": 0, "worlds": 0}


def _gloo(backend: Any) -> Any:
    """``backend`` with NCCL replaced by gloo (``"nccl"``, ``"cpu:gloo,cuda:nccl"``, ``None``)."""
    if backend is None or "nccl" in str(backend).lower():
        return "gloo"
    return backend


def _install_cpu_stand_ins(world_size: int, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    from parallel_state_ng.testing.megatron_cpu import CpuShims

    CpuShims().__enter__()  # for the life of this rank's process
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.device_count = lambda: world_size
    init, new_group = dist.init_process_group, dist.new_group
    timeout = datetime.timedelta(seconds=timeout_s)

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (_gloo(args[0]), *args[1:])
        else:
            kwargs["backend"] = _gloo(kwargs.get("backend"))
        kwargs.setdefault("timeout", timeout)
        return init(*args, **kwargs)

    def new_group_on_gloo(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 2:
            args = (*args[:2], _gloo(args[2]) if args[2] is not None else None, *args[3:])
        elif kwargs.get("backend") is not None:
            kwargs["backend"] = _gloo(kwargs["backend"])
        if len(args) > 1:
            args = (args[0], min(args[1] or timeout, timeout), *args[2:])
        else:
            kwargs["timeout"] = min(kwargs.get("timeout") or timeout, timeout)
        return new_group(*args, **kwargs)

    dist.init_process_group = init_process_group
    dist.new_group = new_group_on_gloo


def pytest_configure(config: pytest.Config) -> None:
    """Stand-ins, compat when asked for, then ``megatron.core.parallel_state`` imported."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    _install_cpu_stand_ins(world_size, float(os.environ.get(ENV_TIMEOUT, "120")))
    impl = os.environ.get(ENV_IMPL, "mcore")
    if impl == "compat":
        import compat

        compat.install()
    import megatron.core
    import megatron.core.parallel_state as ps

    _info.update(
        impl=impl,
        share=os.environ.get("PSNG_SHARE_GROUPS", ""),
        megatron_version=str(getattr(megatron.core, "__version__", "?")),
        megatron_file=str(getattr(megatron.core, "__file__", "?")),
        parallel_state=ps.__name__,
        rank=int(os.environ.get("RANK", "0")),
        world_size=world_size,
    )


def _sync_store() -> Any:
    """A client of the launcher's TCPStore (``MASTER_ADDR``/``MASTER_PORT``)."""
    if _sync["store"] is None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=_sync_timeout_s())
        _sync["store"] = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False, timeout, wait_for_workers=False
        )
    return _sync["store"]


def _sync_timeout_s() -> float:
    return float(os.environ.get(ENV_TIMEOUT, "120")) + SYNC_MARGIN_S


def meet_after(nodeid: str, clean: bool) -> tuple[bool, bool]:
    """Wait (bounded) until every rank has finished this test; return (all met, all clean).

    ``clean``: this rank's test passed or was skipped. A rank that never arrives makes the
    barrier run out: the result is then (False, False).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 or "MASTER_PORT" not in os.environ:
        return True, clean
    import torch.distributed as dist

    index = _sync["index"]
    _sync["index"] += 1
    store = dist.PrefixStore(f"psng-mut-sync/{index}", _sync_store())
    store.add("unclean", 0 if clean else 1)
    if store.add("arrived", 1) == world_size:
        store.set("all", nodeid)
    try:
        store.wait(["all"], datetime.timedelta(seconds=_sync_timeout_s()))
    except Exception:  # noqa: BLE001 - a rank that never arrives: go on (the caller records it)
        return False, False
    return True, store.add("unclean", 0) == 0


def destroy_left_groups() -> int:
    """``destroy_model_parallel()`` if still initialized, then destroy every group but WORLD.

    Returns how many process groups were still alive after ``destroy_model_parallel``.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    default = dist.distributed_c10d._get_default_group()
    left = [pg for pg in list(dist.distributed_c10d._world.pg_map) if pg is not default]
    for pg in left:
        dist.destroy_process_group(pg)
    return len(left)


def renew_world() -> None:
    """Replace WORLD by a fresh group of the same ranks, on every rank at once.

    After a test that did not pass everywhere, WORLD's ranks may disagree on how many
    collectives they ran (one timed out waiting for a rank that had failed before joining it),
    and on gloo every later collective on WORLD would then wait in vain.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    _sync["worlds"] += 1
    store = dist.PrefixStore(f"psng-mut-world/{_sync['worlds']}", _sync_store())
    timeout = datetime.timedelta(seconds=float(os.environ.get(ENV_TIMEOUT, "120")))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """After the test's own teardown: meet the other ranks, then destroy the groups it left.

    When the test did not pass (or skip) on every rank, WORLD is renewed as well.
    """
    yield
    result = _results.get(item.nodeid)
    clean = result is not None and result["outcome"] in ("passed", "skipped")
    try:
        synced, all_clean = meet_after(item.nodeid, clean)
        left = destroy_left_groups()
        if synced and not all_clean:
            renew_world()
    except Exception as exc:  # noqa: BLE001 - the harness must not turn into a test outcome
        _results.setdefault(item.nodeid, {"outcome": "error", "reason": ""})["harness"] = repr(exc)[:300]
        return
    if result is not None:
        result["left_groups"] = left
        if not synced:
            result["unsynced"] = True


def _reason(report: Any) -> str:
    text = str(getattr(report, "longreprtext", "") or "")
    if report.skipped and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    return (errors[-1] if errors else lines[-1] if lines else "")[:300]


def _outcome(report: Any) -> str | None:
    """This phase's outcome, or None for a setup/teardown that passed."""
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if xfail:
            return "xfailed" if report.skipped else "xpassed"
        return str(report.outcome)
    if report.failed:
        return "error"
    if report.skipped:
        return "xfailed" if xfail else "skipped"
    return None


def _write(running: str = "", exitstatus: int | None = None) -> None:
    """This rank's outcomes so far (and the test it is in) to ``$PSNG_MUT_OUT/rank<RANK>.json``."""
    out = os.environ.get(ENV_OUT)
    if out:
        rank = _info.get("rank", int(os.environ.get("RANK", "0")))
        data = dict(_info, running=running, exitstatus=exitstatus, results=_results)
        path = Path(out, f"rank{rank}.json")
        path.with_suffix(".tmp").write_text(json.dumps(data, indent=1, sort_keys=True))
        path.with_suffix(".tmp").replace(path)


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    """Say which test this rank is in (what a run killed by its timeout reports)."""
    _write(running=nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Keep each test's outcome: the call's, unless setup or teardown went wrong."""
    outcome = _outcome(report)
    if outcome is None:
        return
    known = _results.get(report.nodeid)
    if known is None:
        _results[report.nodeid] = {"outcome": outcome, "reason": _reason(report)}
    elif outcome == "error" and known["outcome"] != "error":
        known.update(outcome=outcome, reason=_reason(report))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module that cannot be collected counts as one error."""
    if report.failed:
        _results[f"{report.nodeid}::<collection>"] = {"outcome": "error", "reason": _reason(report)}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write this rank's outcomes; exit 0 (a launcher may stop every rank when one fails)."""
    _write(exitstatus=int(exitstatus))
    session.exitstatus = 0
