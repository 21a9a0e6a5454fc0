"""Sleep and wake of live groups (issue 51): gloo worlds of 2 and 4 ranks, and the fake backend.

Gloo cannot suspend, and torch cannot release a backend behind the same ``ProcessGroup``, so gloo
groups are fenced: refused while asleep, the same objects with the same backends after wake.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng.groups import agreement, creation
from parallel_state_ng.groups import sleep as sleeping
from parallel_state_ng.groups.agreement import ParallelConfigTimeoutError
from parallel_state_ng.testing.resources import RESOURCE_KEYS, grown, process_resources

SHARED_DESC = "TENSOR_MODEL_PARALLEL+CONTEXT_PARALLEL"
TIMEOUT = timedelta(seconds=77)


# --------------------------------------------------------------------------- rank functions
def _make_groups() -> list:
    """The whole world (one group serving two kinds, listed twice) and this rank's pair."""
    world = dist.get_world_size()
    shared = creation.new_member_group(list(range(world)), group_desc=SHARED_DESC, timeout=TIMEOUT)
    first = dist.get_rank() // 2 * 2
    pair = creation.new_member_group([first, first + 1], group_desc="DATA_PARALLEL", timeout=TIMEOUT)
    return [shared, pair, shared]


def _sums(groups: list) -> list[float]:
    out = []
    for group in groups:
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t, group=group)
        out.append(t.item())
    return out


def _facts(group) -> tuple:
    c10d = dist.distributed_c10d._world
    backend = group._get_backend(torch.device("cpu"))
    return (
        id(group),
        group.group_desc,
        group.group_name,
        dist.get_process_group_ranks(group),
        c10d.pg_names[group],
        group._backend_id(dist.ProcessGroup.BackendType.GLOO),  # the C++ backend's identity
        backend.options._timeout,
        backend._get_sequence_number_for_group(),
    )


def _sleep_wake_keeps_groups() -> dict:
    groups = _make_groups()
    try:
        before, facts = _sums(groups), [_facts(g) for g in groups]
        live = creation.live_groups()
        slept = sleeping.sleep(timeout=20)
        asleep = [sleeping.is_asleep(g) for g in groups]
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=groups[1])
            refused = ""
        except sleeping.GroupAsleepError as err:
            refused = str(err)
        try:
            groups[0].allreduce([torch.ones(1)]).wait()  # the group's own method: torch's path
            direct = ""
        except RuntimeError as err:
            direct = str(err)
        refused_s = time.monotonic() - started
        others = _other_calls_refused(groups[1])
        woken = sleeping.wake(timeout=20)
        return {
            "before": before,
            "after": _sums(groups),
            "facts": (facts, [_facts(g) for g in groups]),
            "same_live": all(a is b for a, b in zip(creation.live_groups(), live, strict=True)),
            "sleep": [(g.desc, g.mechanism, g.bytes_freed) for g in slept.groups],
            "wake": [(g.desc, g.mechanism) for g in woken.groups],
            "asleep": asleep,
            "awake_after": [sleeping.is_asleep(g) for g in groups],
            "refused": refused,
            "direct": direct,
            "refused_s": refused_s,
            "others": others,
            "patched_after": dist.distributed_c10d._rank_not_in_group.__module__,
        }
    finally:
        creation.destroy_groups(groups)


def _other_calls_refused(group) -> dict[str, bool]:
    """Which torch.distributed calls on the sleeping ``group`` raise GroupAsleepError."""
    peer = next(r for r in dist.get_process_group_ranks(group) if r != dist.get_rank())
    calls = {
        "barrier": lambda: dist.barrier(group=group),
        "broadcast": lambda: dist.broadcast(torch.ones(1), src=peer, group=group),
        "all_gather_object": lambda: dist.all_gather_object([None, None], 1, group=group),
        "broadcast_object_list": lambda: dist.broadcast_object_list([1], src=peer, group=group),
        "send": lambda: dist.send(torch.ones(1), dst=peer, group=group),
        "isend": lambda: dist.isend(torch.ones(1), dst=peer, group=group),
        "irecv": lambda: dist.irecv(torch.ones(1), src=peer, group=group),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.ones(1), torch.ones(2), group=group),
    }
    refused = {}
    for name, call in calls.items():
        try:
            call()
            refused[name] = False
        except sleeping.GroupAsleepError:
            refused[name] = True
    return refused


def _twice() -> dict:
    groups = _make_groups()
    try:
        first = sleeping.sleep(groups, timeout=20)
        second = sleeping.sleep(groups, timeout=20)
        woken = sleeping.wake(groups, timeout=20)
        again = sleeping.wake(groups, timeout=20)
        with sleeping.asleep(groups, kinds=["DATA_PARALLEL"], timeout=20) as report:
            inside = [sleeping.is_asleep(g) for g in groups[:2]], [g.desc for g in report.groups]
        return {
            "first": [g.mechanism for g in first.groups],
            "second": [(g.mechanism, g.reason) for g in second.groups],
            "woken": [g.mechanism for g in woken.groups],
            "again": [(g.mechanism, g.reason) for g in again.groups],
            "inside": inside,
            "after": _sums(groups),
        }
    finally:
        creation.destroy_groups(groups)


