"""One process group for group kinds with the same members and the same options (opt-in).

With sharing on (``PSNG_SHARE_GROUPS=1`` or :func:`set_group_sharing`, the same on every rank),
requests of one :class:`GroupPool` whose :func:`sharing_key` is equal (same ranks in the same
order, backend, ``pg_options``, timeout) get one process group. Off by default. See
docs/compat.md ("Group sharing").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from parallel_state_ng.groups.creation import new_member_group

__all__ = [
    "ENV_SHARE",
    "set_group_sharing",
    "group_sharing_enabled",
    "options_key",
    "sharing_key",
    "GroupPool",
    "PlannedGroup",
    "record_requests",
]

#: Environment variable turning sharing on (``1``) or off (``0``, the default).
ENV_SHARE = "PSNG_SHARE_GROUPS"
_override: bool | None = None
_recording: list[PlannedGroup] | None = None
_recording_share: bool | None = None


def set_group_sharing(enabled: bool | None) -> bool | None:
    """Turn group sharing on or off for this process; ``None`` goes back to the environment.

    Wins over ``PSNG_SHARE_GROUPS``. Set it the same way on every rank. Returns the previous
    override, so a caller can restore it.
    """
    global _override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool or None, got {enabled!r}")
    previous, _override = _override, enabled
    return previous


def group_sharing_enabled() -> bool:
    """Whether groups are shared (:func:`set_group_sharing`, else ``PSNG_SHARE_GROUPS``)."""
    if _override is not None:
        return _override
    text = os.environ.get(ENV_SHARE, "0").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False
    if text in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"environment variable {ENV_SHARE} must be 0 or 1, got {os.environ[ENV_SHARE]!r}")


class _Identity:
    """Hashable stand-in for an options object compared by identity (keeps it alive)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


_NCCL_CONFIG_FIELDS = ("cga_cluster_size", "max_ctas", "min_ctas", "net_name")


def options_key(pg_options: Any) -> Hashable:
    """A value that is equal for two ``pg_options`` exactly when sharing is allowed.

    ``None`` for no options; NCCL options by value; anything else by identity.
    """
    if pg_options is None:
        return None
    config = getattr(pg_options, "config", None)
    if hasattr(pg_options, "is_high_priority_stream") and config is not None:
        try:
            fields = tuple(getattr(config, name, None) for name in _NCCL_CONFIG_FIELDS)
            key = (type(pg_options).__qualname__, bool(pg_options.is_high_priority_stream), fields)
            hash(key)
            return key
        except Exception:  # noqa: BLE001 - unreadable/unhashable: fall back to identity
            pass
    return _Identity(pg_options)


def sharing_key(ranks: Sequence[int], backend: str | None, pg_options: Any, timeout: Any) -> tuple:
    """The key two group requests must have in common to share one group.

    ``backend`` as requested (``None``, the default backend, differs from ``"gloo"``, so a gloo
    twin never shares with its main group); ``timeout`` ``None`` (torch's default) differs
    from any explicit value.
    """
    return (tuple(ranks), None if backend is None else str(backend).lower(), options_key(pg_options), timeout)


@dataclass
class PlannedGroup:
    """A group that :func:`record_requests` recorded instead of creating (layout tools)."""

    ranks: list[int]
    backend: str | None
    timeout: Any
    descs: list[str] = field(default_factory=list)


@contextmanager
def record_requests(share: bool | None = None) -> Iterator[list[PlannedGroup]]:
    """Inside the block, every :class:`GroupPool` made records instead of creating groups.

    Yields the list the :class:`PlannedGroup` objects are appended to (one per group that
    would be created; with sharing on, a shared group once, its kinds in ``descs``). No
    process group is created and ``torch.distributed`` need not be initialized. ``share``
    overrides the sharing setting of the pools made in the block (``None``: the setting).
    For tools that count communicators (``python -m parallel_state_ng layout --share``).
    """
    global _recording, _recording_share
    saved = _recording, _recording_share
    _recording, _recording_share = [], share
    try:
        yield _recording
    finally:
        _recording, _recording_share = saved


class GroupPool:
    """Creates the groups of one build; with sharing on, reuses a group for an equal request.

    ``share=None`` takes :func:`group_sharing_enabled`. ``create`` makes a group (default
    :func:`parallel_state_ng.groups.creation.new_member_group`). Groups of different pools
    (different grids or inits) are never shared, so destroying one cannot touch another's.
    """

    def __init__(self, share: bool | None = None, create: Callable[..., Any] | None = None) -> None:
        self._plan = _recording
        if share is None and self._plan is not None:
            share = _recording_share
        self.share = group_sharing_enabled() if share is None else share
        self._create = create or new_member_group
        self._groups: dict[tuple, Any] = {}
        self.requests = 0
        self.created = 0

    def get(
        self,
        ranks: list[int],
        *,
        backend: str | None = None,
        pg_options: Any = None,
        timeout: Any = None,
        group_desc: str | None = None,
    ) -> tuple[Any, bool]:
        """The group for this request and whether it was just created (``False``: shared)."""
        self.requests += 1
        key = sharing_key(ranks, backend, pg_options, timeout) if self.share else None
        if key is not None and key in self._groups:
            group = self._groups[key]
            if isinstance(group, PlannedGroup):
                group.descs.append(group_desc or "")
            return group, False
        if self._plan is not None:
            group = PlannedGroup(list(ranks), backend, timeout, [group_desc or ""])
            self._plan.append(group)
        else:
            group = self._create(ranks, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc)
        self.created += 1
        if key is not None:
            self._groups[key] = group
        return group, True
