"""Where a group sits in the layout: its kinds, coordinates and ranks, read from its description.

A group's ``group_desc`` names its kind (Megatron's own strings, :data:`GROUP_KINDS`; a shared
group ``A+B`` names all its kinds, :func:`~parallel_state_ng.layout.sharing_policy.kinds_of_desc`).
The description carries no coordinates, on purpose: it stays the string Megatron-Core writes,
so dumps of MCore-created and project-created jobs read alike. The coordinates follow without
guessing from the kind and any one member rank: the rank is in exactly one group of each kind,
and that group's fixed coordinates are the rank's coordinates along the dims the kind does not
span. Only the ranks in question are placed (no loop over the world).

When a description names several kinds whose groups differ on that rank (Megatron gives the
partial expert-data-parallel groups the description of the full one), the members a source
reports (torch's ``pg_config`` on NCCL) pick the kind; without them every candidate is named.
Under the process-wide registry several layouts may hold one group: a :class:`Placer` over
several named layouts names each layout whose group of the kind has those ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from parallel_state_ng.layout.kinds import token_kind_dims
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.sharing_policy import kinds_of_desc

__all__ = ["KindPlace", "GroupPlace", "Placer", "coordinates_text"]


def coordinates_text(coords: Mapping[str, int]) -> str:
    """``pp=1 dp=0`` (``-`` for a group that spans the whole layout)."""
    return " ".join(f"{d}={v}" for d, v in coords.items()) or "-"


@dataclass(frozen=True)
class KindPlace:
    """One kind a group serves, in one layout: the fixed coordinates and the members there."""

    kind: str
    layout: str
    coords: Mapping[str, int]
    ranks: tuple[int, ...]

    def text(self) -> str:
        """``dp at tp=1 pp=0`` (``[layout] `` first when named)."""
        where = f"[{self.layout}] " if self.layout else ""
        return f"{where}{self.kind} at {coordinates_text(self.coords)}"


@dataclass(frozen=True)
class GroupPlace:
    """A group as the report names it: torch's name, its description, kinds and ranks."""

    group: str
    desc: str
    kinds: tuple[KindPlace, ...]
    ranks: tuple[int, ...] | None

    @property
    def kind_names(self) -> str:
        """``dp`` / ``tp+ep_tp`` / the description when it names no kind (``default_pg``)."""
        names = list(dict.fromkeys(k.kind for k in self.kinds))
        return "+".join(names) if names else (self.desc or f"group {self.group}")

    def text(self) -> str:
        """``dp (DATA_PARALLEL_GROUP) at tp=1 pp=0, ranks [1, 3]``."""
        where = "; ".join(k.text() for k in self.kinds) or self.kind_names
        desc = f" ({self.desc})" if self.desc and self.kinds else ""
        ranks = f", ranks {list(self.ranks)}" if self.ranks is not None else ""
        return f"{where}{desc}{ranks}"


class Placer:
    """Places groups in one or several layouts (each rank's groups computed on request, cached).

    Args:
        layouts: a :class:`MegatronLayout`, or ``{name: layout}`` for several (the registry's
            layouts), or ``None`` (kinds read from descriptions, no coordinates).
    """

    def __init__(self, layouts: MegatronLayout | Mapping[str, MegatronLayout] | None) -> None:
        if layouts is None:
            self.layouts: dict[str, MegatronLayout] = {}
        elif isinstance(layouts, MegatronLayout):
            self.layouts = {"": layouts}
        elif isinstance(layouts, Mapping) and all(isinstance(v, MegatronLayout) for v in layouts.values()):
            self.layouts = dict(layouts)
        else:
            raise ValueError(f"layouts must be a MegatronLayout, a mapping of them or None, got {layouts!r}")

    def _one(self, name: str, layout: MegatronLayout, kind: str, rank: int) -> KindPlace | None:
        try:
            members = layout.group(kind, rank)
        except KeyError:
            return None
        if members is None:
            return None
        dims = token_kind_dims(bool(layout.facts.gtp_remat_axis)).get(kind)
        if dims is None:  # a derived kind: the rank's dense coordinates name where it is
            coords = {d: v for d, v in layout.decoder.coord(rank).items() if layout.decoder.size_of(d) > 1}
        else:
            view, spanned = dims
            grid = layout.decoder if view == "dense" else layout.expert
            coords = {d: v for d, v in grid.coord(rank).items() if d not in spanned and grid.size_of(d) > 1}
        return KindPlace(kind, name, coords, tuple(members))

    def place(self, group: str, desc: str, rank: int, ranks: Sequence[int] | None = None) -> GroupPlace:
        """The place of ``group`` (description ``desc``) as seen by its member ``rank``.

        ``ranks``: the members the source reports, if any; they pick among candidates and are
        checked against the layout (a disagreement keeps the reported members and names no
        kind for that layout).
        """
        known = tuple(ranks) if ranks is not None else None
        found: list[KindPlace] = []
        for kind in kinds_of_desc(desc):
            for name, layout in self.layouts.items():
                spot = self._one(name, layout, kind, rank)
                if spot is not None and (known is None or sorted(spot.ranks) == sorted(known)):
                    found.append(spot)
        if not self.layouts:
            found = [KindPlace(kind, "", {}, known or ()) for kind in kinds_of_desc(desc)]
        members = known if known is not None else (found[0].ranks if found else None)
        return GroupPlace(group, desc, tuple(found), members)

    def rank_coords(self, rank: int) -> str:
        """``tp=1 pp=0 dp=1`` of ``rank`` in the first layout (dense; ``ep`` added when > 1)."""
        for layout in self.layouts.values():
            if not layout.contains(rank):
                continue
            coords = {d: v for d, v in layout.decoder.coord(rank).items() if layout.decoder.size_of(d) > 1}
            if layout.expert_model_parallel_size > 1:
                coords["ep"] = layout.expert.coord(rank)["ep"]
            return coordinates_text(coords)
        return ""
