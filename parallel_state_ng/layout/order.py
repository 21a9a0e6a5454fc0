"""How Megatron-Core's rank generators read ``order``, and the arithmetic its group kinds share.

``order`` is a string of tokens (``tp-cp-ep-dp-pp``), first token varying fastest.
:func:`normalize_order` / :func:`read_order` read it as a release's ``RankGenerator`` does
(0.19 injects the GTP axis); :func:`default_embedding_ranks`,
:func:`default_position_embedding_ranks`, :func:`hierarchical_group` and :func:`quotient` are
the pieces of arithmetic every release shares. The group kinds themselves are stated in
:mod:`parallel_state_ng.layout.kinds`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "ORDER_TOKENS",
    "GTP_TOKEN",
    "DEFAULT_ORDER",
    "normalize_order",
    "inject_gtp_remat",
    "default_embedding_ranks",
    "default_position_embedding_ranks",
    "EmptyGroupError",
    "EmptyGroupAssertionError",
    "quotient",
    "hierarchical_group",
    "read_order",
]

# Tokens of MCore's ``order`` string, in the order its RankGenerator checks them.
ORDER_TOKENS = ("tp", "pp", "dp", "ep", "cp")
# The GTP weight-rematerialization axis of 0.19 (checked after the five above).
GTP_TOKEN = "gtp_remat"
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def default_embedding_ranks(pp_ranks: Sequence[int], split_rank: int | None = None) -> list[int]:
    """Ranks holding the word embeddings: first and last pipeline stage (one if pp == 1).

    ``split_rank`` (0.12–0.13, deprecated there): the stage ``pp_ranks[split_rank]`` (the
    decoder's first) holds them too when it is neither the first nor the last.
    """
    if len(pp_ranks) == 1:
        return [pp_ranks[0]]
    if split_rank is not None and pp_ranks[split_rank] not in (pp_ranks[0], pp_ranks[-1]):
        return [pp_ranks[0], pp_ranks[split_rank], pp_ranks[-1]]
    return [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: Sequence[int], split_rank: int | None = None) -> list[int]:
    """Ranks holding the position embeddings: the first pipeline stage.

    ``split_rank`` (0.12–0.13): the stage ``pp_ranks[split_rank]`` too, when it is not the first.
    """
    if split_rank is not None and pp_ranks[0] != pp_ranks[split_rank]:
        return [pp_ranks[0], pp_ranks[split_rank]]
    return [pp_ranks[0]]


def inject_gtp_remat(order: str, after: str) -> str:
    """``order`` with the ``gtp_remat`` token inserted right after token ``after``.

    Read as 0.19 reads it: on the order as given (before lower-casing), an order already
    holding ``gtp_remat`` is kept, a missing ``after`` falls back to ``tp``, and a missing
    ``tp`` puts the new token first (fastest-varying).
    """
    tokens = order.split("-")
    if GTP_TOKEN in tokens:
        return order
    anchor = after if after in tokens else "tp"
    tokens.insert(tokens.index(anchor) + 1 if anchor in tokens else 0, GTP_TOKEN)
    return "-".join(tokens)


def normalize_order(order: str, sizes: dict[str, int], given: str | None = None) -> list[str]:
    """MCore's reading of an ``order`` string for the given token sizes.

    ``sizes`` maps each token the rank generator knows (``ORDER_TOKENS``, plus ``gtp_remat``
    on 0.19) to its size. Lower-cases the order; a token of size > 1 missing from it raises
    ``RuntimeError`` (as MCore's RankGenerator does); tokens of size 1 missing from it are
    appended. Like MCore, "missing" is a substring test on the whole string. Unknown tokens
    raise ``KeyError`` like MCore; a repeated token raises ``ValueError`` (MCore silently
    builds a wrong layout from it). ``given`` is the order as the user wrote it, named in
    messages (default: ``order``).
    """
    if not isinstance(order, str):
        raise TypeError(f"order must be a str such as {DEFAULT_ORDER!r}, got {order!r}")
    text = order.lower()
    shown = order if given is None else given
    for name, size in sizes.items():
        if name not in text:
            if size != 1:
                raise RuntimeError(
                    f"order {shown!r} does not contain {name!r}, but its size is {size}; add {name!r} to order"
                )
            text = f"{text}-{name}"
    tokens = text.split("-")
    for tok in tokens:
        if tok not in sizes:
            raise KeyError(f"order {shown!r} has unknown token {tok!r}; known tokens are {list(sizes)}")
    dup = sorted({t for t in tokens if tokens.count(t) > 1})
    if dup:
        raise ValueError(f"order {shown!r} repeats token(s) {dup}; each token may appear once")
    return tokens


def hierarchical_group(cp_ranks: list[int], rank: int, sizes: list[int], level: int) -> list[int] | None:
    """``rank``'s hierarchical context-parallel group at ``level`` within its cp group ``cp_ranks``.

    Level ``level`` groups ``sizes[level]`` ranks that are ``prod(sizes[:level])`` apart, in
    whole blocks of ``prod(sizes[:level + 1])`` consecutive positions of ``cp_ranks``. When
    ``sizes`` multiply to the cp size every rank has a group at every level; otherwise (0.12
    accepts that) ranks past the last whole block have none (``None``).
    """
    before = math.prod(sizes[:level])
    block = before * sizes[level]
    pos = cp_ranks.index(rank)
    if pos // block >= len(cp_ranks) // block:
        return None
    first = pos % before + (pos // block) * block
    return [cp_ranks[first + i * before] for i in range(sizes[level])]


class EmptyGroupError(ValueError, TypeError):
    """A user callable produced an empty group (MCore fails on it with ``TypeError`` up to torch 2.13)."""


class EmptyGroupAssertionError(EmptyGroupError, AssertionError):
    """:class:`EmptyGroupError` where torch's ``new_group([])`` raises ``AssertionError`` (torch 2.14+).

    compat raises it in place of :class:`EmptyGroupError` on such a torch, as MCore's
    ``initialize_model_parallel`` then fails with ``AssertionError``
    (``parallel_state_ng.groups.torch_support.TORCH_FACTS["empty_new_group_asserts"]``).
    """


def quotient(world_size: int, what: str = "world_size", **factors: int) -> int:
    """``world_size`` divided by the product of ``factors``; ``RuntimeError`` (as MCore) if it
    does not divide, naming every factor.
    """
    product = math.prod(factors.values())
    if world_size % product != 0:
        named = " x ".join(f"{name} ({value})" for name, value in factors.items())
        raise RuntimeError(f"{what} ({world_size}) is not divisible by {named} = {product}")
    return world_size // product


def read_order(order: str, sizes: dict[str, int], gtp_after: str | None) -> list[str]:
    """The tokens of ``order`` as one of MCore's rank generators reads them.

    ``gtp_after`` is the token the 0.19 GTP axis is injected after (``None`` before 0.19).
    0.19 tests token presence by substring, so an order without ``tp`` passes the check
    through ``gtp_remat`` and then lacks ``tp``: MCore fails later (``AssertionError`` from
    its rank arithmetic when a tensor size > 1 is lost, ``ValueError`` looking ``tp`` up
    otherwise); this raises the same types up front.
    """
    if gtp_after is None:
        return normalize_order(order, sizes)
    if not isinstance(order, str):
        raise TypeError(f"order must be a str such as {DEFAULT_ORDER!r}, got {order!r}")
    injected = inject_gtp_remat(order, gtp_after)
    lowered = injected.lower().split("-")
    if lowered.count(GTP_TOKEN) > 1 and sizes.get(GTP_TOKEN, 1) == 1:
        # 0.19 injects case-sensitively: an order naming GTP_REMAT in upper case gets a second
        # gtp_remat token. At size 1 both are no-ops and MCore's layout is the one without the
        # copy (at size > 1 MCore builds ranks outside the world: normalize_order refuses).
        first = lowered.index(GTP_TOKEN)
        parts = injected.split("-")
        injected = "-".join(p for i, p in enumerate(parts) if i == first or lowered[i] != GTP_TOKEN)
    tokens = normalize_order(injected, sizes, given=order)
    if "tp" not in tokens:
        message = (
            f"order {order!r} has no 'tp' token: megatron-core 0.19 mistakes the 'tp' in "
            f"'gtp_remat' for it and cannot build the tensor-parallel groups; add 'tp' to order"
        )
        raise AssertionError(message) if sizes["tp"] != 1 else ValueError(message)
    return tokens