def _native_stand_in() -> dict:
    """The native path with gloo standing in for a backend that suspends (NCCL 2.29.7+)."""
    calls: list[str] = []
    counters = iter([{"gloo:bytes": 1000}, {"gloo:bytes": 100}, {"gloo:bytes": 1000}, {"gloo:bytes": 100}])
    saved = sleeping._suspend, sleeping._resume, sleeping._stats
    sleeping._suspend = lambda backend: calls.append("suspend") or True
    sleeping._resume = lambda backend: calls.append("resume")
    sleeping._stats = lambda backend: next(counters)
    groups = _make_groups()
    try:
        slept = sleeping.sleep(groups, timeout=20)
        try:
            dist.all_reduce(torch.ones(1), group=groups[0])
            refused = False
        except sleeping.GroupAsleepError:
            refused = True
        woken = sleeping.wake(timeout=20)
        return {
            "sleep": [(g.mechanism, g.bytes_freed) for g in slept.groups],
            "wake": [g.mechanism for g in woken.groups],
            "calls": calls,
            "refused": refused,
            "after": _sums(groups),
        }
    finally:
        sleeping._suspend, sleeping._resume, sleeping._stats = saved
        creation.destroy_groups(groups)


def _mismatch_and_error_inside() -> dict:
    """Rank 0 sleeps while the others wake; then an error inside asleep() still wakes."""
    groups = _make_groups()
    try:
        call = sleeping.sleep if dist.get_rank() == 0 else sleeping.wake
        try:
            call(groups, timeout=20)
            mismatch = ""
        except agreement.ParallelConfigMismatchError as err:
            mismatch = type(err).__name__
        inside = False
        try:
            with sleeping.asleep(groups, timeout=20):
                inside = sleeping.is_asleep(groups[0])
                raise KeyError("inside")
        except KeyError:
            pass
        return {
            "mismatch": mismatch,
            "inside": inside,
            "after": [sleeping.is_asleep(g) for g in groups],
            "sums": _sums(groups),
        }
    finally:
        creation.destroy_groups(groups)


def _destroyed_asleep() -> dict:
    groups = _make_groups()
    sleeping.sleep(groups, timeout=20)
    creation.destroy_groups(groups)
    woken = sleeping.wake(timeout=20)
    return {
        "woken": len(woken.groups),
        "asleep": len(sleeping._asleep),
        "patched": dist.distributed_c10d._rank_not_in_group.__module__ != "torch.distributed.distributed_c10d",
        "pg_map": len(dist.distributed_c10d._world.pg_map),
    }


def _sleep_unless_last() -> dict:
    """The last rank never calls sleep; the others do with a 2 s bound."""
    groups = _make_groups()
    outcome: dict = {}
    try:
        if dist.get_rank() != dist.get_world_size() - 1:
            started = time.monotonic()
            try:
                sleeping.sleep(timeout=2)
            except ParallelConfigTimeoutError as err:
                outcome = {"error": str(err), "missing": err.missing_rank_list()}
            outcome["seconds"] = time.monotonic() - started
        outcome["asleep"] = [sleeping.is_asleep(g) for g in groups]
        agreement.realign_sequences()  # the last rank skipped a round: align for later checks
        outcome["after"] = _sums(groups)
        return outcome
    finally:
        creation.destroy_groups(groups)


def _resources() -> dict:
    return {**process_resources(), "guards": len(sleeping._guards), "asleep": len(sleeping._asleep)}


def _cycles(n: int) -> dict:
    """``n`` cycles after a warm-up one; the counts awake and asleep, at the first cycle and the last."""
    groups = _make_groups()
    try:
        sleeping.sleep(timeout=20)  # a warm-up cycle: the guards are made once per group
        sleeping.wake(timeout=20)
        counts: dict = {"awake": [], "asleep": []}
        wrong = 0
        for cycle in range(n):
            if cycle in (0, n - 1):
                counts["awake"].append(_resources())
            with sleeping.asleep(timeout=20):
                if cycle in (0, n - 1):
                    counts["asleep"].append(_resources())
            wrong += _sums(groups) != _sums_expected()
        return {"first": counts["awake"][0], "last": _resources(), "wrong": wrong, **counts}
    finally:
        creation.destroy_groups(groups)


def _sums_expected() -> list[float]:
    world, rank = dist.get_world_size(), dist.get_rank()
    total = world * (world + 1) / 2
    first = rank // 2 * 2
    return [total, float(first + 1 + first + 2), total]


