"""Where Megatron-Core uses a process-group *object* beyond a collective on it: an audit, as data.

Under ``PSNG_SHARE_GROUPS=safe`` two group kinds may be handed one object
(:mod:`parallel_state_ng.layout.sharing_policy`). Megatron compares group objects, keys dicts and
streams on them and registers memory on them, so a merge can change what Megatron decides even
when the members are equal. :data:`IDENTITY_USES` records each such place in megatron-core's
release wheels (``megatron/core/``, 0.12.3 ... 0.19.2) and in Megatron-LM main at
:data:`MAIN_COMMIT`: the file, its line in each release that has it, a short substring of that
line (``snippet``), the kind of use, the group kinds that reach it (names of
:data:`~parallel_state_ng.layout.kinds.GROUP_KINDS`) and what a merge of those kinds changes.

Left out: collectives, ``size()`` / ``rank()`` and ``get_process_group_ranks`` (equal members
give equal answers; the ``get_global_rank`` / ``get_group_rank`` sites are recorded, the first
line of each file), rank-tuple caches (``BridgeCommunicator``, resharding, checkpoint shard
distributions), dicts keyed by kind *names* (``ProcessGroupCollection``, ``HyperCommGrid``),
``lru_cache`` functions (none takes a group), and attributes MCore sets on optimizers or
parameters (none on a group). MCore's own ``parallel_state.py`` is served by compat; its entries
say what compat does there. docs/compat.md ("Identity audit") shows :func:`render_table`; a test
checks every line against the wheels. Pure data: no ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "RELEASES",
    "MAIN_COMMIT",
    "UseType",
    "IdentityUse",
    "IDENTITY_USES",
    "uses_tying",
    "render_table",
]

#: The releases audited, oldest first (each as its wheel's ``megatron/core/``).
RELEASES: tuple[str, ...] = ("0.12.3", "0.13.1", "0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2")

#: The Megatron-LM main commit read for the ``main`` lines (2026-08-22).
MAIN_COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"

#: eq: ``==`` / ``!=`` between groups; is: ``is``; dict-key: a group (or its torch name) as a key;
#: id-key: ``id(group)`` as a key; registration: memory registered on the group's communicator;
#: desc-lookup: ``group_desc`` read; torch-keyed: a torch call that keys on the object or its name.
UseType = Literal["eq", "is", "dict-key", "id-key", "cache", "registration", "desc-lookup", "attribute", "torch-keyed"]

CHANGES = "changes a decision: "
HARMLESS = "harmless: "


@dataclass(frozen=True)
class IdentityUse:
    """One place Megatron-Core uses a group object's identity, and what a merge does there."""

    id: str
    path: str  # relative to megatron/core/
    lines: tuple[tuple[str, int], ...]  # (release, line) for each release that has it
    main: int | None  # the line in Megatron-LM main at MAIN_COMMIT, None where main lacks it
    snippet: str  # a substring of that line (each release's and main's)
    use: UseType
    kinds: tuple[str, ...]  # the group kinds that can reach it
    what: str
    verdict: str  # starts with "changes a decision: " or "harmless: "

    @property
    def changes_decision(self) -> bool:
        """Whether a merge of its kinds changes something Megatron decides."""
        return self.verdict.startswith(CHANGES)

    def line(self, release: str) -> int | None:
        """The line in ``release`` (``"main"`` for main), None where that release lacks it."""
        if release == "main":
            return self.main
        return dict(self.lines).get(release)


def _from(first: str, *lines: int) -> tuple[tuple[str, int], ...]:
    """``(release, line)`` pairs for consecutive releases starting at ``first``."""
    start = RELEASES.index(first)
    releases = RELEASES[start : start + len(lines)]
    if len(releases) != len(lines):
        raise ValueError(f"{len(lines)} lines from {first}: more than the releases from it")
    return tuple(zip(releases, lines, strict=True))


_RANK_MAP = "torch's rank map of the group object (a broadcast source or a peer's global rank)"
_RANK_MAP_VERDICT = HARMLESS + "equal members give the same ranks"


def _rank_query(
    uid: str, path: str, lines: tuple[tuple[str, int], ...], main: int | None, snippet: str, kinds: tuple[str, ...]
) -> IdentityUse:
    """A torch rank-map query (``get_global_rank`` / ``get_group_rank``): keyed on the object, harmless."""
    return IdentityUse(uid, path, lines, main, snippet, "torch-keyed", kinds, _RANK_MAP, _RANK_MAP_VERDICT)


