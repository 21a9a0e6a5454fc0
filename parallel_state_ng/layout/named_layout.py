"""Pure rank-layout math: named dims, coordinates and groups.

A :class:`Layout` lays named dims over ranks ``[rank_offset, rank_offset + size)`` in
Megatron-Core's ``order`` convention (the first name varies fastest); groups and enumerations
equal MCore's ``RankGenerator.get_ranks``, one rank's group in O(group size). A layout can be
*split* into named sub-dims (hierarchical context parallel, partial data parallel). No
``torch.distributed``. See docs/engine.md ("Layouts: pure rank math").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

from parallel_state_ng.layout.bounded_input import MAX_RANK
from parallel_state_ng.layout.rank_lists import plain_rank_enum
from parallel_state_ng.layout.shape_checks import check_int, validate_dims

if TYPE_CHECKING:  # the tensor methods import torch when called: the rank math does not need it
    import torch

DimsArg = str | Sequence[str]

__all__ = ["Layout", "UnknownDimError", "validate_dims", "DimsArg"]


class UnknownDimError(ValueError, KeyError, RuntimeError):
    """A dim name that the layout does not have.

    Megatron's ``HyperCommGrid`` raises a different type for this mistake depending on the
    call: ``ValueError`` for an unknown name in a list, ``KeyError`` for an unknown single
    name in ``get_pg``, and einops' ``RuntimeError`` subclass in ``create_pg``. This error is
    all three, so code written against megatron catches it wherever it did.
    """

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class Layout:
    """Named dims over a contiguous block of ranks (pure math, immutable).

    A group over a subset ``S`` of dims is the ranks that agree on every dim outside ``S``;
    enumerations number groups by the dims outside ``S`` and list each group's ranks by the
    dims inside ``S`` (first fastest both times), as ``RankGenerator.get_ranks`` does.

    Args:
        shape: size of each dim.
        dim_names: name of each dim; the first varies fastest (MCore ``order`` convention).
        rank_offset: first rank of the block.

    Example:
        >>> lay = Layout([2, 2, 2], ["tp", "dp", "pp"])
        >>> lay.enumerate_groups("dp").tolist()
        [[0, 2], [1, 3], [4, 6], [5, 7]]
        >>> lay.group_ranks(5, ["dp", "pp"])
        [1, 3, 5, 7]
    """

    def __init__(self, shape: Sequence[int], dim_names: Sequence[str], rank_offset: int = 0) -> None:
        sizes, names = validate_dims(shape, dim_names)
        offset = check_int(rank_offset, "rank_offset", minimum=0)
        if offset + math.prod(sizes) > MAX_RANK:
            raise ValueError(f"rank_offset {offset} + {math.prod(sizes)} ranks is over the limit of {MAX_RANK} (2**62)")
        self._init(sizes, names, offset)
        self._set_parent(None, (), ())

    def _set_parent(self, parent: Layout | None, merged: tuple[str, ...], parts: tuple[str, ...]) -> None:
        self._parent = parent
        self._merged = merged  # parent dims replaced by this layout's sub-dims
        self._parts = parts
        self._parts_set = frozenset(parts)
        self._part_stride: dict[str, int] = {}
        acc = 1
        for name in parts:
            self._part_stride[name] = acc
            acc *= self.size_of(name)

    def _init(self, sizes: tuple[int, ...], names: tuple[str, ...], rank_offset: int) -> None:
        self.sizes = sizes
        self.names = names
        self.rank_offset = rank_offset
        self.size = math.prod(sizes)
        self._pos = {n: i for i, n in enumerate(names)}
        strides, acc = [], 1
        for s in sizes:
            strides.append(acc)
            acc *= s
        self._strides = tuple(strides)

    # ------------------------------------------------------------------ basics
    @property
    def shape(self) -> list[int]:
        """Sizes of the dims, in order."""
        return list(self.sizes)

    @property
    def dim_names(self) -> list[str]:
        """Names of the dims, in order (first varies fastest)."""
        return list(self.names)

    @property
    def is_plain(self) -> bool:
        """True when ranks are a plain mixed-radix number of the coordinates."""
        return self._parent is None

    def size_of(self, name: str) -> int:
        """Size of dim ``name``."""
        return self.sizes[self._index(name)]

    def _index(self, name: str) -> int:
        try:
            return self._pos[name]
        except (KeyError, TypeError):
            raise UnknownDimError(f"unknown dim {name!r}; this layout has dims {list(self.names)}") from None

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True))
        off = f", rank_offset={self.rank_offset}" if self.rank_offset else ""
        return f"Layout({dims}{off})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return (
            self.names == other.names
            and self.sizes == other.sizes
            and self.rank_offset == other.rank_offset
            and self._parent == other._parent
            and self._merged == other._merged
        )

    def __hash__(self) -> int:
        return hash((self.names, self.sizes, self.rank_offset, self._merged))

    def shifted(self, rank_offset: int) -> Layout:
        """This layout on the ranks from ``rank_offset``: equal to one built there.

        A split layout moves with its parent. O(number of dims): only the new offset is checked
        (``ValueError`` below 0 or past the rank limit).
        """
        offset = check_int(rank_offset, "rank_offset", minimum=0)
        if offset + self.size > MAX_RANK:
            raise ValueError(f"rank_offset {offset} + {self.size} ranks is over the limit of {MAX_RANK} (2**62)")
        out = Layout.__new__(Layout)
        out.__dict__.update(self.__dict__)  # sizes, names, strides, parts: shared (never changed)
        out.rank_offset = offset
        if self._parent is not None:
            out._parent = self._parent.shifted(offset)
        return out

    def dims(self, dims: DimsArg, *, keep_order: bool = False) -> tuple[str, ...]:
        """Validate ``dims`` (a name or a sequence of names) and return them as a tuple.

        By default the names are put in layout order (the normalization MCore applies);
        with ``keep_order=True`` they stay as given. Unknown names raise
        :class:`UnknownDimError`, repeated names ``ValueError``.
        """
        if isinstance(dims, str):
            dims = (dims,)
        elif type(dims) not in (list, tuple) and not isinstance(dims, Iterable):
            raise TypeError(f"dims must be a dim name or a sequence of dim names, got {dims!r}")
        dims = tuple(dims)
        idx = [self._index(d) for d in dims]
        if len(set(idx)) != len(idx):
            raise ValueError(f"dims {list(dims)} repeat a name")
        if keep_order:
            return dims
        return tuple(self.names[i] for i in sorted(idx))

    # -------------------------------------------------------------- coordinates
    def contains(self, rank: int) -> bool:
        """Whether ``rank`` lies in this layout's block of ranks."""
        return self.rank_offset <= rank < self.rank_offset + self.size

    def _check_rank(self, rank: int) -> int:
        rank = check_int(rank, "rank", minimum=0)
        if not self.contains(rank):
            raise ValueError(
                f"rank {rank} is outside this layout's ranks [{self.rank_offset}, {self.rank_offset + self.size})"
            )
        return rank

    def coord(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank``, one int per dim."""
        rank = self._check_rank(rank)
        if self._parent is None:
            local = rank - self.rank_offset
            return {n: (local // st) % s for n, s, st in zip(self.names, self.sizes, self._strides, strict=True)}
        pc = self._parent.coord(rank)
        merged_index, mult = 0, 1
        for name in self._merged:
            merged_index += pc[name] * mult
            mult *= self._parent.size_of(name)
        out = {}
        for name in self.names:
            if name in self._parts_set:
                out[name] = (merged_index // self._part_stride[name]) % self.size_of(name)
            else:
                out[name] = pc[name]
        return out

    def rank(self, coord: Mapping[str, int]) -> int:
        """The rank at ``coord`` (a mapping with one coordinate per dim)."""
        missing = [n for n in self.names if n not in coord]
        extra = [n for n in coord if n not in self._pos]
        if missing or extra:
            raise ValueError(f"coord must give exactly the dims {list(self.names)}; missing {missing}, unknown {extra}")
        for n in self.names:
            c = check_int(coord[n], f"coord[{n!r}]", minimum=0)
            if c >= self.size_of(n):
                raise ValueError(f"coord[{n!r}]={c} is out of range for size {self.size_of(n)}")
        return int(self._eval(dict(coord)))

    def _eval(self, coord: Mapping[str, int | torch.Tensor]) -> int | torch.Tensor:
        """Ranks for (broadcastable tensor or int) coordinates; the vectorized core."""
        if self._parent is None:
            total: int | torch.Tensor = self.rank_offset
            for n, st in zip(self.names, self._strides, strict=True):
                c = coord[n]
                if st != 1:
                    c = c * st
                total = total + c
            return total
        merged_index: int | torch.Tensor = 0
        for name in self._parts:
            merged_index = merged_index + coord[name] * self._part_stride[name]
        pc = {n: coord[n] for n in self.names if n not in self._parts_set}
        div = 1
        for name in self._merged:
            s = self._parent.size_of(name)
            pc[name] = (merged_index // div) % s
            div *= s
        return self._parent._eval(pc)

    # ------------------------------------------------------------------- groups
    def group_size(self, dims: DimsArg) -> int:
        """Number of ranks in each group over ``dims``."""
        return math.prod(self.size_of(d) for d in self.dims(dims))

    def num_groups(self, dims: DimsArg) -> int:
        """Number of groups over ``dims``."""
        return self.size // self.group_size(dims)

    def group_array(self, rank: int, dims: DimsArg, *, keep_order: bool = False) -> torch.Tensor:
        """Like :meth:`group_ranks` but returns a 1-D int64 tensor."""
        import torch

        dims = self.dims(dims, keep_order=keep_order)
        # a fresh dict of ints, whose entries for ``dims`` become tensors below
        coord = cast("dict[str, int | torch.Tensor]", self.coord(rank))
        k = len(dims)
        if k == 0:
            return torch.tensor([rank], dtype=torch.int64)
        full = []
        for j, name in enumerate(dims):
            s = self.size_of(name)
            shp = [1] * k
            shp[k - 1 - j] = s  # first dim on the last (fastest) axis
            coord[name] = torch.arange(s, dtype=torch.int64).reshape(shp)
            full.append(s)
        ranks = self._eval(coord)
        return torch.as_tensor(ranks).expand(tuple(reversed(full))).reshape(-1)

    def group_ranks(self, rank: int, dims: DimsArg, *, keep_order: bool = False) -> list[int]:
        """The ranks of ``rank``'s group over ``dims``, in MCore order, in O(group size).

        With ``keep_order=True`` the group is ordered by ``dims`` as given (first fastest)
        instead of by layout order.
        """
        dims = self.dims(dims, keep_order=keep_order)
        if self._parent is not None:
            return self.group_array(rank, dims, keep_order=True).tolist()
        # Plain layout: rank = offset + sum(coord * stride). Built with list arithmetic, no
        # tensors: a few microseconds for small groups, and no slower than tensor + tolist()
        # for a million ranks (the Python ints must be created either way).
        inside = set(dims)
        coord = self.coord(rank)
        base = self.rank_offset
        for name, stride in zip(self.names, self._strides, strict=True):
            if name not in inside:
                base += coord[name] * stride
        return [base + step for step in self._plain_steps(dims)]

    def _plain_steps(self, dims: Sequence[str]) -> list[int]:
        """A plain layout's rank steps over every coordinate of ``dims``, the first varying fastest."""
        steps = [0]
        for name in dims:
            i = self._pos[name]
            steps = [s + r for s in range(0, self.sizes[i] * self._strides[i], self._strides[i]) for r in steps]
        return steps

    def rank_in_group(self, rank: int, dims: DimsArg, *, keep_order: bool = False) -> int:
        """Position of ``rank`` in its group over ``dims`` (O(number of dims))."""
        coord = self.coord(rank)
        pos, mult = 0, 1
        for name in self.dims(dims, keep_order=keep_order):
            pos += coord[name] * mult
            mult *= self.size_of(name)
        return pos

    def group_index(self, rank: int, dims: DimsArg) -> int:
        """Index of ``rank``'s group in :meth:`enumerate_groups` over ``dims``."""
        inside = set(self.dims(dims))
        coord = self.coord(rank)
        pos, mult = 0, 1
        for name, s in zip(self.names, self.sizes, strict=True):
            if name not in inside:
                pos += coord[name] * mult
                mult *= s
        return pos

    def group_at(self, index: int, dims: DimsArg) -> list[int]:
        """Group ``index`` of :meth:`enumerate_groups` over ``dims`` (inverse of :meth:`group_index`).

        O(group size); ``IndexError`` for an index outside ``[0, num_groups(dims))``.
        """
        inside = set(self.dims(dims))
        count = self.num_groups(dims)
        if not 0 <= index < count:
            raise IndexError(f"group index {index} is out of range: {count} groups over {list(self.dims(dims))}")
        coord, rest = {}, index
        for name, s in zip(self.names, self.sizes, strict=True):
            if name in inside:
                coord[name] = 0
            else:
                coord[name] = rest % s
                rest //= s
        return self.group_ranks(self.rank(coord), dims)

    def enumerate_groups(self, dims: DimsArg, *, keep_order: bool = False) -> torch.Tensor:
        """All groups over ``dims`` as an int64 tensor of shape (num_groups, group_size).

        Row ``g`` is group ``g`` in exactly the order of MCore's ``RankGenerator.get_ranks``
        and megatron's ``HyperCommGrid.get_rank_enum``. Vectorized: O(size) tensor work.
        """
        import torch

        inside = self.dims(dims, keep_order=keep_order)
        outside = tuple(n for n in self.names if n not in set(inside))
        axes = list(reversed(outside)) + list(reversed(inside))  # last axis fastest
        k = len(axes)
        gsize = math.prod(self.size_of(n) for n in inside)
        if self._parent is None:
            # A plain layout's ranks are consecutive with the first dim fastest: one arange,
            # viewed with the last dim outermost and permuted into the enumeration's axes.
            position = {name: k - 1 - i for i, name in enumerate(self.names)}
            ranks = torch.arange(self.rank_offset, self.rank_offset + self.size, dtype=torch.int64)
            ranks = ranks.reshape(tuple(reversed(self.sizes))).permute([position[n] for n in axes])
            return ranks.reshape(self.size // gsize, gsize)
        coord: dict[str, int | torch.Tensor] = {}
        full = []
        for a, name in enumerate(axes):
            s = self.size_of(name)
            shp = [1] * k
            shp[a] = s
            coord[name] = torch.arange(s, dtype=torch.int64).reshape(shp)
            full.append(s)
        ranks = torch.as_tensor(self._eval(coord)).expand(tuple(full))
        return ranks.reshape(self.size // gsize, gsize)

    def rank_enum(self, dims: DimsArg) -> list[list[int]]:
        """:meth:`enumerate_groups` as nested lists (the shape megatron returns).

        A plain layout's come from :func:`~parallel_state_ng.layout.rank_lists.plain_rank_enum`,
        without torch (which the command line need not import); a split layout's from
        :meth:`enumerate_groups`.
        """
        if self._parent is not None:
            return self.enumerate_groups(dims).tolist()
        return plain_rank_enum(self.sizes, self.names, self.rank_offset, self.dims(dims))

    # ---------------------------------------------------------- comparing layouts
    def _runs(self, dims: Iterable[str]) -> tuple[tuple[bool, int], ...]:
        """Canonical form of the partition over ``dims`` (plain layouts only).

        Dims of size 1 are dropped and neighbours on the same side (inside / outside
        ``dims``) are merged. Two plain layouts of equal size and offset produce the same
        enumeration over their dims iff these runs are equal.
        """
        inside = set(dims)
        runs: list[list] = []
        for name, s in zip(self.names, self.sizes, strict=True):
            if s == 1:
                continue
            flag = name in inside
            if runs and runs[-1][0] == flag:
                runs[-1][1] *= s
            else:
                runs.append([flag, s])
        return tuple((f, s) for f, s in runs)

    def same_groups(self, dims: DimsArg, other: Layout, other_dims: DimsArg | None = None) -> bool:
        """Whether ``other`` has exactly the same groups (and orders) over its dims.

        For two plain layouts this is O(number of dims); otherwise both enumerations are
        compared (vectorized, O(size)).
        """
        mine = self.dims(dims)
        theirs = other.dims(mine if other_dims is None else other_dims)
        if self.size != other.size or self.rank_offset != other.rank_offset:
            return False
        if self.is_plain and other.is_plain:
            return self._runs(mine) == other._runs(theirs)
        return self.enumerate_groups(mine).equal(other.enumerate_groups(theirs))

    # -------------------------------------------------------------------- split
    def split(self, dims: DimsArg, shape: Sequence[int], dim_names: Sequence[str]) -> Layout:
        """Re-express ``dims`` (taken together, in layout order) as named sub-dims.

        The merged index of ``dims`` (first fastest) is decomposed over ``shape`` (first
        fastest). The sub-dims take the place of the first of ``dims``; every other dim is
        kept. Example: with ``cp`` of size 8, ``split("cp", [2, 4], ["cp0", "cp1"])`` gives
        the level-0 and level-1 hierarchical context-parallel dims; with ``dp`` and ``cp``
        taken together, ``split(["cp", "dp"], [intra, n], ["intra", "inter"])`` gives the
        partial data-parallel groups (contiguous chunks of each dp-cp group). Adjacent split
        dims give a plain mixed-radix layout; otherwise a composed layout evaluates ranks
        through its parent.
        """
        merged = self.dims(dims)
        if not merged:
            raise ValueError("split needs at least one dim to split")
        sizes, names = validate_dims(shape, dim_names)
        total = math.prod(self.size_of(d) for d in merged)
        if math.prod(sizes) != total:
            raise ValueError(
                f"split shape {list(sizes)} has product {math.prod(sizes)}, but dims "
                f"{list(merged)} have {total} ranks together"
            )
        kept = [n for n in self.names if n not in set(merged)]
        clash = [n for n in names if n in set(kept)]
        if clash:
            raise ValueError(f"split dim_names {clash} already name other dims of {self}")
        first = self._pos[merged[0]]
        new_names: list[str] = []
        new_sizes: list[int] = []
        for i, (n, s) in enumerate(zip(self.names, self.sizes, strict=True)):
            if i == first:
                new_names.extend(names)
                new_sizes.extend(sizes)
            if n not in set(merged):
                new_names.append(n)
                new_sizes.append(s)
        positions = [self._pos[d] for d in merged]
        adjacent = all(
            self.sizes[i] == 1 or self.names[i] in set(merged) for i in range(positions[0], positions[-1] + 1)
        )
        if self.is_plain and adjacent:
            return Layout(new_sizes, new_names, self.rank_offset)
        out = Layout.__new__(Layout)
        out._init(tuple(new_sizes), tuple(new_names), self.rank_offset)
        out._set_parent(self, merged, names)
        return out
