"""``GroupHandle``: one process group seen from the calling rank, with ring topology and helpers.

Built from plain data (the ordered member ranks, the device group, optionally a CPU companion),
so anything that owns process groups can hand one out: position, first/last member, ring
neighbours, collectives in the handle's rank order, and a lazily created gloo CPU group.
See docs/engine.md ("Handles and DeviceMesh").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from parallel_state_ng.groups.creation import destroy_groups
from parallel_state_ng.groups.factory import member_only_group
from parallel_state_ng.groups.objects import broadcast_object

__all__ = ["GroupHandle"]

# torch 2.13 renamed the single-tensor collectives; keep the old names as a fallback.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _is_process_group(obj: object) -> bool:
    return isinstance(obj, dist.ProcessGroup)


class GroupHandle:
    """The calling rank's view of one process group.

    Args:
        ranks: global ranks of the members in the handle's order, which positions, neighbours,
            ``group_src`` and chunk layouts refer to (``new_group`` sorts its ranks, so the
            process group's own order may differ; the helpers translate).
        group: the device process group over exactly these ranks.
        cpu_group: an existing CPU (gloo) group over the same ranks. When omitted, one is
            created on first use of :attr:`cpu_group` (or :meth:`barrier`,
            :meth:`broadcast_object`) — a call every member must make — and destroyed by
            :meth:`destroy`. A group passed here belongs to the caller and is not destroyed.
        rank: global rank of the caller (default: ``torch.distributed.get_rank()``).
        name: label used in messages and ``repr`` (e.g. the grid key ``"pp"``).

    Raises:
        ValueError: ``rank`` is not a member, ``ranks`` is empty or repeats a rank, or the
            ranks of ``group`` / ``cpu_group`` are not the same set as ``ranks``.
        TypeError: ``group`` is not a ``ProcessGroup``.
    """

    def __init__(
        self,
        ranks: Sequence[int],
        group: dist.ProcessGroup,
        cpu_group: dist.ProcessGroup | None = None,
        *,
        rank: int | None = None,
        name: str | None = None,
    ) -> None:
        ranks = [int(r) for r in ranks]
        label = f"group {name!r}" if name else "group"
        if not ranks:
            raise ValueError(f"ranks of {label} must not be empty")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ranks of {label} repeat a rank: {ranks}")
        if not _is_process_group(group):
            raise TypeError(
                f"group of {label} must be a torch.distributed.ProcessGroup, got {group!r}; "
                f"a rank outside a group gets no process group and cannot have a handle for it"
            )
        me = dist.get_rank() if rank is None else int(rank)
        if me not in ranks:
            raise ValueError(f"rank {me} is not a member of {label} with ranks {ranks}; it cannot have a handle for it")
        self._ranks = tuple(ranks)
        self._rank = me
        self._index = ranks.index(me)
        self._name = name
        self._group = group
        # Position in the device group's own order of each member, in handle order.
        group_order = self._member_ranks_of(group, "group")
        position = {r: i for i, r in enumerate(group_order)}
        self._group_pos = [position[r] for r in ranks]
        self._identity_order = group_order == ranks
        self._cpu_group: dist.ProcessGroup | None = None
        self._owns_cpu_group = False
        if cpu_group is not None:
            if not _is_process_group(cpu_group):
                raise TypeError(f"cpu_group of {label} must be a torch.distributed.ProcessGroup, got {cpu_group!r}")
            self._member_ranks_of(cpu_group, "cpu_group")
            self._cpu_group = cpu_group

    def _member_ranks_of(self, group: dist.ProcessGroup, what: str) -> list[int]:
        members = dist.get_process_group_ranks(group)
        if sorted(members) != sorted(self._ranks):
            raise ValueError(
                f"{what} has ranks {members} but the handle{' ' + repr(self._name) if self._name else ''} "
                f"was given ranks {list(self._ranks)}"
            )
        return members

    # ------------------------------------------------------------- topology
    @property
    def name(self) -> str | None:
        """Label of the group (``None`` when none was given)."""
        return self._name

    @property
    def ranks(self) -> list[int]:
        """Global ranks of the members, in the handle's order."""
        return list(self._ranks)

    @property
    def rank(self) -> int:
        """Global rank of the caller."""
        return self._rank

    @property
    def rank_in_group(self) -> int:
        """Position of the caller in :attr:`ranks`."""
        return self._index

    @property
    def size(self) -> int:
        """Number of members."""
        return len(self._ranks)

    world_size = size

    @property
    def first_rank(self) -> int:
        """Global rank of the first member."""
        return self._ranks[0]

    @property
    def last_rank(self) -> int:
        """Global rank of the last member."""
        return self._ranks[-1]

    @property
    def is_first(self) -> bool:
        """Whether the caller is the first member."""
        return self._index == 0

    @property
    def is_last(self) -> bool:
        """Whether the caller is the last member."""
        return self._index == len(self._ranks) - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the member after the caller, wrapping around (a ring)."""
        return self._ranks[(self._index + 1) % len(self._ranks)]

    @property
    def prev_rank(self) -> int:
        """Global rank of the member before the caller, wrapping around (a ring)."""
        return self._ranks[(self._index - 1) % len(self._ranks)]

    def global_rank(self, rank_in_group: int) -> int:
        """Global rank of the member at position ``rank_in_group`` of :attr:`ranks`."""
        if isinstance(rank_in_group, bool) or not isinstance(rank_in_group, int):
            raise TypeError(f"rank_in_group must be an int, got {rank_in_group!r}")
        if not 0 <= rank_in_group < len(self._ranks):
            raise ValueError(f"rank_in_group={rank_in_group} is out of range for a group of size {len(self._ranks)}")
        return self._ranks[rank_in_group]

    def __contains__(self, rank: object) -> bool:
        return rank in self._ranks

    def __len__(self) -> int:
        return len(self._ranks)

    def __repr__(self) -> str:
        label = f"{self._name!r}, " if self._name else ""
        return f"GroupHandle({label}ranks={list(self._ranks)}, rank={self._rank}, rank_in_group={self._index})"

    # --------------------------------------------------------------- groups
    @property
    def group(self) -> dist.ProcessGroup:
        """The device process group."""
        return self._group

    @property
    def has_cpu_group(self) -> bool:
        """Whether a CPU group is already available (given or created)."""
        return self._cpu_group is not None

    @property
    def cpu_group(self) -> dist.ProcessGroup:
        """A gloo group over the same members, for CPU-side synchronization and objects.

        Created on first access with only the members taking part
        (``use_local_synchronization=True``, named by
        :func:`parallel_state_ng.groups.creation.new_member_group`), so every member must reach its
        first access; cached afterwards. Other groups are not affected by which ranks made
        a companion.
        """
        if self._cpu_group is None:
            pg = member_only_group(self._ranks, backend="gloo")
            if not _is_process_group(pg):  # cannot happen for a member; guard the invariant
                raise RuntimeError(f"creating the CPU group of {self!r} returned {pg!r}")
            self._cpu_group = pg
            self._owns_cpu_group = True
        return self._cpu_group

    def destroy(self) -> None:
        """Destroy the CPU group this handle created (the device group belongs to its owner)."""
        pg, owned = self._cpu_group, self._owns_cpu_group
        self._cpu_group, self._owns_cpu_group = None, False
        if owned:
            destroy_groups([pg])

    # ---------------------------------------------------------- collectives
    def _resolve_src(self, group_src: int | None, global_src: int | None) -> int:
        """Global rank of a source given either in handle order or globally."""
        if group_src is not None and global_src is not None:
            raise ValueError(f"give group_src or global_src, not both (got {group_src} and {global_src})")
        if global_src is not None:
            if global_src not in self._ranks:
                raise ValueError(f"global_src={global_src} is not a member of {self!r}")
            return int(global_src)
        return self.global_rank(0 if group_src is None else group_src)

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """Reduce ``tensor`` over the group in place and return it."""
        if self.size > 1:
            dist.all_reduce(tensor, op=op, group=self._group)
        return tensor

    def all_gather(
        self, tensor: torch.Tensor, dim: int = 0, *, as_list: bool = False
    ) -> torch.Tensor | list[torch.Tensor]:
        """Gather ``tensor`` (same shape on every member) from all members, in handle order.

        Returns the chunks concatenated along ``dim``, or with ``as_list=True`` a list of
        one tensor per member.
        """
        if self.size == 1:
            return [tensor] if as_list else tensor
        src = tensor.contiguous()
        flat = src.reshape(1, -1)  # the concatenated output form works on every backend (gloo)
        gathered = torch.empty((self.size, flat.shape[1]), dtype=src.dtype, device=src.device)
        _all_gather_single(gathered, flat, group=self._group)
        stacked = gathered.reshape(self.size, *src.shape)
        if not self._identity_order:
            stacked = stacked[torch.tensor(self._group_pos, device=stacked.device)]
        if as_list:
            return list(stacked.unbind(0))
        if src.dim() == 0:
            return stacked
        d = dim % src.dim()
        shape = list(src.shape)
        shape[d] *= self.size
        return stacked.movedim(0, d).reshape(shape)

    def reduce_scatter(
        self, tensor: torch.Tensor, dim: int = 0, op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> torch.Tensor:
        """Reduce ``tensor`` over the group and return this member's chunk along ``dim``.

        ``tensor.shape[dim]`` must be divisible by :attr:`size`; member ``i`` (handle
        order) gets the ``i``-th chunk of the reduced tensor.
        """
        if tensor.dim() == 0:
            raise ValueError("reduce_scatter needs a tensor with at least one dim, got a scalar")
        d = dim % tensor.dim()
        if tensor.shape[d] % self.size:
            raise ValueError(
                f"reduce_scatter: tensor.shape[{dim}]={tensor.shape[d]} is not divisible by the group size {self.size}"
            )
        if self.size == 1:
            return tensor
        chunk = tensor.shape[d] // self.size
        # (size, *chunk_shape) with chunk i of dim d first
        stacked = tensor.unflatten(d, (self.size, chunk)).movedim(d, 0)
        if not self._identity_order:
            # the device group hands chunk g to its g-th member: put each member's chunk there
            order = [0] * self.size
            for i, g in enumerate(self._group_pos):
                order[g] = i
            stacked = stacked[torch.tensor(order, device=stacked.device)]
        out_shape = stacked.shape[1:]
        flat = stacked.reshape(self.size, -1)  # concatenated input form (gloo rejects stacked)
        out = torch.empty((1, flat.shape[1]), dtype=tensor.dtype, device=tensor.device)
        _reduce_scatter_single(out, flat, op=op, group=self._group)
        return out.reshape(out_shape)

    def broadcast(
        self, tensor: torch.Tensor, *, group_src: int | None = None, global_src: int | None = None
    ) -> torch.Tensor:
        """Broadcast ``tensor`` in place from one member and return it.

        The source is either ``group_src`` (a position in :attr:`ranks`) or ``global_src``
        (a global rank); with neither, the first member. Giving both is an error.
        """
        src = self._resolve_src(group_src, global_src)
        if self.size > 1:
            dist.broadcast(tensor, src=src, group=self._group)
        return tensor

    def broadcast_object(self, obj: Any = None, *, group_src: int | None = None, global_src: int | None = None) -> Any:
        """Send a picklable object from one member to all (over the CPU group); return it.

        The source is chosen as in :meth:`broadcast`; other members' ``obj`` is ignored.
        """
        src = self._resolve_src(group_src, global_src)
        if self.size == 1:
            return obj
        return broadcast_object(obj, src, group=self.cpu_group)  # numpy-free, unlike torch's

    def barrier(self) -> None:
        """Block until every member reaches the barrier (on the CPU group)."""
        if self.size > 1:
            dist.barrier(group=self.cpu_group)

    # -------------------------------------------------------- point to point
    def _p2p_peer(self, peer: int, what: str) -> int:
        if self.size == 1:
            raise ValueError(f"{what}: {self!r} has a single member, there is no other rank to talk to")
        return peer

    def send_next(self, tensor: torch.Tensor) -> dist.Work:
        """Start sending ``tensor`` to :attr:`next_rank`; returns the work (call ``wait()``)."""
        work = dist.isend(tensor, dst=self._p2p_peer(self.next_rank, "send_next"), group=self._group)
        return cast(dist.Work, work)  # None only for a rank outside the group; the caller is a member

    def send_prev(self, tensor: torch.Tensor) -> dist.Work:
        """Start sending ``tensor`` to :attr:`prev_rank`; returns the work (call ``wait()``)."""
        work = dist.isend(tensor, dst=self._p2p_peer(self.prev_rank, "send_prev"), group=self._group)
        return cast(dist.Work, work)  # None only for a rank outside the group; the caller is a member

    def recv_prev(self, tensor: torch.Tensor) -> dist.Work:
        """Start receiving into ``tensor`` from :attr:`prev_rank`; returns the work."""
        work = dist.irecv(tensor, src=self._p2p_peer(self.prev_rank, "recv_prev"), group=self._group)
        return cast(dist.Work, work)  # None only for a rank outside the group; the caller is a member

    def recv_next(self, tensor: torch.Tensor) -> dist.Work:
        """Start receiving into ``tensor`` from :attr:`next_rank`; returns the work."""
        work = dist.irecv(tensor, src=self._p2p_peer(self.next_rank, "recv_next"), group=self._group)
        return cast(dist.Work, work)  # None only for a rank outside the group; the caller is a member