_GRAD_STATS = ("mp", "tp_ep_pp", "tp_ep_gtp_remat_pp", "intra_dist_opt_instance")
_DDP = ("intra_dp_cp", "dp_cp", "intra_ep_dp", "ep_dp")
_FSDP = ("dp_cp", "intra_dp_cp", "ep_dp", "intra_ep_dp", "dp_cp_ag", "ep_dp_ag", "inter_dp_cp")
_GTP = ("gtp_remat", "expt_gtp_remat")
_FSDP_PY = "distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py"

IDENTITY_USES: tuple[IdentityUse, ...] = (
    IdentityUse(
        "chained_grad_stats_eq",
        "optimizer/optimizer.py",
        _from("0.12.3", 1073, 1157, 1211, 1254, 1258, 1267, 1396, 1748),
        1780,
        "get_grad_stats_parallel_group() == reference_group",
        "eq",
        _GRAD_STATS,
        "ChainedOptimizer asks whether every sub-optimizer's grad-stats group is one object; if so "
        "grad norm and zero count are reduced once over all gradients, else per optimizer and combined",
        CHANGES + "one object for the dense mp and the expert tp_ep_pp (or its EGTP variant) group "
        "(no distributed optimizer: with it both already hold the intra_dist_opt object), "
        "or for mp and intra_dist_opt_instance (layer-wise optimizer beside the distributed one, "
        "dp·cp = 1), takes the joint branch: same maths, other rounding, not bit-identical to MCore. "
        "safe reaches it through size-1 groups (mp / tp_ep_pp) and the pipeline role (mp / "
        "intra_dist_opt_instance)",
    ),
    IdentityUse(
        "fsdp_dual_ubr_ne",
        "distributed/custom_fsdp/param_and_grad_buffer.py",
        _from("0.13.1", 1213),
        None,
        "assert group != additional_group",
        "eq",
        ("dp_cp", "ep_dp"),
        "custom FSDP with nccl_ub and experts asserts the dense and expert data-parallel groups "
        "are two objects before registering its pool on both",
        CHANGES + "one object for dp_cp and ep_dp fails the assertion at buffer set-up (safe: "
        "both of size 1; 1 / process: also ep = 1 with etp = tp)",
    ),
    IdentityUse(
        "fsdp_dual_ubr_register",
        "distributed/custom_fsdp/param_and_grad_buffer.py",
        _from("0.13.1", 164),
        None,
        "backend = self.additional_group._get_backend(",
        "registration",
        ("dp_cp", "ep_dp"),
        "the dual allocator registers the pool on the expert group after the dense one",
        CHANGES + "one object would register the pool twice on one communicator; the assertion above fails first",
    ),
    IdentityUse(
        "fsdp_ubr_groups",
        _FSDP_PY,
        _from("0.14.0", 1585, 1584, 1618, 1693, 1694, 2071),
        2076,
        "self.ubr_groups.append(self.dist_index.get_fsdp_group(",
        "registration",
        _FSDP,
        "Megatron-FSDP lists the groups to register its NCCL pool on: dense and expert FSDP "
        "groups, their all-gather twins, the outer (hybrid) group; the list is not deduplicated",
        CHANGES + "two kinds on one object put one communicator in the list twice, so the pool "
        "is registered twice on it (allocator: a caught error and a warning; manual "
        "registration: no guard). safe never shares the twins; size-1 dense and expert groups reach it",
    ),
    IdentityUse(
        "fsdp_multigroup_alloc",
        _FSDP_PY,
        _from("0.14.0", 1665, 1664, 1724, 1799, 1810, 2187),
        2192,
        "nccl_allocator.MultiGroupMemPoolAllocator,",
        "registration",
        _FSDP,
        "with more than one registration group FSDP allocates through the multi-group allocator",
        CHANGES + "a duplicate entry makes the allocator register the pool twice on one communicator",
    ),
    IdentityUse(
        "nccl_multigroup_exit",
        "nccl_allocator.py",
        _from("0.14.0", 239, 270, 336, 336, 336, 336),
        336,
        "for group in self.groups:",
        "registration",
        _FSDP,
        "the multi-group allocator registers its pool on each listed group's backend on exit, "
        "logging a warning when one registration fails",
        CHANGES + "a group listed twice is registered twice; the second registration's error is caught and logged",
    ),
    IdentityUse(
        "fsdp_manual_register",
        _FSDP_PY,
        _from("0.16.1", 1782, 1857, 1868, 2245),
        2250,
        "nccl_allocator.register_mem_pool(",
        "registration",
        _FSDP,
        "FSDP manual registration registers the pool on every listed group, with no guard",
        CHANGES + "a group listed twice gets the same pool registered twice; torch may raise",
    ),
    IdentityUse(
        "fsdp_apex_multigroup",
        _FSDP_PY,
        _from("0.14.0", 205, 204, 229, 220, 220, 221),
        222,
        "for group in self.groups[1:]:",
        "registration",
        _FSDP,
        "FSDP's own multi-group allocator (APEX allocator path) registers the pool on the first "
        "group through APEX, then on every further group, with no guard",
        CHANGES + "a later entry that is the first group's object registers the pool on that "
        "communicator a second time; torch may refuse it, and nothing here catches that",
    ),
    IdentityUse(
        "nccl_mem_desc",
        "nccl_allocator.py",
        _from("0.14.0", 163, 194, 236, 236, 236, 236),
        236,
        'desc = getattr(self.group, "group_desc", None)',
        "desc-lookup",
        _DDP + ("dp_cp_ag", "ep_dp_ag", "inter_dp_cp"),
        "the allocator names a group by its group_desc in a warning (the multi-group allocator and "
        "FSDP's logs do the same)",
        HARMLESS + "a shared group carries the first kind's group_desc; only a log line changes",
    ),
    IdentityUse(
        "fsdp_ubr_desc_log",
        _FSDP_PY,
        _from("0.14.0", 1599, 1598, 1646, 1721, 1732, 2109),
        2114,
        "group.group_desc: {group.group_desc}",
        "desc-lookup",
        _FSDP,
        "FSDP logs each registration group by its group_desc",
        HARMLESS + "the log shows the first kind's group_desc for a shared group",
    ),
    IdentityUse(
        "ddp_nccl_ub_pool",
        "distributed/param_and_grad_buffer.py",
        _from("0.13.1", 636, 674, 688, 760, 1014, 1076, 1137),
        1144,
        "nccl_allocator.nccl_mem",
        "registration",
        _DDP,
        "with nccl_ub each DDP buffer makes its own pool and registers it on its data-parallel group",
        HARMLESS + "two kinds on one object register two different pools on one communicator",
    ),
    IdentityUse(
        "ddp_bucket_group_eq",
        "distributed/param_and_grad_buffer.py",
        _from("0.12.3", 835, 878, 916, 936, 1053, 1415, 1574, 1714),
        1720,
        "assert data_parallel_group == buffer.data_parallel_group",
        "eq",
        _DDP,
        "one bucket group for all buffers asserts they share one data-parallel group; dense and "
        "expert buffers are partitioned in separate calls",
        HARMLESS + "the buffers of one call already share one object; a merge can only keep it true",
    ),
    IdentityUse(
        "deepep_buffer_ne",
        "transformer/moe/fused_a2a.py",
        _from("0.12.3", 58, 60, 60, 60, 61, 63, 63, 63),
        64,
        "_buffer.group != group",
        "eq",
        ("tp_ep_mp",),
        "the module-level DeepEP buffer is rebuilt when asked for another group",
        HARMLESS + "a shared object reuses the buffer, which is bound to that communicator; only "
        "the tp_ep group asks, and safe never shares tp_ep",
    ),
    IdentityUse(
        "nccl_ep_bootstrap",
        "transformer/moe/fused_a2a.py",
        _from("0.19.2", 650),
        656,
        "te_ep.ep_bootstrap(",
        "registration",
        ("tp_ep_mp",),
        "the NCCL-EP flex backend has TransformerEngine borrow the tp_ep group's NCCL communicator "
        "once per process; its kernels run outside torch's stream order",
        CHANGES + "another kind on that object would issue collectives on a communicator TE drives "
        "unordered with them; safe never shares tp_ep (sharing_policy NEVER_SHARED)",
    ),
    IdentityUse(
        "gtp_stream_key_id",
        "tensor_parallel/generalized_tensor_parallelism.py",
        _from("0.19.2", 330),
        372,
        "id(group) if group is not None else 0",
        "id-key",
        _GTP,
        "GTP all-gather and reduce-scatter side streams are keyed by id(group), to keep dense "
        "and expert GTP traffic on separate streams",
        CHANGES + "one object puts dense and expert GTP on one side stream: serialised. safe "
        "merges them only at size 1, where there is no GTP traffic",
    ),
    IdentityUse(
        "cuda_graph_gtp_params_by_group",
        "transformer/cuda_graphs.py",
        _from("0.19.2", 1507),
        1595,
        "params_by_group[expert_group if is_expert else dense_group]",
        "dict-key",
        _GTP,
        "the graphed backward groups parameters by their GTP group to pick a reduce-scatter stream",
        HARMLESS + "one entry instead of two, with the stream gtp_stream_key_id gives anyway",
    ),
    IdentityUse(
        "gtp_cuda_graphs_is",
        "tensor_parallel/gtp_cuda_graphs.py",
        (),
        260,
        "p.group is exemplar.group",
        "is",
        _GTP,
        "main only: the parameters of one wgrad ring key must hold one group object",
        HARMLESS + "a merge can only make the assertion pass",
    ),
    IdentityUse(
        "gtp_symm_registry",
        "tensor_parallel/gtp_symmetric_memory.py",
        (),
        86,
        "_registered[group.group_name] = group",
        "dict-key",
        _GTP,
        "main only: one symmetric pool per torch group name, registered once (the name is checked first)",
        HARMLESS + "a shared object gets one pool and one registration for both kinds",
    ),
    IdentityUse(
        "hcg_destroy_id",
        "hyper_comm_grid.py",
        _from("0.19.2", 282),
        286,
        "id(pg) not in destroyed",
        "id-key",
        (),
        "HyperCommGrid.destroy skips a group object it destroyed already (kinds: the grid's dims)",
        HARMLESS + "a shared object is destroyed once; MCore's own grid only (compat serves "
        "HyperCommGrid under install(hyper_comm_grid=True))",
    ),
    IdentityUse(
        "symm_mem_utils",
        "utils.py",
        _from("0.16.1", 655),
        None,
        "enable_symm_mem_for_group(process_group.group_name)",
        "torch-keyed",
        ("tp",),
        "a symmetric-memory buffer enables torch symmetric memory for the group's torch name",
        HARMLESS + "enabling is per communicator and idempotent",
    ),
    IdentityUse(
        "symm_mem_inference",
        "inference/symmetric_memory.py",
        _from("0.17.1", 51, 54, 54),
        54,
        "enable_symm_mem_for_group(process_group.group_name)",
        "torch-keyed",
        ("tp", "ep"),
        "inference symmetric buffers, keyed by name strings (tp, ep_*), enable symmetric memory "
        "for their group's torch name and rendezvous on it",
        HARMLESS + "each key keeps its own buffer and rendezvous on a shared communicator",
    ),
    IdentityUse(
        "fsdp_dbuffer_rendezvous",
        "distributed/fsdp/src/megatron_fsdp/experimental/dbuffer.py",
        _from("0.19.2", 128),
        150,
        "group=group.group_name",
        "torch-keyed",
        ("dp_cp", "intra_dp_cp", "ep_dp", "intra_ep_dp"),
        "an FSDP mesh axis's buffer rendezvouses for symmetric memory by the group's torch name",
        HARMLESS + "one rendezvous per buffer; the name only selects the communicator",
    ),
    _rank_query(
        "multimodule_group_rank",
        "pipeline_parallel/multimodule_communicator.py",
        _from("0.16.1", 214, 290, 290, 290),
        298,
        "dist.get_group_rank(pp_group",
        ("pp",),
    ),
    _rank_query(
        "ddp_broadcast_global_rank",
        "distributed/distributed_data_parallel.py",
        _from("0.12.3", 518, 622, 644, 582, 571, 589, 595, 632),
        719,
        "get_global_rank(data_parallel_group, 0)",
        ("dp_cp", "ep_dp"),
    ),
    _rank_query(
        "custom_fsdp_broadcast_global_rank",
        "distributed/custom_fsdp/fully_sharded_data_parallel.py",
        _from("0.12.3", 684, 759),
        None,
        "get_global_rank(data_parallel_group, 0)",
        ("dp_cp", "ep_dp"),
    ),
    _rank_query(
        "mfsdp_broadcast_global_rank",
        "distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py",
        _from("0.14.0", 1165, 1176, 1315, 1397, 1448, 1479),
        1512,
        "get_global_rank(data_parallel_group, 0)",
        ("dp_cp", "intra_dp_cp", "ep_dp", "intra_ep_dp"),
    ),
    _rank_query(
        "ckpt_exchange_global_rank",
        "dist_checkpointing/exchange_utils.py",
        _from("0.12.3", 498, 519, 524, 524, 521, 528, 528, 528),
        750,
        "get_global_rank(parallelization_group, rank)",
        ("dp", "dp_cp", "intra_dp_cp", "ep_dp", "intra_ep_dp"),
    ),
    _rank_query(
        "ckpt_two_stage_global_rank",
        "dist_checkpointing/strategies/two_stage.py",
        _from("0.12.3", 210, 210, 210, 210),
        None,
        "src_rank = torch.distributed.get_global_rank(",
        ("dp", "dp_cp"),
    ),
    IdentityUse(
        "fsdp_mesh_from_group",
        "distributed/fsdp/mcore_fsdp_adapter.py",
        _from("0.14.0", 206, 205, 275, 330, 432, 448),
        451,
        "[dp_cp_group, tp_group],",
        "torch-keyed",
        ("dp_cp", "tp"),
        "the FSDP adapter builds a DeviceMesh from existing groups; torch stores each dim's group name",
        HARMLESS + "two dims on one object (safe: both of size 1) each resolve to a group with the right members",
    ),
    IdentityUse(
        "fsdp_mesh_from_group_hsdp",
        "distributed/fsdp/mcore_fsdp_adapter.py",
        _from("0.14.0", 192, 191, 250, 303, 403, 419),
        422,
        "[outer_fsdp_group, dp_cp_group, tp_group],",
        "torch-keyed",
        ("inter_dp_cp", "intra_dp_cp", "tp"),
        "the hybrid-FSDP DeviceMesh from the outer, inner and tp groups",
        HARMLESS + "as fsdp_mesh_from_group",
    ),
    IdentityUse(
        "update_pg_timeout_object",
        "parallel_state.py",
        _from("0.15.3", 196, 205, 205, 204, 223),
        223,
        "_set_pg_timeout(timeout, pg)",
        "torch-keyed",
        (),
        "update_pg_timeout(timeout, pg) sets the timeout on that group object (any kind)",
        CHANGES + "every kind sharing the object gets the new timeout; compat serves this function "
        "with the same effect (documented under Observable differences)",
    ),
    IdentityUse(
        "destroy_gloo_pg_map",
        "parallel_state.py",
        _from("0.12.3", 2066, 2325, 1969, 2019, 2156, 2112, 2158, 2597),
        2597,
        "pg_map.get(_DATA_PARALLEL_GROUP_GLOO, None)",
        "torch-keyed",
        ("dp", "dp_cp", "ep_dp", "intra_ep_dp"),
        "MCore's destroy_model_parallel destroys a gloo group only while torch's pg_map holds it",
        HARMLESS + "not reached under compat (compat serves destroy_model_parallel); in MCore a "
        "shared gloo group would be destroyed once and then skipped",
    ),
)


