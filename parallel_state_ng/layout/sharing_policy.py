"""Which group kinds may share one process group, by role: the sharing policy, stated once as data.

Two sharing settings read it (:mod:`parallel_state_ng.groups.sharing`):

* ``safe`` (``PSNG_SHARE_GROUPS=safe``): two requests share only when their ordinary key is
  equal (members, backend, NCCL options with the high-priority stream, timeout), the SHARP
  switch (``NCCL_COLLNET_ENABLE``) was the same at both requests, no :data:`NEVER_SHARED`
  rule applies to either kind, and both fall in one :data:`SAFE_SHARING` class: one role
  (:data:`ROLES`), size-1 groups, or gloo twins.
* ``1`` / ``process``: any equal key shares, but an all-gather twin only with another twin
  (:data:`ALL_GATHER_RULE`).

Each rule carries its reason and where Megatron-Core's code shows it (megatron-core 0.19.2
wheel paths under ``megatron/core/``; docs/compat.md "Group sharing" has the reading). Pure
data: no ``torch.distributed``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Hashable
from dataclasses import dataclass

from parallel_state_ng.layout.kinds import ALL_GATHER_KINDS, GROUP_KINDS

__all__ = [
    "SharingRule",
    "IdentityTie",
    "AUDITED_TIES",
    "ROLES",
    "SAFE_SHARING",
    "NEVER_SHARED",
    "ALL_GATHER_RULE",
    "kind_of_desc",
    "role_of",
    "never_rule",
    "safe_class",
    "tie_between",
    "merge_rule",
    "apart_reason",
    "kinds_of_desc",
    "merged_desc",
]


@dataclass(frozen=True)
class SharingRule:
    """One rule of the policy: the kinds it covers, why, and where Megatron's code shows it."""

    name: str
    kinds: tuple[str, ...]
    reason: str
    megatron: str = ""


#: Roles: kinds that are one role under two names. Under ``safe`` kinds of one role share when
#: their groups coincide; kinds of different roles never do (they may carry traffic Megatron
#: overlaps, or change behaviour: expert kinds equal to dense ones flip ChainedOptimizer's
#: combined grad-norm branch).
ROLES: tuple[SharingRule, ...] = (
    SharingRule(
        "dp",
        ("dp", "dp_cp", "intra_dp_cp", "gtp_remat_dp", "gtp_remat_dp_cp", "hybrid_dp_cp"),
        "data parallel: dp_cp is dp when cp = 1; MCore itself uses dp for dp_cp in its collection "
        "at cp = 1, intra_dp_cp is dp_cp with one optimizer instance, the GTP dp groups are dp / dp_cp "
        "when GTP is off and the full-size hybrid group is dp_cp",
        "process_groups_config.py:439-441; parallel_state.py:1007-1008, 1103-1109, 1853-1857",
    ),
    SharingRule(
        "expt_dp",
        ("ep_dp", "intra_ep_dp", "ep_gtp_remat_dp"),
        "expert data parallel: intra_ep_dp is ep_dp with one optimizer instance; the expert GTP dp "
        "group is ep_dp when expert GTP is off",
        "parallel_state.py:1504-1506, 1521-1525",
    ),
    SharingRule(
        "tp",
        ("tp", "tp_cp"),
        "tensor parallel: tp_cp is tp when cp = 1",
    ),
    SharingRule(
        "tp_dp",
        ("tp_dp", "tp_dp_cp"),
        "tensor × data parallel: tp_dp_cp is tp_dp when cp = 1",
    ),
    SharingRule(
        "cp",
        ("cp", "hcp"),
        "context parallel: a hierarchical level equals cp only when the other levels have size 1; "
        "attention then takes either the levels or cp, never both",
        "extensions/transformer_engine.py:1863-1880",
    ),
    SharingRule(
        "pipeline",
        ("pp", "embd", "pos_embd", "mp"),
        "pipeline-spanning coincidences (embd = pp at pp 2, mp = pp at tp 1): pp carries the schedule's "
        "p2p, the others reduce after the schedule (embedding grads, grad norm) from the same thread; "
        "nothing of them is overlapped. The optimizer instance group is not of this role: the "
        "grad-statistics tie (AUDITED_TIES) keeps it apart from mp",
        "p2p_communication.py:232-262; finalize_model_grads.py",
    ),
    SharingRule(
        "expt_pipeline",
        ("tp_ep_pp", "tp_ep_gtp_remat_pp"),
        "the expert optimizer's grad-norm group: the EGTP variant is tp_ep_pp when expert GTP is off",
        "optimizer/__init__.py:1208",
    ),
)


