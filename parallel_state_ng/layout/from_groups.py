"""A Megatron layout read back from one rank's groups: :func:`infer_layout`.

Given the member lists of the groups one rank holds, by ``ProcessGroupCollection`` field, it
finds the sizes (from the group sizes and the world size), checks the products a real Megatron
layout has (``mp`` = tp × pp, ``tp_cp`` = tp × cp, ``dp_cp`` = dp × cp, ``tp_ep`` = expt_tp ×
ep, ...) and finds the ``order`` under which :class:`MegatronLayout`'s groups for this rank are
the given ones. Only this rank's groups are computed (O(sum of group sizes) per candidate
order, at most 120 orders): nothing loops over the world. Pure: no ``torch.distributed``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from parallel_state_ng.layout.kinds import fills
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.order import DEFAULT_ORDER

__all__ = ["FIELD_KINDS", "FIELD_SIZES", "InconsistentCollectionError", "InferredLayout", "infer_sizes", "infer_layout"]

#: ``ProcessGroupCollection`` field -> the group kind it holds (from the group-kind table), plus
#: the 0.18+ all-gather fields, which no module global fills.
FIELD_KINDS: dict[str, str] = {
    **{fill.collection: kind.name for kind, fill in fills() if fill.collection},
    "dp_cp_ag": "dp_cp_ag",
    "expt_dp_ag": "ep_dp_ag",
}

#: Field -> its size as a product of layout sizes (exponent -1: divided by it). ``n`` is
#: ``num_distributed_optimizer_instances``; ``gtp`` / ``egtp`` the 0.19 GTP sizes; ``etp`` / ``edp``
#: the expert tensor / data parallel sizes. Fields whose size is no such product (``embd``,
#: ``pos_embd``, ``hcp``, ``intra_dist_opt``, the all-gather groups) are checked by their ranks only.
FIELD_SIZES: dict[str, dict[str, int]] = {
    "tp": {"tp": 1},
    "pp": {"pp": 1},
    "cp": {"cp": 1},
    "dp": {"dp": 1},
    "ep": {"ep": 1},
    "expt_tp": {"etp": 1},
    "expt_dp": {"edp": 1},
    "gtp_remat": {"gtp": 1},
    "expt_gtp_remat": {"egtp": 1},
    "inter_dist_opt": {"n": 1},
    "mp": {"tp": 1, "gtp": 1, "pp": 1},
    "tp_cp": {"tp": 1, "cp": 1},
    "dp_cp": {"dp": 1, "cp": 1},
    "tp_dp_cp": {"tp": 1, "gtp": 1, "dp": 1, "cp": 1},
    "dp_cp_gtp_remat": {"gtp": 1, "dp": 1, "cp": 1},
    "tp_ep": {"etp": 1, "ep": 1},
    "tp_ep_pp": {"etp": 1, "ep": 1, "pp": 1},
    "tp_ep_pp_with_egtp_remat": {"etp": 1, "ep": 1, "egtp": 1, "pp": 1},
    "expt_dp_gtp_remat": {"egtp": 1, "edp": 1},
    "intra_dp_cp": {"dp": 1, "cp": 1, "n": -1},
    "intra_expt_dp": {"edp": 1, "n": -1},
}
_DENSE = ("tp", "gtp", "pp", "cp", "dp")
_EXPERT = ("etp", "egtp", "ep", "edp", "pp")
# Sizes no field determined, in the order they take their default (1, or tp for etp).
_DEFAULTS = ("n", "cp", "ep", "etp")
_SHOWN = 16  # rank-list entries shown in messages


class InconsistentCollectionError(ValueError):
    """The groups are not those of any Megatron layout of this world (the message names the fields)."""


@dataclass(frozen=True)
class InferredLayout:
    """What :func:`infer_layout` found: the layout, its arguments, and the checked fields."""

    layout: MegatronLayout
    sizes: dict[str, int]
    order: str
    #: Field -> this rank's member list in Megatron's order (the layout's, else the group's).
    ranks: dict[str, list[int]] = field(default_factory=dict)

    def configuration(self) -> dict[str, Any]:
        """The layout as plain data (what the ranks must agree on)."""
        return {"sizes": dict(sorted(self.sizes.items())), "order": self.order}


def _show(ranks: Sequence[int]) -> str:
    shown = list(ranks[:_SHOWN])
    return f"{shown}{' ...' if len(ranks) > _SHOWN else ''} ({len(ranks)} ranks)"


def _solve(sizes: dict[str, int], counts: Mapping[str, int], world: int, problems: list[str]) -> None:
    """Fill ``sizes`` from field sizes (one unknown per product) and the world-size equations."""
    changed = True
    while changed:
        changed = False
        # the one-size fields first (tp, pp, dp, ...), then the products
        for name, count in sorted(counts.items(), key=lambda item: len(FIELD_SIZES.get(item[0], ()))):
            formula = FIELD_SIZES.get(name)
            if formula is None:
                continue
            unknown = [d for d in formula if d not in sizes]
            if len(unknown) != 1:
                continue
            dim, exp = unknown[0], formula[unknown[0]]
            known = math.prod(sizes[d] ** e for d, e in formula.items() if d != dim)
            value = count / known if exp == 1 else known / count
            if value != int(value) or value < 1:
                problems.append(f"field {name!r} has {count} ranks, which no {dim} size fits given {_sizes(sizes)}")
                sizes[dim] = 1
            else:
                sizes[dim] = int(value)
            changed = True
        for dims in (_DENSE, _EXPERT):
            unknown = [d for d in dims if d not in sizes]
            if len(unknown) == 1:
                known = math.prod(sizes[d] for d in dims if d in sizes)
                if world % known:
                    problems.append(
                        f"world size {world} is not divisible by {' x '.join(d for d in dims if d in sizes)} = {known} "
                        f"({_sizes(sizes)})"
                    )
                    sizes[unknown[0]] = 1
                else:
                    sizes[unknown[0]] = world // known
                changed = True


def _sizes(sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(sizes.items()))


def infer_sizes(counts: Mapping[str, int], world: int) -> dict[str, int]:
    """Every layout size from the group sizes ``counts`` (field -> member count) and ``world``.

    Raises:
        InconsistentCollectionError: the sizes contradict each other or the world size (every
            contradiction is named), or tp / pp / dp cannot be told.
    """
    problems: list[str] = []
    # the GTP sizes (0.19) come from their own fields or are 1: never guessed from a product
    sizes: dict[str, int] = {"gtp": counts.get("gtp_remat", 1), "egtp": counts.get("expt_gtp_remat", 1)}
    _solve(sizes, counts, world, problems)
    for dim in _DEFAULTS:
        if dim not in sizes:
            sizes[dim] = sizes["tp"] if dim == "etp" and "tp" in sizes else 1
            _solve(sizes, counts, world, problems)
    missing = [d for d in ("tp", "pp", "dp", "edp") if d not in sizes]
    if missing:
        raise InconsistentCollectionError(
            f"cannot tell the size(s) {missing} from the collection's fields {sorted(counts)} and world size {world}"
        )
    for name, count in counts.items():
        formula = FIELD_SIZES.get(name)
        if formula is None:
            continue
        expected = math.prod(sizes[d] ** e for d, e in formula.items())
        if expected != count:
            product = " x ".join(f"{d}({sizes[d]})" if e == 1 else f"/ {d}({sizes[d]})" for d, e in formula.items())
            problems.append(f"field {name!r} has {count} ranks, but {product} = {expected:g}")
    for dims in (_DENSE, _EXPERT):
        if math.prod(sizes[d] for d in dims) != world:
            product = " x ".join(f"{d}({sizes[d]})" for d in dims)
            problems.append(f"{product} = {math.prod(sizes[d] for d in dims)}, not the world size {world}")
    if problems:
        given = ", ".join(f"{name}={count}" for name, count in counts.items())
        raise InconsistentCollectionError(
            f"the collection's group sizes ({given}; world {world}) are not those of a Megatron layout:\n  "
            + "\n  ".join(dict.fromkeys(problems))
        )
    return sizes


def _candidate_orders(sizes: Mapping[str, int]) -> list[str]:
    """Orders that give different layouts, the default first: the tokens of size > 1 (dense or
    expert) permuted over their places in the default order, the others left in place.
    """
    token_size = {
        "tp": max(sizes["tp"], sizes["etp"]),
        "cp": sizes["cp"],
        "ep": sizes["ep"],
        "dp": max(sizes["dp"], sizes["edp"]),
        "pp": sizes["pp"],
    }
    tokens = DEFAULT_ORDER.split("-")
    slots = [i for i, t in enumerate(tokens) if token_size[t] > 1]
    orders = []
    for perm in itertools.permutations([tokens[i] for i in slots]):
        placed = list(tokens)
        for i, token in zip(slots, perm, strict=True):
            placed[i] = token
        orders.append("-".join(placed))
    return orders


def _layout(sizes: Mapping[str, int], order: str, world: int, release: str, hcp: list[int] | None) -> MegatronLayout:
    return MegatronLayout(
        world_size=world,
        tensor_model_parallel_size=sizes["tp"],
        pipeline_model_parallel_size=sizes["pp"],
        context_parallel_size=sizes["cp"],
        expert_model_parallel_size=sizes["ep"],
        expert_tensor_parallel_size=sizes["etp"],
        num_distributed_optimizer_instances=sizes["n"],
        hierarchical_context_parallel_sizes=hcp,
        order=order,
        gtp_remat_size=sizes["gtp"],
        expert_gtp_remat_size=sizes["egtp"],
        release=release,
    )


def _expected(layout: MegatronLayout, name: str, rank: int, level: int | None = None) -> list[int] | None:
    kind = FIELD_KINDS[name] if level is None else f"hcp{level}"
    try:
        return layout.group(kind, rank)
    except KeyError:
        return None


def _disagreements(layout: MegatronLayout, rank: int, ranks: Mapping[str, Sequence[int]]) -> dict[str, tuple]:
    """Field -> (collection's ranks, layout's ranks) for every field the layout gives otherwise."""
    out: dict[str, tuple] = {}
    pp = layout.group("pp", rank) or []
    for name, members in ranks.items():
        if name in ("embd", "pos_embd"):  # any subset of the pipeline (get_embedding_ranks is the user's)
            if not set(members) <= set(pp):
                out[name] = (members, f"a subset of the pipeline {pp}")
            continue
        level = int(name[3:]) if name.startswith("hcp") and name[3:].isdigit() else None
        expected = _expected(layout, "hcp" if level is not None else name, rank, level)
        if expected is not None and sorted(expected) != sorted(members):
            out[name] = (members, expected)
    return out


def infer_layout(rank: int, world_size: int, ranks: Mapping[str, Sequence[int]], release: str) -> InferredLayout:
    """The Megatron layout of ``release`` whose groups on ``rank`` are ``ranks``.

    Args:
        rank: this rank in the world.
        world_size: the world's size (the layout must cover it).
        ranks: field -> the member list of this rank's group (``hcp0``, ``hcp1``, ...: the
            hierarchical context-parallel levels). Fields the caller does not have are left out.
        release: the megatron-core series whose layout rules apply (e.g. ``"0.16"``).

    Raises:
        InconsistentCollectionError: a group holds ranks outside the world or lacks ``rank``;
            the sizes contradict each other or the world; or no order gives these groups
            (the fields that disagree under the closest order are named, with both rank lists).
        KeyError: ``ranks`` names a field that is no ``ProcessGroupCollection`` field.
    """
    unknown = [n for n in ranks if n not in FIELD_KINDS and not (n.startswith("hcp") and n[3:].isdigit())]
    if unknown:
        raise KeyError(f"unknown ProcessGroupCollection field(s) {unknown}; known: {sorted(FIELD_KINDS)}")
    problems = []
    for name, members in ranks.items():
        outside = [r for r in members if not 0 <= r < world_size]
        if outside:
            problems.append(
                f"field {name!r} holds ranks {outside[:_SHOWN]} outside the world [0, {world_size}): a group "
                f"of another world ({_show(members)})"
            )
        elif rank not in members and name not in ("embd", "pos_embd"):
            problems.append(f"field {name!r} does not hold this rank {rank}: {_show(members)}")
        if len(set(members)) != len(members):
            problems.append(f"field {name!r} repeats ranks: {_show(members)}")
    if problems:
        raise InconsistentCollectionError(f"rank {rank}: " + "; ".join(problems))
    levels = sorted(int(n[3:]) for n in ranks if n.startswith("hcp") and n[3:].isdigit())
    hcp = [len(ranks[f"hcp{i}"]) for i in levels] or None
    sizes = infer_sizes({n: len(m) for n, m in ranks.items() if n in FIELD_SIZES}, world_size)
    best: tuple[str, dict[str, tuple]] | None = None
    for order in _candidate_orders(sizes):
        try:
            layout = _layout(sizes, order, world_size, release, hcp)
        except (AssertionError, RuntimeError, ValueError) as exc:  # an order this release refuses
            if order == DEFAULT_ORDER:
                raise InconsistentCollectionError(
                    f"rank {rank}: the inferred sizes ({_sizes(sizes)}) are refused: {exc}"
                ) from exc
            continue
        wrong = _disagreements(layout, rank, ranks)
        if not wrong:
            ordered = {}
            for name, members in ranks.items():
                own_order = name not in FIELD_KINDS or name in ("embd", "pos_embd")  # hcp levels, embeddings
                expected = None if own_order else _expected(layout, name, rank)
                ordered[name] = list(members) if expected is None else list(expected)
            return InferredLayout(layout, sizes, order, ordered)
        if best is None or len(wrong) < len(best[1]):
            best = (order, wrong)
    if best is None:
        raise InconsistentCollectionError(
            f"rank {rank}: megatron-core {release} accepts no order for the sizes {_sizes(sizes)}"
        )
    order, wrong = best
    lines = [
        f"field {n!r}: the collection has {_show(sorted(got))}, the layout has {want}"
        for n, (got, want) in wrong.items()
    ]
    raise InconsistentCollectionError(
        f"rank {rank}: no order gives these groups for the sizes {_sizes(sizes)} (world {world_size}, megatron-core "
        f"{release}); under the closest order {order!r} {len(wrong)} field(s) disagree:\n  " + "\n  ".join(lines)
    )
