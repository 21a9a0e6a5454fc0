"""``DeviceMesh`` interop: a torch ``DeviceMesh`` over a grid's existing process groups.

:func:`device_mesh` builds the caller's slice of a grid as a ``DeviceMesh`` with
``DeviceMesh.from_group``, one grid group per mesh dim (a mesh dim may merge several grid
dims), so no new communicator is created; ranks of other slices build their own mesh (SPMD).
:func:`mesh_over_groups` does the math without importing the grid. See docs/engine.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from parallel_state_ng.layout.named_layout import Layout

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["device_mesh", "mesh_over_groups", "mesh_dim_specs", "slice_mesh_ranks", "MeshDimsArg", "HasDeviceMesh"]

MeshDimsArg = str | Sequence[str | Sequence[str]]


class HasDeviceMesh(Protocol):
    """A grid that builds meshes over its own groups, such as
    :class:`~parallel_state_ng.builders.grid.HyperCommGrid` (this module does not import it: the
    grid depends on this module, not the reverse).
    """

    def device_mesh(
        self, dims: MeshDimsArg, device_type: str = "cpu", *, view: str | None = None, create: bool = False
    ) -> DeviceMesh:
        """A ``DeviceMesh`` over the caller's slice of the grid, one grid group per mesh dim."""
        ...


def mesh_dim_specs(layout: Layout, dims: MeshDimsArg) -> tuple[list[tuple[str, ...]], list[str]]:
    """Normalize mesh ``dims`` into one tuple of grid dims per mesh dim, plus the mesh dim names.

    ``dims`` is a grid dim name (a 1-D mesh) or a sequence whose items are a grid dim name or a
    sequence of grid dim names (one merged mesh dim). Each tuple is in layout order; a merged
    dim is named by joining its names, as given, with ``"_"``.

    Raises:
        ValueError: ``dims`` is empty, or a grid dim appears twice.
        UnknownDimError: a name that is not a dim of ``layout``.
    """
    if isinstance(dims, str):
        dims = [dims]
    if isinstance(dims, (bytes,)) or not isinstance(dims, Sequence):
        raise TypeError(f"dims must be a dim name or a sequence of dim names / tuples of names, got {dims!r}")
    if len(dims) == 0:
        raise ValueError("dims must name at least one mesh dim, got an empty sequence")
    specs: list[tuple[str, ...]] = []
    names: list[str] = []
    for item in dims:
        given = (item,) if isinstance(item, str) else tuple(item)
        if not given:
            raise ValueError(f"mesh dim {item!r} in dims {dims!r} names no grid dim")
        specs.append(layout.dims(given))
        names.append("_".join(given))
    layout.dims([d for spec in specs for d in spec])  # a grid dim used twice is an error
    return specs, names


def slice_mesh_ranks(layout: Layout, rank: int, specs: Sequence[Sequence[str]]) -> torch.Tensor:
    """The caller's mesh: an int tensor with one axis per spec, holding global ranks.

    Axis ``k`` runs over the grid dims of ``specs[k]`` (layout order, first fastest); the
    grid dims not in any spec are fixed at ``rank``'s coordinates. Pure layout math.
    """
    # group_array with keep_order puts the first listed dim fastest; the last mesh axis
    # must be fastest in a row-major tensor, so list the specs from last to first.
    order = [d for spec in reversed(specs) for d in spec]
    ranks = layout.group_array(rank, order, keep_order=True)
    sizes = [layout.group_size(spec) for spec in specs]
    return ranks.reshape(sizes).to(torch.int).contiguous()


def mesh_over_groups(
    layout: Layout,
    dims: MeshDimsArg,
    device_type: str,
    group_of: Callable[[list[str]], Any],
) -> DeviceMesh:
    """A ``DeviceMesh`` over the caller's slice of ``layout``, one given group per mesh dim.

    ``group_of(spec)`` returns the process group over the grid dims ``spec`` (a list in layout
    order) that the caller belongs to; it is called once per mesh dim, outermost first, and
    may create the group. Every group's rank order is checked against the mesh.

    Raises:
        ValueError: the caller is outside ``layout``, or a group's rank order does not match
            the layout order of its dims (DTensor would misplace data on such a mesh).
    """
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    if not layout.contains(rank):
        raise ValueError(
            f"rank {rank} is outside the grid (ranks [{layout.rank_offset}, {layout.rank_offset + layout.size})) "
            f"and has no mesh over dims {dims!r}"
        )
    specs, names = mesh_dim_specs(layout, dims)
    mesh = slice_mesh_ranks(layout, rank, specs)
    coord = [layout.rank_in_group(rank, spec) for spec in specs]
    groups = []
    for axis, spec in enumerate(specs):
        pg = group_of(list(spec))
        index: list[int | slice] = list(coord)
        index[axis] = slice(None)
        expected = mesh[tuple(index)].tolist()
        actual = dist.get_process_group_ranks(pg)
        if actual != expected:
            raise ValueError(
                f"mesh dim {names[axis]!r}: the grid's group has ranks in the order {actual}, but the mesh "
                f"needs {expected} (layout order); a DeviceMesh over it would place data wrongly"
            )
        groups.append(pg)
    return DeviceMesh.from_group(groups, device_type, mesh, mesh_dim_names=tuple(names))


def device_mesh(
    grid: HasDeviceMesh,
    dims: MeshDimsArg,
    device_type: str = "cpu",
    *,
    view: str | None = None,
    create: bool = False,
) -> DeviceMesh:
    """A ``DeviceMesh`` over the caller's slice of ``grid``, one existing group per mesh dim.

    The same as ``grid.device_mesh(dims, device_type, view=view, create=create)``.

    Args:
        grid: the grid whose groups the mesh uses.
        dims: mesh dims, outermost first (see :func:`mesh_dim_specs`); a plain list such as
            ``["dp", "tp"]`` is a 2-D mesh (not one group over both, as in ``create_pg``).
        device_type: ``DeviceMesh`` device type (``"cpu"``, ``"cuda"``, ...).
        view: the grid view the dims belong to (``None``: the base view).
        create: the group of each mesh dim must exist already (made by
            ``grid.create_pg``); with ``create=True`` a missing one is created here with
            ``grid.create_pg`` (only the group's members take part), in the order of
            ``dims``. No other group is ever created.

    Returns:
        A mesh with ``mesh_dim_names`` as described in :func:`mesh_dim_specs`;
        ``mesh.get_group(name)`` is the grid's group.

    Raises:
        KeyError: a mesh dim's group was not created and ``create`` is False.
        ValueError: the caller is outside the grid, or a group's rank order does not match
            the layout order of its dims (possible in a composed view, because
            ``new_group`` sorts ranks); DTensor would misplace data on such a mesh.
    """
    return grid.device_mesh(dims, device_type, view=view, create=create)
