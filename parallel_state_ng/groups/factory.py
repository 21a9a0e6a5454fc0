"""The one place that decides how a process group of the project comes to exist.

Every builder asks a :class:`GroupFactory` (one per build: an ``initialize_model_parallel``, a
grid, a collection, an inference collection, a handle's CPU group) and nothing else: the plan
executor (:mod:`~parallel_state_ng.groups.megatron_groups`),
:class:`~parallel_state_ng.builders.grid.HyperCommGrid`, the inference builders, group handles,
compat's stateless helpers and the layout tools that count communicators. A new creation
feature plugs in here once. What the factory decides for each request, in this order:

1. **Which path.** On a world whose default group splits (a bound device, torchcomms), a
   request whose backend splits (:data:`~parallel_state_ng.layout.plan.SPLIT_BACKENDS`) is one
   split of the default group that every rank of the world joins, members with their group and
   the others without a colour (:func:`~parallel_state_ng.groups.split.split_member`). Any other
   request (a lazy world, or a gloo twin on any world) is made by its members only
   (:func:`~parallel_state_ng.groups.creation.new_member_group`).
2. **Shared or not.** Requests go through the build's
   :class:`~parallel_state_ng.groups.sharing.GroupPool`, which answers an equal request with the
   group it made before when the sharing setting allows it; a request whose options the pool
   cannot compare (``shareable=False``) is always made anew. A shared group's description names
   every kind it serves (``A+B``), not only the first.
3. **Which lease.** Under ``PSNG_SHARE_GROUPS=process`` the pool takes the communicator from the
   process-wide registry under the build's lease (:mod:`~parallel_state_ng.groups.registry`);
   :meth:`GroupFactory.destroy` gives that lease back with the groups.
4. **What torch is told.** ``timeout``, ``pg_options``, ``backend`` and ``group_desc`` pass
   through unchanged; the failure bound (gloo creation, nonblocking NCCL) is read once per build
   from the build's :class:`~parallel_state_ng.groups.liveness.CreationContext`.

The creation primitives themselves stay in :mod:`~parallel_state_ng.groups.creation` (member
path, names, destroy) and :mod:`~parallel_state_ng.groups.split` (the split path); no other
module imports them (``tests/groups/test_factory.py`` checks the whole tree).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from parallel_state_ng.groups.creation import destroy_groups, new_member_group, track_group
from parallel_state_ng.groups.liveness import CreationContext
from parallel_state_ng.groups.registry import Lease
from parallel_state_ng.groups.sharing import GroupPool, SharingMode
from parallel_state_ng.groups.split import CreationPath, split_member
from parallel_state_ng.layout.plan import SPLIT_BACKENDS
from parallel_state_ng.layout.sharing_policy import merged_desc

__all__ = ["GroupFactory", "member_only_group"]


class GroupFactory:
    """Makes the groups of one build, deciding path, sharing and lease for each request.

    Args:
        path: the build's creation path (``"member"`` or ``"split"``, as
            :func:`~parallel_state_ng.groups.split.creation_path` resolved it once for the build).
        share: the sharing setting of the build's pool (``None``: ``PSNG_SHARE_GROUPS`` or
            :func:`~parallel_state_ng.groups.sharing.set_group_sharing`, else the path's default:
            ``safe`` on the split path, off on the member path); ``"off"`` never shares.
        lease: the layout's hold on registry communicators, when it already has one (groups it
            makes on request after its init join the init's lease); default a new one.
        context: the build's creation settings, read once
            (:meth:`~parallel_state_ng.groups.liveness.CreationContext.current`); ``None`` reads
            them at each request, for a long-lived object whose requests are builds of their own
            (a grid's ``create_pg``).

    Inside :func:`~parallel_state_ng.groups.sharing.record_requests` the pool records requests
    instead of creating groups (the layout tools count communicators that way).
    """

    def __init__(
        self,
        *,
        path: CreationPath = "member",
        share: bool | str | None = None,
        lease: Lease | None = None,
        context: CreationContext | None = None,
    ) -> None:
        if path not in ("member", "split"):
            raise ValueError(f"path must be 'member' or 'split', got {path!r}")
        self.path: CreationPath = path
        self.context = context
        # The pool calls back into a plain function, never into this object: a bound method
        # would be a reference cycle that keeps every group alive until the garbage collector
        # runs, and a gloo group freed then blocks whatever the rank is doing at that moment.
        self.pool = GroupPool(share, create=_Maker(path == "split", context), lease=lease, path=path)

    @property
    def lease(self) -> Lease:
        """The build's hold on registry communicators (empty unless sharing is ``process``)."""
        return self.pool.lease

    @property
    def sharing(self) -> SharingMode:
        """The sharing setting this build's pool runs under."""
        return self.pool.mode

    @property
    def created(self) -> int:
        """How many groups this factory has made (shared answers not counted)."""
        return self.pool.created

    def splits(self, backend: str | None) -> bool:
        """Whether a request on ``backend`` is a split of the default group in this build."""
        return self.path == "split" and backend in SPLIT_BACKENDS

    def group(
        self,
        ranks: Sequence[int] | None,
        *,
        kind: str | None = None,
        backend: str | None = None,
        pg_options: Any = None,
        timeout: Any = None,
        group_desc: str | None = None,
        shareable: bool = True,
        **torch_kwargs: Any,
    ) -> tuple[Any, bool]:
        """This rank's group for one request, and whether the build holds it newly.

        ``ranks``: the members, in the order the layout keeps them (``None``: this rank is in no
        group of the request; on the split path it still joins the request's split, without a
        colour, and gets ``(None, False)``). ``kind``: the request's group kind for the sharing
        policy (default: read from ``group_desc``). ``shareable=False``: never shared (options
        the pool cannot compare, such as extra ``torch_kwargs``). Returns ``(group, new)``;
        ``new`` is ``False`` when the pool answered with a group this build already holds, so a
        caller lists and destroys each group once.
        """
        # a list is passed on as it is: a copy would cost the member count again (a world-sized group)
        members = ranks if ranks is None or isinstance(ranks, list) else list(ranks)
        options = {"pg_options": pg_options, "timeout": timeout, "group_desc": group_desc, **torch_kwargs}
        if self.splits(backend):
            return self._split(members, kind=kind, backend=backend, shareable=shareable, options=options)
        if members is None:
            return None, False
        if not shareable or torch_kwargs:
            return new_member_group(members, context=self.context, backend=backend, **options), True
        return self._pooled(members, kind=kind, backend=backend, **options)

    def _pooled(self, members: list[int], **request: Any) -> tuple[Any, bool]:
        """The pool's answer; a group it shares with an earlier request names this request's kind too."""
        made = self.pool.created
        group, new = self.pool.get(members, **request)
        if self.pool.created == made:
            _name_also(group, request.get("group_desc"))
        return group, new

    def _split(
        self, members: list[int] | None, *, kind: str | None, backend: str | None, shareable: bool, options: dict
    ) -> tuple[Any, bool]:
        """One request's split: every rank of the world joins it once, whatever the pool shares."""
        if members is not None and shareable and not set(options) - {"pg_options", "timeout", "group_desc"}:
            made = self.pool.created
            group, new = self._pooled(members, kind=kind, backend=backend, **options)
            if self.pool.created > made:
                return group, True  # the pool's own split was this request's split
        elif members is not None:
            group = split_member(members, context=self.context, backend=backend, **options)
            return group, True
        # no new group for this request (shared, or not a member): join the split without a colour
        split_member(None, context=self.context, backend=backend, **options)
        return (group, new) if members is not None else (None, False)

    def every_group(self, enumerated: Sequence[Sequence[int]], *, backend: str | None, **torch_kwargs: Any) -> Any:
        """Every group of ``enumerated`` made with a plain all-rank ``new_group``; this rank's one.

        For callers that ask for MCore's way on purpose (a grid's ``create_pg(all_ranks=True)``):
        every rank of the world takes part in every creation, in the same order; groups are
        tracked for abort and destroyed by :meth:`destroy`. ``None`` when the rank is in none.
        """
        rank = dist.get_rank()
        mine = None
        for members in enumerated:
            members = list(members)
            made = track_group(dist.new_group(ranks=members, backend=backend, **torch_kwargs))
            if rank in members:
                mine = made
        return mine

    def destroy(self, groups: Sequence[Any]) -> int:
        """Destroy ``groups`` (each once) and give back the build's lease; returns how many went."""
        return destroy_groups(groups, lease=self.pool.lease)


def _name_also(group: Any, group_desc: str | None) -> None:
    """Add ``group_desc`` to a shared group's description: a merged group names all of its kinds.

    Flight-recorder dumps, Megatron-FSDP's logs and the diagnosis read the description; the
    first kind's alone would name the wrong kind for the others
    (:func:`~parallel_state_ng.layout.sharing_policy.merged_desc`).
    """
    if not group_desc or not isinstance(group, dist.ProcessGroup) or not hasattr(group, "_set_group_desc"):
        return
    merged = merged_desc(group.group_desc, group_desc)
    if merged is not None and merged != group.group_desc:
        group._set_group_desc(merged)


class _Maker:
    """The pool's ``create``: one group by the path the build takes (no reference to the factory)."""

    __slots__ = ("split", "context")

    def __init__(self, split: bool, context: CreationContext | None) -> None:
        self.split = split
        self.context = context

    def __call__(self, ranks: list[int], *, backend: str | None = None, **options: Any) -> Any:
        if self.split and backend in SPLIT_BACKENDS:
            return split_member(ranks, context=self.context, backend=backend, **options)
        return new_member_group(ranks, context=self.context, backend=backend, **options)


def member_only_group(ranks: Sequence[int], **torch_kwargs: Any) -> Any:
    """One group made by its members only, outside any build (never shared, never split).

    For Megatron's stateless helpers whose callers pass each rank's own group
    (``create_hierarchical_groups``, the hybrid data-context groups) and for a handle's CPU
    companion: ``torch_kwargs`` (``backend``, ``timeout``, ``pg_options``, ``group_desc``) go
    to torch as given.
    """
    return new_member_group(list(ranks), **torch_kwargs)
