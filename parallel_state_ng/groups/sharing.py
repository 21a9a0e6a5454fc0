"""One process group for group kinds with the same members and the same options (opt-in).

Four settings (``PSNG_SHARE_GROUPS`` or :func:`set_group_sharing`, the same on every rank):
``0`` (the default) shares nothing; ``safe``: requests of one :class:`GroupPool` (one build)
share only as the policy by role of :mod:`parallel_state_ng.layout.sharing_policy` allows
(aliases of one role, size-1 groups, gloo twins; never an all-gather twin, tp_ep or kinds of
different roles); ``1`` (``build``): requests of one build whose :func:`sharing_key` is equal
(the same members in any order, backend, ``pg_options``, timeout) get one process group, an
all-gather twin only another twin's; ``process``: as ``1``, and requests of every pool of the
process share through the reference-counted registry of
:mod:`parallel_state_ng.groups.registry`, so several layouts in one process hold one
communicator per key. See docs/compat.md ("Group sharing" and "Several layouts in one process").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from parallel_state_ng.groups import registry
from parallel_state_ng.layout.bounded_input import shown
from parallel_state_ng.layout.kinds import ALL_GATHER_KINDS
from parallel_state_ng.layout.sharing_policy import kind_of_desc, safe_class

__all__ = [
    "ENV_SHARE",
    "SharingMode",
    "set_group_sharing",
    "group_sharing_enabled",
    "group_sharing_mode",
    "default_mode",
    "options_key",
    "sharing_key",
    "GroupPool",
    "PlannedGroup",
    "record_requests",
]

#: Environment variable: ``0`` (the default), ``safe`` (the policy by role, within one build),
#: ``1`` (within one build) or ``process`` (across every layout of the process,
#: :mod:`parallel_state_ng.groups.registry`).
ENV_SHARE = "PSNG_SHARE_GROUPS"
#: ``off``: no sharing; ``safe``: by role within one build; ``build``: within one build;
#: ``process``: across the process's layouts.
SharingMode = Literal["off", "safe", "build", "process"]
_MODES: dict[str, SharingMode] = {
    **dict.fromkeys(("", "0", "false", "no", "off"), "off"),
    "safe": "safe",
    **dict.fromkeys(("1", "true", "yes", "on", "build"), "build"),
    "process": "process",
}
_VALUES = "0, safe, 1 or process"
_override: SharingMode | None = None
_recording: list[PlannedGroup] | None = None
_recording_share: bool | str | None = None
# the process registry's stand-in while requests are recorded: key -> planned group
_recording_registry: dict[tuple, PlannedGroup] = {}


def _as_mode(value: bool | str, where: str) -> SharingMode:
    """``value`` (a bool or one of the setting's words) as a :data:`SharingMode`."""
    if isinstance(value, bool):
        return "build" if value else "off"
    if isinstance(value, str) and value.strip().lower() in _MODES:
        return _MODES[value.strip().lower()]
    raise ValueError(f"{where} must be {_VALUES} (or a bool), got {shown(value)}")


def set_group_sharing(enabled: bool | str | None) -> bool | str | None:
    """Set group sharing for this process; ``None`` goes back to the environment.

    ``False`` / ``"off"``: no sharing; ``"safe"``: the policy by role within each build;
    ``True`` / ``"build"``: within each build; ``"process"``: across every layout of the
    process (the communicator registry). Wins over
    ``PSNG_SHARE_GROUPS``. Set it the same way on every rank, before the first build: a layout
    built under one setting keeps its groups as they were made. Returns the previous override
    (``None``, or the mode as set), so a caller can restore it.

    Raises:
        TypeError: ``enabled`` is not a bool, a str or ``None``.
        ValueError: a str other than ``off``, ``safe``, ``build``, ``process`` (or ``0``/``1``).
    """
    global _override
    if enabled is not None and not isinstance(enabled, (bool, str)):
        raise TypeError(f"enabled must be a bool, 'off', 'safe', 'build', 'process' or None, got {enabled!r}")
    mode = None if enabled is None else _as_mode(enabled, "enabled")
    previous, _override = _override, mode
    return previous


def default_mode(path: str = "member") -> SharingMode:
    """The setting when neither :func:`set_group_sharing` nor ``PSNG_SHARE_GROUPS`` says one.

    ``safe`` on the split path (a default group bound to a device: every communicator is made at
    init and holds device memory, and ``safe`` changes no group identity an audited use of
    Megatron's sees, docs/compat.md "Group sharing"); ``off`` on the member path, where NCCL makes
    a communicator only at a group's first collective.
    """
    return "safe" if path == "split" else "off"


def group_sharing_mode(path: str = "member") -> SharingMode:
    """The sharing setting: :func:`set_group_sharing`, else ``PSNG_SHARE_GROUPS``, else the default.

    ``path``: the build's creation path, which decides the default (:func:`default_mode`: ``safe``
    on the split path, ``off`` on the member path). ``PSNG_SHARE_GROUPS=0`` turns sharing off on
    either path.

    Raises:
        ValueError: the environment variable holds something else than 0, safe, 1 or process.
    """
    if _override is not None:
        return _as_mode(_override, "the sharing override")
    text = os.environ.get(ENV_SHARE, "")
    if not text.strip():
        return default_mode(path)
    try:
        return _as_mode(text, f"environment variable {ENV_SHARE}")
    except ValueError:
        raise ValueError(f"environment variable {ENV_SHARE} must be {_VALUES}, got {shown(text)}") from None


def group_sharing_enabled(path: str = "member") -> bool:
    """Whether groups of a build on ``path`` are shared at all (:func:`group_sharing_mode` is not ``off``)."""
    return group_sharing_mode(path) != "off"


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


def sharing_key(
    ranks: Sequence[int],
    backend: str | None,
    pg_options: Any,
    timeout: Any,
    *,
    kind: str | None = None,
    mode: SharingMode = "build",
) -> tuple | None:
    """The key two group requests must have in common to share one group (``None``: never shared).

    ``ranks`` as a set: torch orders a group's members by global rank whatever order they are
    given in (``new_group`` and ``split_group`` sort them), so ``[0, 4, 2, 6]`` and
    ``[0, 2, 4, 6]`` are one communicator; each layout keeps its own rank order for its getters.
    ``backend`` as requested (``None``, the default backend, differs from ``"gloo"``, so a gloo
    twin never shares with its main group); ``timeout`` ``None`` (torch's default) differs
    from any explicit value. ``kind`` is the request's group kind (``None``: unknown): under
    ``build`` and ``process`` an all-gather twin (``dp_cp_ag``, ``ep_dp_ag``) shares only with
    another twin; under ``safe`` the class of
    :func:`~parallel_state_ng.layout.sharing_policy.safe_class` and the SHARP switch
    (``NCCL_COLLNET_ENABLE`` at the request) join the key.
    """
    key: tuple = (
        tuple(sorted(ranks)),
        None if backend is None else str(backend).lower(),
        options_key(pg_options),
        timeout,
    )
    if mode == "safe":
        cls = safe_class(kind, len(set(ranks)), backend)
        return None if cls is None else (*key, cls, os.environ.get("NCCL_COLLNET_ENABLE"))
    return (*key, "all_gather") if kind in ALL_GATHER_KINDS else key


@dataclass
class PlannedGroup:
    """A group that :func:`record_requests` recorded instead of creating (layout tools)."""

    ranks: list[int]
    backend: str | None
    timeout: Any
    descs: list[str] = field(default_factory=list)


@contextmanager
def record_requests(share: bool | str | None = None) -> Iterator[list[PlannedGroup]]:
    """Inside the block, every :class:`GroupPool` made records instead of creating groups.

    Yields the list the :class:`PlannedGroup` objects are appended to (one per group that
    would be created; with sharing on, a shared group once, its kinds in ``descs``). No
    process group is created and ``torch.distributed`` need not be initialized. ``share``
    overrides the sharing setting of the pools made in the block (``None``: the setting);
    with ``"process"`` the block stands for one process: its pools share as the registry
    would. For tools that count communicators (``python -m parallel_state_ng layout --share``).
    """
    global _recording, _recording_share, _recording_registry
    saved = _recording, _recording_share, _recording_registry
    _recording, _recording_share, _recording_registry = [], share, {}
    try:
        yield _recording
    finally:
        _recording, _recording_share, _recording_registry = saved


class GroupPool:
    """Creates the groups of one build; with sharing on, reuses a group for an equal request.

    ``share=None`` takes :func:`group_sharing_mode` for the build's creation ``path`` (else a bool or a mode, as
    :func:`set_group_sharing` takes). ``create(ranks, backend=, timeout=, pg_options=,
    group_desc=)`` makes a group: the build's
    :class:`~parallel_state_ng.groups.factory.GroupFactory` passes its path's maker (a pool
    that only records, inside :func:`record_requests`, needs none). Under ``build`` sharing, groups
    of different pools (different grids or inits) are never shared, so destroying one cannot
    touch another's. Under ``process`` sharing every request goes through the process-wide
    registry (:mod:`parallel_state_ng.groups.registry`) under the pool's :attr:`lease`
    (``lease``: one the layout already holds, e.g. for groups it makes on request later);
    the layout's destroy passes that lease to
    :func:`~parallel_state_ng.groups.creation.destroy_groups`.
    """

    def __init__(
        self,
        share: bool | str | None = None,
        create: Callable[..., Any] | None = None,
        *,
        lease: registry.Lease | None = None,
        path: str = "member",
    ) -> None:
        self._plan = _recording
        if share is None and self._plan is not None:
            share = _recording_share
        self.mode: SharingMode = group_sharing_mode(path) if share is None else _as_mode(share, "share")
        self.share = self.mode != "off"
        #: This pool's hold on registry communicators (empty unless the mode is ``process``).
        self.lease = registry.Lease() if lease is None else lease
        self._create = create
        self._groups: dict[tuple, Any] = (
            _recording_registry if self._plan is not None and self.mode == "process" else {}
        )
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
        kind: str | None = None,
    ) -> tuple[Any, bool]:
        """The group for this request and whether it is new to this pool (``False``: shared).

        ``kind``: the request's group kind for the sharing policy (default: the kind whose
        ``group_desc`` this is, else the ``group_desc`` itself). Under ``process`` sharing a
        group another layout holds is new to this pool but not created: :attr:`created` (the
        count of groups made) tells the two apart.
        """
        self.requests += 1
        if kind is None:
            kind = kind_of_desc(group_desc) or group_desc
        key = sharing_key(ranks, backend, pg_options, timeout, kind=kind, mode=self.mode) if self.share else None

        def create() -> Any:
            if self._plan is None:
                if self._create is None:
                    raise RuntimeError("a GroupPool outside record_requests() needs create= (use GroupFactory)")
                made = self._create(
                    ranks, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc
                )
            else:
                made = PlannedGroup(list(ranks), backend, timeout, [group_desc or ""])
                self._plan.append(made)
            self.created += 1
            return made

        if key is not None and self.mode == "process" and self._plan is None:
            group, _, new = registry.acquire(key, self.lease, create)
            return group, new
        if key is not None and key in self._groups:
            group = self._groups[key]
            if isinstance(group, PlannedGroup):
                group.descs.append(group_desc or "")
            return group, False
        group = create()
        if key is not None:
            self._groups[key] = group
        return group, True
