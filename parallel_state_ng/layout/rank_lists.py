"""Every group of a plain layout as nested lists of ranks, built by C-level iteration.

:func:`plain_rank_enum` is :meth:`~parallel_state_ng.layout.named_layout.Layout.rank_enum` of a
plain (unsplit) layout: no torch, and no Python-level loop per rank. The cost of a million
ranks is creating a million ints and the group lists; everything else is a loop over blocks.

The dims are first reduced to *runs*: dims of size 1 are dropped and neighbours on the same
side (inside or outside the group) are merged, so a run is one arithmetic progression of rank
steps. Three cases, by how the runs lie:

* every run inside the group comes before every run outside it: the enumeration is the ranks
  in order, cut into groups (``zip`` over one iterator);
* otherwise, when the widest run outside is at least as long as the first run inside: one
  ``range`` per member along that run, and ``zip`` turns those rows into groups (placed at
  their enumeration index);
* otherwise: the ranks in enumeration order as a chain of progressions over the first run
  inside, cut into groups.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, repeat
from typing import Any

__all__ = ["plain_rank_enum", "rows_as_lists"]

#: ``(size, stride)`` of one run: ``size`` consecutive rank steps of ``stride``.
Run = tuple[int, int]


def _runs(sizes: Sequence[int], names: Sequence[str], inside: Iterable[str]) -> list[tuple[bool, int, int]]:
    """``(inside?, size, stride)`` per run, fastest first (size-1 dims dropped, sides merged)."""
    members = set(inside)
    runs: list[tuple[bool, int, int]] = []
    stride = 1
    for name, size in zip(names, sizes, strict=True):
        if size == 1:
            continue
        flag = name in members
        if runs and runs[-1][0] == flag:
            runs[-1] = (flag, runs[-1][1] * size, runs[-1][2])
        else:
            runs.append((flag, size, stride))
        stride *= size
    return runs


def _offsets(base: int, runs: Sequence[Run]) -> list[int]:
    """``base`` plus every combination of steps along ``runs``, the first run varying fastest."""
    out = [base]
    for size, stride in runs:
        out = [a + c for c in range(0, size * stride, stride) for a in out]
    return out


def _cut(ranks: Iterator[int], group: int, total: int) -> list[list[int]]:
    """``total`` ranks from ``ranks`` cut into consecutive groups of ``group``."""
    if group == total:
        return [list(ranks)]
    return list(map(list, zip(*[ranks] * group, strict=False)))


def plain_rank_enum(
    sizes: Sequence[int], names: Sequence[str], rank_offset: int, inside: Sequence[str]
) -> list[list[int]]:
    """All groups over ``inside`` of the plain layout ``(sizes, names, rank_offset)``, as lists.

    Groups are numbered by the dims outside ``inside`` and each lists its ranks by the dims
    inside, the first dim fastest both times (the order of ``enumerate_groups``).
    """
    runs = _runs(sizes, names, inside)
    total = math.prod(sizes)
    ins = [(size, stride) for flag, size, stride in runs if flag]
    outs = [(size, stride) for flag, size, stride in runs if not flag]
    group = math.prod(size for size, _ in ins)
    if [flag for flag, _, _ in runs] == sorted((flag for flag, _, _ in runs), reverse=True):
        return _cut(iter(range(rank_offset, rank_offset + total)), group, total)
    first_size, first_stride = ins[0]
    widest = max(range(len(outs)), key=lambda i: outs[i][0])
    width, step = outs[widest]
    if width >= first_size:
        # Each outside combination but the widest run's: its groups along that run, placed
        # ``stride`` apart in the enumeration (the index step of the widest run).
        bases, indices, count = [rank_offset], [0], 1
        stride = 1
        for i, (size, rank_stride) in enumerate(outs):
            if i == widest:
                stride = count
            else:
                bases = [a + c for c in range(0, size * rank_stride, rank_stride) for a in bases]
                indices = [a + c for c in range(0, size * count, count) for a in indices]
            count *= size
        steps = _offsets(0, ins)
        span = width * step
        out: list[list[int]] = [[]] * count
        for base, index in zip(bases, indices, strict=True):
            rows = [range(base + s, base + s + span, step) for s in steps]
            out[index : index + width * stride : stride] = map(list, zip(*rows, strict=True))
        return out
    starts = _offsets(0, ins[1:])
    starts = [first + s for first in _offsets(rank_offset, outs) for s in starts]
    span = first_size * first_stride
    progressions = map(range, starts, [start + span for start in starts], repeat(first_stride))
    return _cut(chain.from_iterable(progressions), group, total)


def rows_as_lists(groups: Any) -> list[list[int]]:
    """The rows of a 2-D tensor of ranks as lists of ints, through numpy where torch has it.

    At a million ranks, creating the ints and lists is nearly all the time of an enumeration;
    numpy's ``tolist`` does it a few percent faster than torch's (``python -m scripts.bench
    layout``). A torch built without numpy falls back to its own.
    """
    try:
        return groups.numpy().tolist()
    except RuntimeError:  # "Numpy is not available"
        return groups.tolist()