# --------------------------------------------------------------------------- tests
@pytest.mark.multiprocess
@pytest.mark.parametrize("size", [2, 4])
def test_sleep_wake_keeps_the_same_groups_and_results(gloo_world, size):
    world = gloo_world(size)
    for rank, got in enumerate(world.run(_sleep_wake_keeps_groups, timeout=90)):
        assert got["before"] == got["after"] == _expected(size, rank)
        before, after = got["facts"]
        assert [f[:-1] for f in before] == [f[:-1] for f in after] and got["same_live"]
        # the gloo sequence numbers go on where they were: the refused calls never reached gloo
        assert [f[-1] for f in after] == [2 * f[-1] for f in before]
        # the shared group once (listed twice), both fenced: gloo cannot suspend
        assert [m for _, m, _ in got["sleep"]] == ["fenced", "fenced"]
        assert {d for d, _, _ in got["sleep"]} == {SHARED_DESC, "DATA_PARALLEL"}
        assert all(b is None for _, _, b in got["sleep"])
        assert [m for _, m in got["wake"]] == ["fenced", "fenced"]
        assert got["asleep"] == [True, True, True] and got["awake_after"] == [False, False, False]
        assert "DATA_PARALLEL" in got["refused"] and "wake it first" in got["refused"]
        assert "error_on_collective" in got["direct"]
        assert got["refused_s"] < 5
        assert all(got["others"].values()), got["others"]
        assert got["patched_after"] == "torch.distributed.distributed_c10d"  # the guard is gone


def _expected(size: int, rank: int) -> list[float]:
    total = size * (size + 1) / 2
    first = rank // 2 * 2
    return [total, float(2 * first + 3), total]


@pytest.mark.multiprocess
def test_sleeping_twice_and_waking_the_awake_are_no_ops(gloo_world):
    for got in gloo_world(2).run(_twice, timeout=90):
        assert got["first"] == ["fenced", "fenced"]
        assert got["second"] == [("skipped", "already asleep")] * 2
        assert got["woken"] == ["fenced", "fenced"]
        assert got["again"] == [("skipped", "not asleep")] * 2
        assert got["inside"] == ([False, True], ["DATA_PARALLEL"])  # kinds: only the pair group
        assert got["after"] == [3.0, 3.0, 3.0]


@pytest.mark.multiprocess
def test_native_suspend_reports_bytes_freed_and_resumes(gloo_world):
    for rank, got in enumerate(gloo_world(2).run(_native_stand_in, timeout=90)):
        assert got["sleep"] == [("native", 900), ("native", 900)]
        assert got["wake"] == ["native", "native"]
        assert got["calls"] == ["suspend", "suspend", "resume", "resume"]
        assert got["refused"]  # a suspended group is fenced too
        assert got["after"] == _expected(2, rank)


@pytest.mark.multiprocess
def test_ranks_that_disagree_raise_and_asleep_wakes_on_error(gloo_world):
    for rank, got in enumerate(gloo_world(2).run(_mismatch_and_error_inside, timeout=90)):
        assert got["mismatch"] == "ParallelConfigMismatchError"
        assert got["inside"] and got["after"] == [False, False, False]
        assert got["sums"] == _expected(2, rank)


@pytest.mark.multiprocess
def test_a_group_destroyed_asleep_is_forgotten(gloo_world):
    for got in gloo_world(2).run(_destroyed_asleep, timeout=90):
        assert got == {"woken": 0, "asleep": 0, "patched": False, "pg_map": 1}


@pytest.mark.multiprocess
def test_a_rank_that_never_sleeps_makes_the_others_raise_naming_it(gloo_world):
    results = gloo_world(4).run(_sleep_unless_last, timeout=90)
    for rank, got in enumerate(results):
        assert got["asleep"] == [False, False, False]
        assert got["after"] == _expected(4, rank)
        if rank < 3:
            assert got["missing"] == [3], got
            assert got["seconds"] < 10


@pytest.mark.multiprocess
def test_fifty_cycles_leak_nothing_awake_nor_asleep(gloo_world):
    for got in gloo_world(2).run(_cycles, 50, timeout=240):
        assert got["wrong"] == 0
        first, last = got["first"], got["last"]
        assert not grown(first, last), (first, last)  # awake: before the first cycle, after the last
        assert not grown(got["asleep"][0], got["asleep"][1]), got["asleep"]  # asleep: first cycle, last
        for awake, asleep in zip(got["awake"], got["asleep"], strict=True):
            # gloo is fenced: asleep holds what awake holds, nothing more (nor less: nothing is freed)
            assert {k: asleep[k] for k in RESOURCE_KEYS} == {k: awake[k] for k in RESOURCE_KEYS}, (awake, asleep)
            assert asleep["asleep"] == 2 and awake["asleep"] == 0
        assert last["asleep"] == 0


def test_fake_backend_groups_are_skipped(fake_world):
    fake_world(0, 4)
    group = creation.new_member_group([0, 1], group_desc="TENSOR_MODEL_PARALLEL")
    other = creation.new_member_group([0, 2], group_desc="DATA_PARALLEL")
    try:
        report = sleeping.sleep(kinds=["TENSOR_MODEL_PARALLEL"], timeout=1)
        assert report.agreement is not None and report.agreement.skipped
        assert [(g.desc, g.mechanism) for g in report.groups] == [("TENSOR_MODEL_PARALLEL", "skipped")]
        assert "fake" in report.groups[0].reason
        assert not sleeping.is_asleep(group) and not sleeping.is_asleep(other)
        assert [g.reason for g in sleeping.wake([group, other], timeout=1).groups] == ["not asleep"] * 2
    finally:
        creation.destroy_groups([group, other])
