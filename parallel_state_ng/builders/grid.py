"""``HyperCommGrid``: named-dim process groups over a :class:`~parallel_state_ng.layout.named_layout.Layout`.

Constructor- and method-compatible with ``megatron.core.hyper_comm_grid.HyperCommGrid`` of every
supported release (0.14 ... 0.19, the superset of their APIs, 0.19's view semantics), creating
only the calling rank's groups; several views of the same ranks live in one grid, and a grid
holds no global state. One release's exact class:
:func:`parallel_state_ng.builders.grid_releases.hyper_comm_grid_class`. See docs/engine.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

from parallel_state_ng.groups.device_mesh import MeshDimsArg, mesh_over_groups
from parallel_state_ng.groups.factory import GroupFactory
from parallel_state_ng.groups.pipeline import agree, check_nvlink_domains
from parallel_state_ng.groups.split import creation_path as resolve_creation_path
from parallel_state_ng.layout.named_layout import DimsArg, Layout, UnknownDimError
from parallel_state_ng.layout.rank_lists import rows_as_lists
from parallel_state_ng.layout.sharing_policy import kind_of_desc

# UnknownDimError: megatron raises ValueError for an unknown name in a list and KeyError for an
# unknown single name in get_pg; this error is both, and re-exported here.
__all__ = ["HyperCommGrid", "BASE_VIEW", "UnknownDimError", "RepeatedDimError", "ViewShapeError"]

BASE_VIEW = "base"

# A group's key: "b-a" (dims in megatron's order) in the base view, (view, ("b", "a")) in
# another view, as megatron 0.19 keys them.
GroupKey = str | tuple[str, tuple[str, ...]]


class RepeatedDimError(ValueError, KeyError, RuntimeError):
    """``dims`` names one dim twice.

    Megatron lets the request through to a failure that depends on release and call
    (einops' ``RuntimeError`` subclass, numpy's ``ValueError``, or ``KeyError`` from
    ``get_pg``); this error is all three.
    """

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class ViewShapeError(TypeError, ValueError):
    """A view's shape holds something that is not an int (``TypeError`` like the grid's own
    shape check, ``ValueError`` like megatron 0.19's ``register_view``).
    """


def _world_size() -> int:
    if "WORLD_SIZE" in os.environ:
        try:
            return int(os.environ["WORLD_SIZE"])
        except ValueError:
            raise ValueError(f"WORLD_SIZE environment variable is not an int: {os.environ['WORLD_SIZE']!r}") from None
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    raise RuntimeError(
        "Cannot determine the world size: set the WORLD_SIZE environment variable or call "
        "torch.distributed.init_process_group() before creating a HyperCommGrid."
    )


def _as_dim_list(dims: DimsArg) -> list[str]:
    if isinstance(dims, str):
        return [dims]
    if not isinstance(dims, Iterable):
        raise TypeError(f"dims must be a dim name or a sequence of dim names, got {dims!r}")
    return list(dims)


def _check_dims(layout: Layout, dims: DimsArg, where: str) -> list[str]:
    """``dims`` as a list, each a dim of ``layout``, none repeated (megatron's order kept)."""
    names = _as_dim_list(dims)
    for name in names:
        if not isinstance(name, str) or name not in layout.names:
            raise UnknownDimError(f"{name!r} is not a dim of {where} (dims {list(layout.names)})")
    if len(set(names)) != len(names):
        raise RepeatedDimError(f"dims {names} name a dim more than once")
    return names


class HyperCommGrid:
    """An N-dimensional grid of ranks with named dims and process groups over any dim subset.

    Args:
        shape: size of each dim.
        dim_names: name of each dim. The first name varies fastest, as in the ``order``
            argument of MCore's ``initialize_model_parallel`` (``["tp", "cp", "dp", "pp"]``
            lays ranks out like ``order="tp-cp-dp-pp"``).
        rank_offset: first global rank of the grid, when it covers only part of the world.
        backend: backend for the groups it creates (``None``: the default backend).
        check_agreement: compare the arguments across all ranks of the world first (every
            rank must construct the grid); a difference raises
            :class:`~parallel_state_ng.groups.agreement.ParallelConfigMismatchError` on every rank
            instead of a hang later. Timeout from ``PSNG_AGREEMENT_TIMEOUT`` (default 60 s).
        creation_path: ``"auto"``, ``"member"`` or ``"split"`` (default ``$PSNG_CREATION_PATH``);
            on the split path every rank of the world calls each ``create_pg`` (docs/results/gpus.md).

    Raises:
        ValueError: ``shape`` and ``dim_names`` differ in length, a name is empty or repeated,
            a size is < 1, ``rank_offset`` < 0.
        TypeError: a size or ``rank_offset`` is not an int.
        RuntimeError: the world size is unknown (no ``WORLD_SIZE``, no process group), or
            the grid does not fit in the world after ``rank_offset``.

    Example:
        >>> grid = HyperCommGrid([2, 2, 2], ["tp", "dp", "pp"])
        >>> tp = grid.create_pg("tp")                 # only this rank's tp group
        >>> dp_pp = grid.create_pg(["dp", "pp"], group_desc="DP_PP")
        >>> grid.register_view("expert", [2, 2, 2], ["ep", "edp", "pp"], shared_dims=["pp"])
        >>> ep = grid.create_pg("ep", view="expert")
        >>> grid.create_pg("pp", view="expert") is grid.get_pg("pp")  # shared: the base group
        True
    """

    def __init__(
        self,
        shape: list[int],
        dim_names: list[str],
        rank_offset: int = 0,
        backend: str | None = None,
        *,
        check_agreement: bool = False,
        creation_path: str | None = None,
    ) -> None:
        agreed = None
        if check_agreement:
            # Before any local validation, so a rank with a different (even invalid) shape
            # still meets the others and every rank gets the mismatch error.
            fields = {"shape": shape, "dim_names": dim_names, "rank_offset": rank_offset, "backend": backend}
            agreed = agree(fields, name="HyperCommGrid", enabled=True, creation=creation_path)
        # Megatron's order of checks: lengths, then the world size, then the rest.
        if hasattr(shape, "__len__") and hasattr(dim_names, "__len__") and len(shape) != len(dim_names):
            raise ValueError(
                f"len(shape) {len(shape)} != len(dim_names) {len(dim_names)}: shape={list(shape)}, "
                f"dim_names={list(dim_names)}"
            )
        world_size = _world_size()
        layout = Layout(shape, dim_names, rank_offset)  # validates shape, names and offset
        if layout.size > world_size - layout.rank_offset:
            raise RuntimeError(
                f"Grid shape {list(layout.sizes)} ({layout.size} ranks) does not fit in world size "
                f"{world_size} with rank offset {layout.rank_offset}"
            )
        if agreed is not None:  # the base view's dims named like group kinds (tp, ep, ...)
            check_nvlink_domains(agreed, {"": layout}, name="HyperCommGrid", rank=dist.get_rank())
        self.rank_offset: int = layout.rank_offset
        self.size: int = layout.size
        self.shape: list[int] = list(layout.sizes)
        self.dim_names: list[str] = list(layout.names)
        self.backend = backend
        self.world_size = world_size
        self._views: dict[str, Layout] = {BASE_VIEW: layout}
        self._shared: dict[str, frozenset[str]] = {BASE_VIEW: frozenset()}
        self._pgs: dict[GroupKey, Any] = {}
        # every create_pg is a request of its own to the grid's factory (settings read per request)
        self._factory = GroupFactory(path=resolve_creation_path(creation_path))

    def _hold_with(self, lease: Any) -> None:
        """Take registry communicators under ``lease`` from now on (a builder's one lease for several grids)."""
        self._factory = GroupFactory(path=self._factory.path, lease=lease)

    # ----------------------------------------------------------------- views
    @property
    def layout(self) -> Layout:
        """The pure layout of the base view."""
        return self._views[BASE_VIEW]

    def view_layout(self, view: str | None = None) -> Layout:
        """The layout of ``view`` (``None``: the base view).

        Raises:
            KeyError: no view of that name is registered.
        """
        name = BASE_VIEW if view is None else view
        try:
            return self._views[name]
        except (KeyError, TypeError):
            raise KeyError(f"unknown view {view!r}; registered views: {list(self._views)}") from None

    @property
    def views(self) -> list[str]:
        """Names of the registered views, the base view first."""
        return list(self._views)

    def shared_dims(self, view: str | None = None) -> list[str]:
        """The dims ``view`` shares with the base view (their groups are the base view's)."""
        self.view_layout(view)
        return sorted(self._shared[BASE_VIEW if view is None else view])

    def register_view(
        self,
        name: str,
        shape: Sequence[int],
        dim_names: Sequence[str],
        shared_dims: Sequence[str] | None = None,
    ) -> Layout:
        """Register another factorization of the same ranks under ``name``.

        ``shape`` must cover exactly the grid's ranks. Each dim in ``shared_dims`` must exist
        in the base view and in the new one with identical groups (same ranks, same order),
        each alone and all together, e.g. ``pp`` shared between the dense layout (tp, cp, dp,
        pp) and the expert layout (etp, ep, edp, pp). A group over shared dims only is the
        base view's group: ``create_pg("pp", view=name)`` creates (or finds already created)
        the group ``get_pg("pp")`` returns. Returns the view's layout.

        Raises:
            ValueError: the name is taken or empty, the shape does not cover the grid's ranks,
                ``shape`` and ``dim_names`` differ in length, a name or a shared dim repeats, a
                size is < 1 (:class:`ViewShapeError`, also a ``TypeError``, for a non-int), a
                shared dim is missing from either view or its groups differ.
        """
        self._check_view_name(name)
        if hasattr(shape, "__len__") and hasattr(dim_names, "__len__") and len(shape) != len(dim_names):
            raise ValueError(f"len(shape) {len(shape)} != len(dim_names) {len(dim_names)} for view {name!r}")
        try:
            layout = Layout(shape, dim_names, self.rank_offset)
        except TypeError as error:
            raise ViewShapeError(f"view {name!r}: {error}") from None
        return self._add_view(name, layout, shared_dims)

    def register_split_view(
        self,
        name: str,
        dims: DimsArg,
        shape: Sequence[int],
        dim_names: Sequence[str],
        *,
        of_view: str | None = None,
    ) -> Layout:
        """Register a view in which ``dims`` of ``of_view`` (taken together) become sub-dims.

        See :meth:`Layout.split`. Every dim that was not split keeps its groups of
        ``of_view``, but the view's groups are its own (nothing is declared shared).
        Used for hierarchical context-parallel groups and partial data-parallel groups.
        """
        self._check_view_name(name)
        parent = self.view_layout(of_view)
        layout = parent.split(dims, shape, dim_names)
        return self._add_view(name, layout, None)

    def _check_view_name(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"view name must be a non-empty str, got {name!r}")
        if name in self._views:
            raise ValueError(f"view {name!r} is already registered")

    def _add_view(self, name: str, layout: Layout, shared_dims: Sequence[str] | None) -> Layout:
        if layout.size != self.size:
            raise ValueError(
                f"view {name!r} has shape {list(layout.sizes)} ({layout.size} ranks) but the grid has {self.size} ranks"
            )
        shared = [] if shared_dims is None else _as_dim_list(shared_dims)
        if len(set(shared)) != len(shared):
            raise ValueError(f"View {name!r} has duplicate shared_dims: {shared}")
        for dim in shared:
            _check_dims(self.layout, dim, "the base view")
            _check_dims(layout, dim, f"view {name!r}")
        for dims in [[dim] for dim in shared] + ([shared] if len(shared) > 1 else []):
            if not self.layout.same_groups(dims, layout):
                what = f"shared dim {dims[0]!r}" if len(dims) == 1 else f"shared dims {dims}"
                raise ValueError(
                    f"{what} of view {name!r} has different groups than in the base view: "
                    f"the first base group is {self.layout.enumerate_groups(dims)[0].tolist()}, "
                    f"the view's is {layout.enumerate_groups(dims)[0].tolist()}"
                )
        self._views[name] = layout
        self._shared[name] = frozenset(shared)
        return layout

    # ------------------------------------------------------- megatron-compatible
    def _order_dims(self, dims: DimsArg, view: str | None = None) -> tuple[list[str], str]:
        """Dims in megatron's key order (reversed dim_names) and their dash-joined key."""
        layout = self.view_layout(view)
        ordered = list(reversed(layout.dims(_check_dims(layout, dims, self._where(view)))))
        return ordered, "-".join(ordered)

    @staticmethod
    def _where(view: str | None) -> str:
        return "the base view" if view in (None, BASE_VIEW) else f"view {view!r}"

    def _group_key(self, dims: DimsArg, view: str | None) -> tuple[GroupKey, Layout]:
        """The key a group over ``dims`` of ``view`` is kept under, and the layout it comes from.

        Dims all shared with the base view resolve to the base view's key and layout.
        """
        layout = self.view_layout(view)
        ordered, key = self._order_dims(dims, view)
        name = BASE_VIEW if view is None else view
        if name == BASE_VIEW or (ordered and set(ordered) <= self._shared[name]):
            return self._order_dims(ordered)[1], self.layout
        return (name, tuple(ordered)), layout

    @staticmethod
    def _describe(key: GroupKey) -> str:
        return key if isinstance(key, str) else f"{key[0]}:{'-'.join(key[1])}"

    def create_pg(self, dims: DimsArg, *, view: str | None = None, all_ranks: bool = False, **kwargs: Any):
        """Create the process group over ``dims`` for the calling rank and return it.

        Only the calling rank's group is computed and created, with
        ``use_local_synchronization=True`` under a name its members agree on (see
        :mod:`parallel_state_ng.groups.creation`); a rank outside the grid makes no call and gets
        ``None``. ``all_ranks=True`` creates every group of the enumeration on every rank
        instead (megatron's collective behaviour). Keyword arguments (``timeout``,
        ``pg_options``, ``group_desc``, ``backend``) go to ``torch.distributed.new_group``.
        In a view, dims all shared with the base view give the base view's group. With group
        sharing on (:mod:`parallel_state_ng.groups.sharing`), dims sets whose groups have the
        same ranks and options share one process group, destroyed once; with
        ``PSNG_SHARE_GROUPS=process`` also with the other layouts of the process (the last
        holder's destroy frees it).

        Raises:
            KeyError: the group over these dims was already created (in this view, or in
                the base view for shared dims); the view is not registered.
            UnknownDimError: a dim is not in the view (a ``ValueError``, ``KeyError`` and
                ``RuntimeError``).
        """
        return self._create_pg(dims, view, all_ranks, kwargs)

    def _create_pg(self, dims: DimsArg, view: str | None, all_ranks: bool, kwargs: dict[str, Any]):
        key, layout = self._group_key(dims, view)
        if key in self._pgs:
            raise KeyError(
                f"Process group {dims} ({self._describe(key)}) has already been created; options cannot "
                f"be compared, so a second create_pg for the same dims is refused. Use get_pg."
            )
        backend = kwargs.pop("backend", self.backend)
        if all_ranks:
            pg = self._factory.every_group(layout.enumerate_groups(dims).tolist(), backend=backend, **kwargs)
        else:
            rank = dist.get_rank()
            ranks = layout.group_ranks(rank, dims) if layout.contains(rank) else None
            pg, _ = self._factory.group(ranks, backend=backend, kind=self._role(key, kwargs), **kwargs)
        self._pgs[key] = pg
        return pg

    def _role(self, key: Any, kwargs: dict[str, Any]) -> str:
        """The role for ``PSNG_SHARE_GROUPS=safe``: a Megatron kind by its ``group_desc``, else the dims."""
        return kind_of_desc(kwargs.get("group_desc")) or f"grid:{self._describe(key)}"

    def get_pg(self, dims: DimsArg, *, view: str | None = None):
        """The process group over ``dims`` made earlier by :meth:`create_pg`.

        Raises:
            KeyError: no group was created for these dims; the view is not registered.
            UnknownDimError: a dim is not in the view.
        """
        return self._get_pg(dims, view)

    def _get_pg(self, dims: DimsArg, view: str | None):
        key, _ = self._group_key(dims, view)
        if key not in self._pgs:
            raise KeyError(f"Process group for {self._describe(key)} hasn't been created. Call create_pg first.")
        return self._pgs[key]

    def adopt_pg(self, dims: DimsArg, group: Any, *, view: str | None = None) -> None:
        """Serve ``group``, created elsewhere for this rank, as the grid's group over ``dims``.

        For grids whose groups another object owns (a topology's modules): :meth:`get_pg`
        returns ``group``; :meth:`destroy` leaves it to its owner. ``None`` only on a rank
        outside the grid.

        Raises:
            KeyError: a group over these dims exists already.
            ValueError: ``group``'s members are not this rank's group over ``dims``.
        """
        key, layout = self._group_key(dims, view)
        if key in self._pgs:
            raise KeyError(f"Process group {dims} ({self._describe(key)}) exists already; cannot adopt another")
        rank = dist.get_rank()
        expected = layout.group_ranks(rank, dims) if layout.contains(rank) else None
        actual = None if group is None else list(dist.get_process_group_ranks(group))
        if (expected is None) != (actual is None) or sorted(actual or []) != sorted(expected or []):
            raise ValueError(
                f"adopt_pg({self._describe(key)}): rank {rank}'s group over these dims is {expected}, "
                f"the group given has ranks {actual}"
            )
        self._pgs[key] = group
        self.__dict__.setdefault("_adopted", set()).add(key)

    def has_pg(self, dims: DimsArg, *, view: str | None = None) -> bool:
        """Whether :meth:`create_pg` was called for ``dims`` (or, for shared dims, the base group)."""
        return self._group_key(dims, view)[0] in self._pgs

    def get_rank_enum(self, dims: DimsArg, *, view: str | None = None) -> list[list[int]]:
        """All groups over ``dims`` of ``view`` as lists of ranks, exactly as megatron enumerates them.

        Built as megatron builds them, an array of ranks then ``tolist()``: at a million ranks
        creating the ints and lists is nearly all the time (``python -m scripts.bench layout``).
        """
        layout = self.view_layout(view)
        return rows_as_lists(layout.enumerate_groups(_check_dims(layout, dims, self._where(view))))

    def _gen_rank_enum(self, dims: Sequence[str]) -> list[list[int]]:
        """All groups over ``dims`` of the base view, each ordered by ``dims`` as given: the
        LAST dim varies fastest (megatron's order; ``get_rank_enum`` normalizes ``dims`` first).

        Megatron's own code (``bridge_communicator``, ``multimodule_communicator``) calls it.
        """
        names = _check_dims(self.layout, dims, "the base view")
        return rows_as_lists(self.layout.enumerate_groups(list(reversed(names)), keep_order=True))

    # ------------------------------------------------------------------ beyond
    def _rank(self, rank: int | None) -> int:
        return dist.get_rank() if rank is None else rank

    def is_current_rank_in_grid(self) -> bool:
        """Whether the calling rank lies inside the grid's block of ranks."""
        return self.layout.contains(dist.get_rank())

    def coord(self, rank: int | None = None, *, view: str | None = None) -> dict[str, int]:
        """Coordinates of ``rank`` (default: the calling rank) in ``view``."""
        return self.view_layout(view).coord(self._rank(rank))

    def group_ranks(self, dims: DimsArg, rank: int | None = None, *, view: str | None = None) -> list[int]:
        """Ranks of the group over ``dims`` that ``rank`` (default: caller) belongs to."""
        return self.view_layout(view).group_ranks(self._rank(rank), dims)

    def rank_in_group(self, dims: DimsArg, rank: int | None = None, *, view: str | None = None) -> int:
        """Position of ``rank`` (default: caller) in its group over ``dims``."""
        return self.view_layout(view).rank_in_group(self._rank(rank), dims)

    def destroy(self) -> None:
        """Destroy every process group this grid created (and its handles' CPU groups), not adopted ones."""
        for handle in self.__dict__.pop("_handles", {}).values():
            handle.destroy()
        pgs, self._pgs = self._pgs, {}
        adopted = self.__dict__.pop("_adopted", set())
        # forget the destroyed groups: a later create_pg makes new ones, through a new factory
        factory, self._factory = self._factory, GroupFactory(path=self._factory.path)
        factory.destroy([pg for key, pg in pgs.items() if key not in adopted])

    def __repr__(self) -> str:
        return f"HyperCommGrid({self.layout!r}, views={self.views}, groups={list(self._pgs)})"

    # ------------------------------------------------------- handles and meshes
    def group(self, dims: DimsArg, *, view: str | None = None, cpu: bool = False, create: bool = False):
        """A :class:`~parallel_state_ng.groups.handles.GroupHandle` for the caller's group over ``dims``.

        The handle wraps the group made by :meth:`create_pg` (``create=True`` makes it first
        when missing) and is cached: the same handle comes back while that group lives.
        ``cpu=True`` also creates its gloo companion now (a call every member must make).
        The companion is destroyed by the handle's ``destroy()`` and by :meth:`destroy`.

        Raises:
            KeyError: the group was not created (and ``create`` is False), as :meth:`get_pg`.
            ValueError: the caller is outside the grid.
        """
        from parallel_state_ng.groups.handles import GroupHandle

        if create and not self.has_pg(dims, view=view):
            self._create_pg(dims, view, False, {})
        pg = self._get_pg(dims, view)
        key, _ = self._group_key(dims, view)
        name = self._describe(key)
        if pg is None:
            raise ValueError(f"rank {dist.get_rank()} is outside the grid and has no group over {name!r}")
        handles = self.__dict__.setdefault("_handles", {})
        handle = handles.get(key)
        if handle is None or handle.group is not pg:
            handle = handles[key] = GroupHandle(self.group_ranks(dims, view=view), pg, name=name)
        if cpu:
            _ = handle.cpu_group  # the property creates the gloo companion now
        return handle

    def device_mesh(
        self, dims: MeshDimsArg, device_type: str = "cpu", *, view: str | None = None, create: bool = False
    ):
        """A ``torch`` ``DeviceMesh`` over the caller's slice of the grid, on the grid's groups.

        See :func:`parallel_state_ng.groups.device_mesh.device_mesh`: one mesh dim per item of ``dims``
        (a dim name, or a tuple of names for a merged dim), ``mesh_dim_names`` the dims, no
        new communicator; each dim's group must exist unless ``create=True`` (then a missing
        one is created, as :meth:`create_pg`, in the order of ``dims``).
        """

        def group_of(spec: list[str]) -> dist.ProcessGroup | None:
            if create and not self.has_pg(spec, view=view):
                self._create_pg(spec, view, False, {})
            return self._get_pg(spec, view)  # not get_pg: a release's class may lack ``view=``

        return mesh_over_groups(self.view_layout(view), dims, device_type, group_of)
