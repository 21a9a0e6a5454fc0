"""MCore's stateless helpers of ``parallel_state`` (group creation, NCCL options, rank math)
and ``RankGenerator`` — one implementation each, served per release by ``compat.parallel_state``.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch

from parallel_state_ng.groups.factory import member_only_group
from parallel_state_ng.groups.megatron_groups import nccl_options_from_config
from parallel_state_ng.layout.kinds import GROUP_KINDS
from parallel_state_ng.layout.megatron_layout import normalize_order
from parallel_state_ng.layout.named_layout import Layout
from parallel_state_ng.releases import parallel_state as api
from parallel_state_ng.releases.parallel_state import REQUIRED

from ._namespace import facade as ps
from ._release import FACTS
from ._surface import exact_function

__all__ = [
    "get_nccl_options",
    "update_pg_timeout",
    "create_group",
    "member_group",
    "generate_masked_orthogonal_rank_groups",
    "create_hierarchical_groups",
    "create_hybrid_dp_cp_groups",
    "overwrite_nccl_comm_cfgs",
    "rank_generator_class",
]


def get_nccl_options(pg_name, nccl_comm_cfgs):
    """NCCL options for group ``pg_name`` from a parsed communicator config, or ``None``.

    Recognised keys per group: ``is_high_priority_stream``, ``cga_cluster_size``, ``max_ctas``,
    ``min_ctas`` and ``net_name`` (``IB`` or ``socket``, else ``RuntimeError``). 0.12 fills
    ``cga_cluster_size`` 4, ``max_ctas`` 32, ``min_ctas`` 1 where left out and ignores
    ``is_high_priority_stream``.
    """
    return nccl_options_from_config(pg_name, nccl_comm_cfgs, legacy_defaults=FACTS.nccl_config_defaults)


def update_pg_timeout(timeout: timedelta, pg: torch._C._distributed_c10d.ProcessGroup | None = None):
    """Set ``timeout`` on ``pg``, or on every group of this rank (and the default one).

    Synchronizes the group(s) first (barrier and CUDA sync), as MCore does.
    """
    if not hasattr(torch.distributed.distributed_c10d, "_set_pg_timeout"):
        return
    torch.distributed.barrier(pg)
    torch.cuda.synchronize()
    targets = ps._global_process_group_list if pg is None else [pg]
    for group in targets:
        torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)


def _note_group_creation() -> None:
    """Start ``_global_process_group_list`` (with the default group) if the release keeps one."""
    ns = ps.namespace
    if "_global_process_group_list" in ns and ns["_global_process_group_list"] is None:
        ns["_global_process_group_list"] = [None]


def _record(group: Any) -> None:
    _note_group_creation()
    listed = ps.namespace.get("_global_process_group_list")
    if listed is not None:
        listed.append(group)


def create_group(
    ranks=None,
    timeout=None,
    backend=None,
    pg_options=None,
    use_local_synchronization=False,
    group_desc=None,
):
    """Create a process group with ``torch.distributed.new_group`` (same arguments).

    From 0.15 on, a group that contains the calling rank is appended to
    ``_global_process_group_list`` so that ``update_pg_timeout`` reaches it.
    """
    group = torch.distributed.new_group(
        ranks=ranks,
        timeout=timeout,
        backend=backend,
        pg_options=pg_options,
        use_local_synchronization=use_local_synchronization,
        group_desc=group_desc,
    )
    if "_global_process_group_list" in ps.namespace:  # 0.15+: keep the rank's groups for update_pg_timeout
        _note_group_creation()
        if torch.distributed.get_rank() in ranks:
            _record(group)
    return group


def member_group(ranks: list[int], **kwargs: Any) -> Any:
    """A group created by its members only, recorded for ``update_pg_timeout``."""
    group = member_only_group(ranks, **kwargs)
    _record(group)
    return group


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: list[int], mask: list[bool]
) -> list[list[int]]:
    """All groups over the masked dims of a mixed-radix layout (first size varies fastest).

    ``parallel_size[i]`` is the size of dim ``i``; ``mask[i]`` says whether dim ``i`` is inside
    the groups. Groups are numbered by the unmasked dims and list their ranks by the masked
    dims, both with the first dim fastest. Computed by the engine's vectorized enumeration.
    """
    names = [f"d{i}" for i in range(len(parallel_size))]
    layout = Layout(list(parallel_size), names)
    groups = layout.enumerate_groups([n for n, m in zip(names, mask, strict=False) if m])
    wanted = world_size // groups.shape[1]
    if wanted > groups.shape[0]:
        raise AssertionError(
            f"world_size {world_size} is larger than the layout {list(parallel_size)} ({layout.size} ranks)"
        )
    return groups[:wanted].tolist()


def create_hierarchical_groups(
    rank,
    ranks,
    hierarchical_group_sizes,
    create_gloo_process_groups=False,
    pg_options=None,
    timeout=None,
    group_desc=None,
):
    """Create ``rank``'s sub-groups of the group ``ranks`` at each hierarchy level.

    ``ranks`` is split into levels of sizes ``hierarchical_group_sizes`` (level 0 varies
    fastest over the positions in ``ranks``). Returns ``(groups, gloo_groups)``, one entry per
    level; both empty when ``rank`` is not in ``ranks``. Only the calling rank's sub-groups are
    created (``use_local_synchronization=True``). ``pg_options`` may be a list (one per level).
    """
    sizes = list(hierarchical_group_sizes)
    if not isinstance(pg_options, list):
        pg_options = [pg_options] * len(sizes)
    if math.prod(sizes) != len(ranks):
        raise RuntimeError(  # MCore's einops rearrange fails with a RuntimeError subclass
            f"hierarchical_group_sizes {sizes} multiply to {math.prod(sizes)}, but ranks has {len(ranks)} entries"
        )
    if sizes and ranks:
        _note_group_creation()
    if rank not in ranks:
        return [], []
    layout = Layout([len(ranks)], ["all"]).split("all", sizes, [f"l{i}" for i in range(len(sizes))])
    position = list(ranks).index(rank)
    groups, gloo_groups = [], []
    for level in range(len(sizes)):
        members = [ranks[i] for i in layout.group_ranks(position, f"l{level}")]
        groups.append(
            member_group(
                members, timeout=timeout, pg_options=pg_options[level], group_desc=f"HIERARCHICAL_{group_desc}_L{level}"
            )
        )
        gloo_groups.append(
            member_group(
                members,
                timeout=timeout,
                backend="gloo",
                pg_options=pg_options[level],
                group_desc=f"HIERARCHICAL_{group_desc}_GLOO_L{level}",
            )
            if create_gloo_process_groups
            else None
        )
    return groups, gloo_groups


def create_hybrid_dp_cp_groups(rank, ranks, pg_options):
    """Create ``rank``'s hybrid dp×cp groups: for each power of two ``s`` from 2 below
    ``len(ranks)``, the chunk of ``s`` consecutive entries of ``ranks`` holding ``rank``.

    Returns ``{s: group}``; only the calling rank's chunks are created.
    """
    out: dict[int, Any] = {}
    sizes = [2**i for i in range(1, int(math.log2(len(ranks))))] if len(ranks) > 0 else []
    if sizes:
        _note_group_creation()
    if rank not in ranks:
        return out
    position = list(ranks).index(rank)
    for size in sizes:
        start = (position // size) * size
        out[size] = member_group(
            list(ranks[start : start + size]),
            pg_options=pg_options,
            group_desc=GROUP_KINDS["hybrid_dp_cp"].desc.format(size=size),
        )
    return out


def overwrite_nccl_comm_cfgs(nccl_comm_cfgs, pg_name, key_value_pair):
    """Set ``nccl_comm_cfgs[pg_name][key] = value`` for ``key_value_pair = (key, value)``."""
    nccl_comm_cfgs.setdefault(pg_name, {})[key_value_pair[0]] = key_value_pair[1]


class _RankGenerator:
    """Rank groups for a tp/ep/dp/pp/cp (0.19: and gtp_remat) layout given by an ``order`` string.

    Same constructor and methods as the served release's ``RankGenerator``; groups come from
    the engine's :class:`~parallel_state_ng.layout.named_layout.Layout` (vectorized).
    """

    _gtp_axis = True  # whether the served release has the gtp_remat token (set per release)

    def __init__(
        self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0, gtp_remat: int = 1
    ) -> None:
        if not (ep == 1 or cp == 1):
            raise AssertionError(
                f"a RankGenerator takes ep > 1 or cp > 1, not both (ep={ep}, cp={cp}): cp belongs to "
                f"the dense generator and ep to the expert one"
            )
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        if self._gtp_axis:
            self.gtp_remat = gtp_remat
            self.name_to_size["gtp_remat"] = gtp_remat
        self.world_size = math.prod(self.name_to_size.values())
        tokens = normalize_order(order, self.name_to_size)
        self.order = "-".join(tokens)
        self.ordered_size = [self.name_to_size[t] for t in tokens]
        self._layout = Layout(self.ordered_size, tokens, rank_offset)

    def get_mask(self, order: str, token: str):
        """Booleans over the tokens of ``order``: True for those named in ``token`` ('tp-dp')."""
        ordered = order.split("-")
        mask = [False] * len(ordered)
        for t in token.split("-"):
            mask[ordered.index(t)] = True
        return mask

    def get_ranks(self, token):
        """All groups over the dims named in ``token`` (e.g. ``'tp-dp'``), in MCore order."""
        dims = token.split("-")
        for t in dims:
            self.order.split("-").index(t)  # ValueError for a token not in order, like MCore
        return self._layout.rank_enum(dims)

    def get_gtp_ranks(self, gtp_remat_size: int):
        """The GTP weight-rematerialization groups (singletons for size 1)."""
        if self.gtp_remat != gtp_remat_size:
            raise AssertionError(
                f"gtp_remat_size ({gtp_remat_size}) differs from this generator's gtp_remat ({self.gtp_remat})"
            )
        return self.get_ranks("gtp_remat")


def rank_generator_class(release: Any, module: str) -> type:
    """``RankGenerator`` of ``release``: its methods with their exact signatures."""
    methods = api.rank_generator_methods(release)
    namespace: dict[str, Any] = {
        "__doc__": _RankGenerator.__doc__,
        "__module__": module,
        "_gtp_axis": "gtp_remat" in dict(methods["__init__"]),
    }
    for name, params in methods.items():
        method = exact_function(name, (("self", REQUIRED), *params), getattr(_RankGenerator, name), module)
        method.__qualname__ = f"RankGenerator.{name}"
        namespace[name] = method
    return type("RankGenerator", (), namespace)