@dataclass(frozen=True)
class IdentityTie:
    """Kinds whose group objects one audited use of Megatron's compares or keys on.

    ``sides``: the kinds that use sees as one party each (e.g. the dense and the expert
    optimizer's grad-statistics groups). Under ``safe`` two kinds on different sides of a tie never
    share, in any class (roles, size 1): a merge would change what that use decides. Kinds on
    one side may share (the use takes one of them). Device groups only: no audited use compares
    gloo twins. ``megatron``: where the use is (megatron-core 0.19.2 paths under
    ``megatron/core/``; the identity audit has every release's lines).
    """

    name: str
    sides: tuple[tuple[str, ...], ...]
    reason: str
    megatron: str = ""
    #: The uses of :mod:`~parallel_state_ng.layout.identity_audit` (their ids) this tie answers.
    audit: tuple[str, ...] = ()

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every kind on some side of the tie."""
        return tuple(kind for side in self.sides for kind in side)


#: The audited uses of group objects that can see two kinds at once (docs/compat.md, "Identity
#: audit"): the kinds on different sides never share under ``safe``.
AUDITED_TIES: tuple[IdentityTie, ...] = (
    IdentityTie(
        "grad_stats",
        (("mp",), ("intra_dist_opt_instance",), ("tp_ep_pp", "tp_ep_gtp_remat_pp")),
        "ChainedOptimizer.grads_states_parallel_group_is_shared compares its sub-optimizers' grad-statistics "
        "groups with ==: the dense optimizer's mp (intra_dist_opt with the distributed optimizer) and the "
        "expert optimizer's tp_ep_pp (its EGTP variant); equal objects take the combined grad-norm branch "
        "(another reduction, not bit-identical)",
        "optimizer/optimizer.py:1744-1749; optimizer/__init__.py:678-685, 882-900",
        ("chained_grad_stats_eq",),
    ),
    IdentityTie(
        "fsdp_registration",
        (
            ("dp_cp", "intra_dp_cp", "gtp_remat_dp_cp"),
            ("ep_dp", "intra_ep_dp", "ep_gtp_remat_dp"),
            ("inter_dp_cp",),
        ),
        "Megatron-FSDP registers its NCCL memory pool on each group of ubr_groups (the dense and the expert "
        "FSDP group, the outer one with hybrid FSDP): one object in two entries is registered twice; 0.13's "
        "custom FSDP asserts that the dense and the expert group are two objects",
        "distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:2068-2096, 2238-2249",
        (
            "fsdp_dual_ubr_ne",
            "fsdp_dual_ubr_register",
            "fsdp_ubr_groups",
            "fsdp_multigroup_alloc",
            "nccl_multigroup_exit",
            "fsdp_manual_register",
            "fsdp_apex_multigroup",
        ),
    ),
    IdentityTie(
        "gtp_streams",
        (("gtp_remat",), ("expt_gtp_remat",)),
        "GTP keeps a side stream per group object (id(group)): one object puts the dense and the expert "
        "weight rematerialization on one stream, serialising what Megatron overlaps",
        "tensor_parallel/generalized_tensor_parallelism.py:319-346",
        ("gtp_stream_key_id",),
    ),
)

#: Never shared under ``safe``, whatever their members (checked before :data:`ROLES` and sizes).
NEVER_SHARED: tuple[SharingRule, ...] = (
    SharingRule(
        "all_gather_twin",
        ALL_GATHER_KINDS,
        "an all-gather twin exists only to be a second communicator beside its main group, so that "
        "the parameter all-gather overlaps the gradient reduce-scatter (Megatron FSDP's ag_stream)",
        "distributed/fsdp/mcore_fsdp_adapter.py:397-456; parallel_state.py:1586-1680",
    ),
    SharingRule(
        "tp_ep",
        ("tp_ep_mp",),
        "under the NCCL-EP backend (the flex dispatcher's 'ncclep') TransformerEngine borrows the tp_ep "
        "communicator and runs kernels outside torch's stream order; parallel_state cannot see that "
        "backend (a training setting), so tp_ep is kept apart always",
        "transformer/moe/fused_a2a.py:617-668; token_dispatcher.py:1611",
    ),
)

#: Under ``1`` and ``process``: an all-gather twin shares only with another twin, never with the
#: main group whose members and options it copies.
ALL_GATHER_RULE = NEVER_SHARED[0]

#: The other classes ``safe`` shares within, beside :data:`ROLES` (their reasons, for reports).
SAFE_SHARING: tuple[SharingRule, ...] = (
    *ROLES,
    SharingRule(
        "size1",
        (),
        "size-1 groups: a one-rank communicator carries no traffic to overlap or order",
    ),
    SharingRule(
        "gloo",
        (),
        "gloo twins among themselves: the distributed optimizer uses them on the main thread, one at a time",
        "optimizer/distrib_optimizer.py:713 (its one gloo group, used on the main thread)",
    ),
)

#: Why two requests are kept apart under ``safe`` beyond the rules (for the layout tool's report).
WORLD_NOTE = "WORLD is never handed out as a kind's group (pipeline p2p at pp 2 uses it beside pp)"


@functools.cache
def _desc_patterns() -> tuple[tuple[re.Pattern[str], str], ...]:
    """``group_desc`` (and gloo twins' descs) -> kind, as regular expressions."""
    out = []
    for kind in GROUP_KINDS.values():
        for desc in (kind.desc, kind.gloo_desc):
            if desc:
                pattern = re.escape(desc).replace(r"\{level\}", r"\d+").replace(r"\{size\}", r"\d+")
                out.append((re.compile(pattern + "$"), kind.name))
    return tuple(out)


@functools.cache
def kind_of_desc(desc: str | None) -> str | None:
    """The group kind whose ``group_desc`` (or gloo twin's) is ``desc``; ``None`` if no kind's."""
    if not desc:
        return None
    for pattern, kind in _desc_patterns():
        if pattern.match(desc):
            return kind
    return None


#: How a shared group's description names all its kinds: their descriptions joined by this.
DESC_JOIN = "+"


def kinds_of_desc(desc: str | None) -> tuple[str, ...]:
    """The kinds a (possibly merged, :data:`DESC_JOIN`-joined) ``group_desc`` names, in order.

    A part that is no kind's description is left out.
    """
    if not desc:
        return ()
    found = (kind_of_desc(part) for part in desc.split(DESC_JOIN))
    return tuple(kind for kind in found if kind is not None)


def merged_desc(current: str | None, added: str | None) -> str | None:
    """The description of a shared group once ``added``'s request is answered with it too.

    Each part once, in the order the kinds asked; ``None`` stays ``None`` when nothing is added.
    """
    if not added:
        return current
    if not current:
        return added
    parts = current.split(DESC_JOIN)
    return current if added in parts else DESC_JOIN.join([*parts, added])


@functools.cache
def _role_by_kind() -> dict[str, str]:
    return {kind: rule.name for rule in ROLES for kind in rule.kinds}


def role_of(kind: str | None) -> str | None:
    """The :data:`ROLES` entry ``kind`` belongs to, or ``None``."""
    return None if kind is None else _role_by_kind().get(kind)


def never_rule(kind: str | None) -> SharingRule | None:
    """The :data:`NEVER_SHARED` rule that keeps ``kind`` apart under ``safe``, or ``None``."""
    for rule in NEVER_SHARED:
        if kind in rule.kinds:
            return rule
    return None


@functools.cache
def _sides_of(kind: str | None) -> tuple[tuple[str, int], ...]:
    """``(tie, side)`` for every audited tie ``kind`` is on."""
    return tuple((tie.name, i) for tie in AUDITED_TIES for i, side in enumerate(tie.sides) if kind in side)


def tie_between(kind_a: str | None, kind_b: str | None) -> IdentityTie | None:
    """The audited tie that has ``kind_a`` and ``kind_b`` on different sides, or ``None``."""
    sides_b = dict(_sides_of(kind_b))
    for tie, side in _sides_of(kind_a):
        if tie in sides_b and sides_b[tie] != side:
            return next(t for t in AUDITED_TIES if t.name == tie)
    return None


def _is_gloo(backend: str | None) -> bool:
    return backend is not None and str(backend).lower() == "gloo"


def safe_class(kind: str | None, size: int, backend: str | None) -> Hashable | None:
    """What two requests must have in common (beyond the ordinary key) to share under ``safe``.

    ``None``: never shared. ``kind`` is the group kind (``None`` or a name outside the table:
    the request shares only with requests of that same name). A device group of a kind on an
    audited tie carries its sides in its size-1 class, so that no class joins two sides of a tie
    (the roles hold no two sides of one tie: ``tests/groups/test_sharing_policy.py`` checks it).
    """
    if never_rule(kind) is not None:
        return None
    if _is_gloo(backend):
        return ("gloo",)
    if size == 1:
        return ("size1", *_sides_of(kind))
    role = role_of(kind)
    return ("role", role) if role is not None else ("kind", kind)


def merge_rule(kind_a: str, kind_b: str, size: int, backend: str | None) -> SharingRule | None:
    """The :data:`SAFE_SHARING` rule under which ``safe`` gives two kinds one group, or ``None``.

    ``size`` and ``backend``: the shared group's. ``None`` when ``safe`` keeps the two apart (or
    when they are one kind: nothing to explain).
    """
    if kind_a == kind_b:
        return None
    cls = safe_class(kind_a, size, backend)
    if not isinstance(cls, tuple) or cls != safe_class(kind_b, size, backend):
        return None
    name = cls[0] if cls[0] in ("gloo", "size1") else cls[1]
    return next(rule for rule in SAFE_SHARING if rule.name == name)


def apart_reason(kind_a: str, kind_b: str) -> str:
    """Why ``safe`` keeps two coinciding groups of ``kind_a`` and ``kind_b`` apart."""
    for kind in (kind_a, kind_b):
        rule = never_rule(kind)
        if rule is not None:
            return f"{kind}: never shared ({rule.name}: {rule.reason.split(';')[0]})"
    tie = tie_between(kind_a, kind_b)
    if tie is not None:
        return f"an audited use sees both ({tie.name}): {tie.reason.split(':')[0]}"
    expert = {k for k in (kind_a, kind_b) if GROUP_KINDS.get(k) is not None and GROUP_KINDS[k].view == "expert"}
    if len(expert) == 1:
        return (
            "an expert kind and a dense one: traffic Megatron overlaps (MoE all-to-all / expert tp beside "
            "the gradient reduce-scatter, EP-overlap 1F1B) and ChainedOptimizer's combined grad-norm branch"
        )
    return (
        f"different roles ({role_of(kind_a) or kind_a} / {role_of(kind_b) or kind_b}): their traffic may be "
        "overlapped (e.g. dp_cp's reduce-scatter beside tp_dp_cp's or cp's collectives)"
    )


def policy_table() -> str:
    """Every identity ``safe`` may change and every tie it respects, as the markdown docs/compat.md prints.

    One row per class that joins kinds (its kinds, why the merge is harmless), then one per
    audited tie (its sides, what a merge would change). ``tests/groups/test_sharing_policy.py``
    checks that the page holds exactly this text.
    """
    rows = ["| class | kinds it may join | why Megatron cannot tell |", "|---|---|---|"]
    for rule in SAFE_SHARING:
        kinds = ", ".join(f"`{k}`" for k in rule.kinds) if rule.kinds else _CLASS_KINDS[rule.name]
        rows.append(f"| `{rule.name}` | {kinds} | {rule.reason} |")
    rows += ["", "| audited tie | sides (never joined with each other) | what a merge would change |", "|---|---|---|"]
    for tie in AUDITED_TIES:
        sides = " / ".join(", ".join(f"`{k}`" for k in side) for side in tie.sides)
        rows.append(f"| `{tie.name}` | {sides} | {tie.reason} (`{tie.megatron}`) |")
    return "\n".join(rows)


_CLASS_KINDS = {
    "size1": "any two kinds whose groups have one rank, unless an audited tie has them on different sides",
    "gloo": "any two gloo twins",
}
