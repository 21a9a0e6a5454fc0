"""Counting and timing the key-value store traffic of an init (benchmarks and tests only).

:class:`CountingStore` wraps a ``torch.distributed.Store`` and records every operation (``set``,
``get``, ``add``, ``wait``, ``compare_set``, ``check``, ``multi_get``, ...) with its seconds,
filed under the *category* its key belongs to (:func:`classify`: the agreement round, arrival
marks, the closing round, readiness marks, a communicator's own connection traffic, ...).
:func:`counting_default_store` puts one into the default group's store path for the length of a
block, so that everything created meanwhile (the agreement check, the liveness keys, the new
groups' stores) talks through it; the product's init path never sees this module. The store
behind it is the launcher's, or a fresh ``FileStore`` or ``TCPStore`` shared by all ranks.
See docs/results/performance.md ("Store traffic").
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist

__all__ = ["CATEGORIES", "StoreKind", "classify", "CountingStore", "Traffic", "counting_default_store"]

#: Key fragment -> category, first match wins (readiness marks live under a group's prefix).
_MARKERS = (
    ("psng_agreement/", "agreement"),
    ("psng-arrive/", "arrival"),
    ("psng-init/", "closing"),
    ("psng-ready/", "readiness"),
    ("psng-failed/", "failure"),
    ("psng-alive/", "survivors"),
    ("stand-in-split/", "stand-in"),
    ("store_based_barrier", "barrier"),
)
#: Every category :func:`classify` returns; ``connect`` is a communicator's own traffic (gloo's
#: connection, NCCL's unique id), ``stand-in`` the CPU stand-in for NCCL's split (no store on NCCL).
CATEGORIES = tuple(dict.fromkeys([c for _, c in _MARKERS] + ["connect", "other"]))
#: The categories compat's protocol adds on top of creating communicators.
PROTOCOL = ("agreement", "arrival", "closing", "readiness")
StoreKind = Literal["launcher", "file", "tcp"]


def classify(key: str | None) -> str:
    """The category of a store key (``None``: an operation without a key, e.g. ``num_keys``)."""
    if key is None:
        return "other"
    for marker, category in _MARKERS:
        if marker in key:
            return category
    return "connect"


@dataclass
class Traffic:
    """What a :class:`CountingStore` saw: ``(category, op) -> [count, seconds]`` and wall-clock marks."""

    ops: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def count(self, category: str | None = None, op: str | None = None) -> int:
        """Operations of ``category`` (all: ``None``) and ``op`` (all: ``None``)."""
        return int(sum(v[0] for (c, o), v in self.ops.items() if category in (None, c) and op in (None, o)))

    def seconds(self, category: str | None = None) -> float:
        """Seconds spent in operations of ``category`` (all: ``None``)."""
        return sum(v[1] for (c, _), v in self.ops.items() if category in (None, c))

    def by_category(self) -> dict[str, dict[str, float]]:
        """``category -> {"ops": n, "seconds": s, <op>: n, ...}`` for the categories seen."""
        out: dict[str, dict[str, float]] = {}
        for (category, op), (n, s) in sorted(self.ops.items()):
            row = out.setdefault(category, {"ops": 0, "seconds": 0.0})
            row["ops"] += n
            row["seconds"] += s
            row[op] = row.get(op, 0) + n
        return out


class CountingStore(dist.Store):
    """A store that forwards every operation to ``inner`` and records it in :attr:`traffic`.

    torch's C++ side (``PrefixStore``, gloo, NCCL's unique-id exchange) calls it like any store.
    Thread-safe (gloo connects from its own threads). :meth:`reset` starts a new record.
    """

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.traffic = Traffic()
        self._lock = threading.Lock()

    def reset(self) -> Traffic:
        """Start a new record; return the one that ends."""
        with self._lock:
            old, self.traffic = self.traffic, Traffic()
        return old

    def _timed(self, op: str, key: str | None, call: Any) -> Any:
        start = time.perf_counter()
        try:
            return call()
        finally:
            took = time.perf_counter() - start
            with self._lock:
                entry = self.traffic.ops.setdefault((classify(key), op), [0, 0.0])
                entry[0] += 1
                entry[1] += took

    # the Store interface, each operation forwarded and recorded
    def set(self, key: str, value: Any) -> None:  # noqa: D102
        return self._timed("set", key, lambda: self.inner.set(key, value))

    def get(self, key: str) -> bytes:  # noqa: D102
        return self._timed("get", key, lambda: self.inner.get(key))

    def add(self, key: str, value: int) -> int:  # noqa: D102
        return self._timed("add", key, lambda: self.inner.add(key, value))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:  # noqa: D102
        return self._timed("compare_set", key, lambda: self.inner.compare_set(key, expected, desired))

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return self._timed("delete_key", key, lambda: self.inner.delete_key(key))

    def check(self, keys: list[str]) -> bool:  # noqa: D102
        return self._timed("check", keys[0] if keys else None, lambda: self.inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # noqa: D102
        first = keys[0] if keys else None
        if timeout is None:
            return self._timed("wait", first, lambda: self.inner.wait(keys))
        return self._timed("wait", first, lambda: self.inner.wait(keys, timeout))

    def multi_get(self, keys: list[str]) -> list[bytes]:  # noqa: D102
        return self._timed("multi_get", keys[0] if keys else None, lambda: self.inner.multi_get(keys))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:  # noqa: D102
        return self._timed("multi_set", keys[0] if keys else None, lambda: self.inner.multi_set(keys, values))

    def append(self, key: str, value: Any) -> None:  # noqa: D102
        return self._timed("append", key, lambda: self.inner.append(key, value))

    def num_keys(self) -> int:  # noqa: D102
        return self._timed("num_keys", None, self.inner.num_keys)

    def set_timeout(self, timeout: timedelta) -> None:  # noqa: D102
        return self.inner.set_timeout(timeout)

    def has_extended_api(self) -> bool:  # noqa: D102
        return True


_installs = [0]


def _shared_inner(kind: StoreKind, base: Any, rank: int, world: int) -> tuple[Any, Any]:
    """The store behind the counter, and what keeps it alive (a TCPStore master, a directory)."""
    tag = f"psng-traffic/{_installs[0]}"
    _installs[0] += 1
    if kind == "launcher":
        return dist.PrefixStore(f"{tag}/", base), None
    if kind == "file":
        if rank == 0:
            directory = tempfile.mkdtemp(prefix="psng-traffic-")
            base.set(f"{tag}/path", os.path.join(directory, "store"))
        path = base.get(f"{tag}/path").decode()
        return dist.FileStore(path, world), path
    if kind == "tcp":
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
            base.set(f"{tag}/port", str(store.port))
            return store, None
        port = int(base.get(f"{tag}/port").decode())
        return dist.TCPStore("127.0.0.1", port, world, is_master=False), None
    raise ValueError(f"kind must be 'launcher', 'file' or 'tcp', got {kind!r}")


@contextmanager
def counting_default_store(kind: StoreKind = "launcher") -> Iterator[CountingStore]:
    """Inside the block the default group's store is a :class:`CountingStore` (collective).

    Every rank of the world enters together. ``kind``: what the counter forwards to:
    ``launcher`` (a fresh prefix of the world's own store), ``file`` (a new ``FileStore`` in a
    temporary directory) or ``tcp`` (a new ``TCPStore`` served by rank 0 on a free port).
    Groups made inside keep that store: destroy them before the block ends. On exit the
    ranks meet in a barrier (rank 0 serves the ``TCPStore``) and the world's store is put back.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: ``kind`` is none of the three.
    """
    if kind not in ("launcher", "file", "tcp"):
        raise ValueError(f"kind must be 'launcher', 'file' or 'tcp', got {kind!r}")
    if not dist.is_initialized():
        raise RuntimeError("counting_default_store needs an initialized default process group")
    world: Any = dist.distributed_c10d._world
    default = world.default_pg
    backend, base = world.pg_map[default]
    inner, keep = _shared_inner(kind, base, dist.get_rank(), dist.get_world_size())
    counter = CountingStore(inner)
    world.pg_map[default] = (backend, counter)
    try:
        yield counter
    finally:
        world.pg_map[default] = (backend, base)
        counter.inner = None  # the record stays readable; the store goes with the last reference
        del inner
        dist.barrier()  # nobody closes the TCPStore master while others still talk to it
        if kind == "file" and dist.get_rank() == 0 and isinstance(keep, str):
            shutil.rmtree(os.path.dirname(keep), ignore_errors=True)