def uses_tying(a: str, b: str) -> tuple[IdentityUse, ...]:
    """The audited uses that both kinds ``a`` and ``b`` reach: where one object for them may matter."""
    return tuple(u for u in IDENTITY_USES if a in u.kinds and b in u.kinds)


def _span(use: IdentityUse) -> str:
    """The releases that have the use (contiguous): ``0.14.0-0.19.2, main``, ``0.13.1``, ``main``."""
    have = [r for r, _ in use.lines]
    parts = [have[0] if len(have) == 1 else f"{have[0]}-{have[-1]}"] if have else []
    return ", ".join(parts + ["main"] * (use.main is not None))


def render_table() -> str:
    """The Markdown table docs/compat.md shows ("Identity audit"), one row per use."""
    rows = [
        "| id | file:line (0.19.2, else the newest that has it) | releases | use | kinds | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for u in IDENTITY_USES:
        newest, at = u.lines[-1] if u.lines else ("main", u.main)
        where = f"`{u.path}:{at}`" + ("" if newest == "0.19.2" else f" ({newest})")
        kinds = ", ".join(f"`{k}`" for k in u.kinds) or "—"
        rows.append(f"| `{u.id}` | {where} | {_span(u)} | {u.use} | {kinds} | {u.verdict} |")
    return "\n".join(rows) + "\n"
