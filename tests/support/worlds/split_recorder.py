"""The split path's protocol, played on a fake-backend world: every rank in turn, splits recorded.

:class:`SplitRecorder` stands in for ``torch.distributed.split_group`` (records the call, makes
the member's group); :func:`play_world` runs a build on every rank on the split and the member
path (``PSNG_CREATION_PATH``); :func:`check_protocol` checks the recorded splits. No pytest:
the per-release checks (:mod:`tests.support.releases.split_checks`) use it too.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from parallel_state_ng.groups.split import ENV_CREATION_PATH
from parallel_state_ng.testing.worlds import init_simulated_rank

__all__ = ["SplitRecorder", "creation_env", "recording", "play_world", "check_protocol", "compare_paths"]


class SplitRecorder:
    """Stands in for ``torch.distributed.split_group``: records each call, makes the member's group."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, **kw):
        assert parent_pg is None and split_ranks, "every split is of the default group, with a split given"
        rank = dist.get_rank()
        mine = next((sorted(g) for g in split_ranks if rank in g), None)
        assert len(split_ranks) == 1, f"a rank hands torch only its own group, got {len(split_ranks)} lists"
        self.calls.append(
            (group_desc, str(timeout), pg_options, kw.get("backend"), None if mine is None else tuple(mine))
        )
        if mine is None:
            return None
        return dist.new_group(mine, use_local_synchronization=True)


@contextmanager
def creation_env(path: str) -> Iterator[None]:
    """``PSNG_CREATION_PATH=path`` for the duration."""
    old = os.environ.get(ENV_CREATION_PATH)
    os.environ[ENV_CREATION_PATH] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV_CREATION_PATH, None)
        else:
            os.environ[ENV_CREATION_PATH] = old


@contextmanager
def recording(recorder: SplitRecorder) -> Iterator[SplitRecorder]:
    """``torch.distributed.split_group`` is ``recorder`` for the duration.

    The recorder replaces torch's function entirely, so the split path's protocol is checked on
    any torch: before 2.6 (no ``split_group``, TORCH_FACTS) the attribute is added for the
    duration and removed after, and the engine then takes the recorder for torch's.
    """
    missing = object()
    original = getattr(dist, "split_group", missing)
    dist.split_group = recorder  # type: ignore[assignment]
    try:
        yield recorder
    finally:
        if original is missing:
            del dist.split_group
        else:
            dist.split_group = original  # type: ignore[assignment]


def play_world(world: int, build: Callable[[], Any]) -> tuple[dict[int, list], dict[int, dict]]:
    """Run ``build()`` on every rank of a ``world``-rank fake world, split path and member path.

    Returns each rank's recorded splits and what ``build()`` returned on each path
    (``{"split": ..., "member": ...}``); the member path records no split.
    """
    calls: dict[int, list] = {}
    results: dict[int, dict] = {}
    for rank in range(world):
        init_simulated_rank(rank, world, replace=True)
        with recording(SplitRecorder()) as recorder:
            with creation_env("split"):
                on_split = build()
            with creation_env("member"):
                on_member = build()
        calls[rank] = recorder.calls
        results[rank] = {"split": on_split, "member": on_member}
    dist.destroy_process_group()
    return calls, results


def check_protocol(calls: dict[int, list], world: int) -> int:
    """Identical split sequences on every rank; colours agree within a group and differ across groups.

    Returns the number of splits per rank. Raises ``AssertionError`` naming the first fault.
    """
    sequences = {rank: [c[:4] for c in seq] for rank, seq in calls.items()}
    first = sequences[0]
    for rank, seq in sequences.items():
        if seq != first:
            at = next((i for i, (a, b) in enumerate(zip(seq, first)) if a != b), min(len(seq), len(first)))
            got, want = seq[at : at + 1], first[at : at + 1]
            raise AssertionError(
                f"rank {rank}'s split sequence differs from rank 0's: {len(seq)} vs {len(first)} splits, "
                f"first difference at split {at}: {got} vs {want}"
            )
    for position in range(len(first)):
        members: dict[tuple, list[int]] = defaultdict(list)
        for rank in range(world):
            group = calls[rank][position][4]
            if group is not None:
                assert rank in group, f"split {position}: rank {rank} passed {group}, which lacks it"
                members[group].append(rank)
        seen: set[int] = set()
        for group, who in members.items():
            assert sorted(who) == list(group), f"split {position}: group {group} joined by {who}"
            assert not seen & set(group), f"split {position}: groups overlap"
            seen |= set(group)
    return len(first)


def compare_paths(results: dict[int, dict]) -> list[str]:
    """The ranks whose result on the split path differs from the member path's (one line each)."""
    return [
        f"rank {rank}: split path {r['split']!r} != member path {r['member']!r}"
        for rank, r in sorted(results.items())
        if r["split"] != r["member"]
    ]
