"""The shape of a row of :data:`~parallel_state_ng.layout.kinds.GROUP_KINDS`: :class:`GroupKind` and :class:`Fill`.

A :class:`GroupKind` states one kind of process group MCore builds; each :class:`Fill` one
module global it is published in. The table itself, and the queries over it, are in
:mod:`parallel_state_ng.layout.kinds`, which re-exports these names. Pure data: no
``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from parallel_state_ng.releases.facts import ReleaseFacts

__all__ = ["FillValue", "Fill", "GroupKind"]

#: What of a kind a global holds: its group, its rank list, its gloo twin, the groups of every
#: level (hierarchical cp), or the groups by size (hybrid dp × cp).
FillValue = Literal["group", "ranks", "gloo", "levels", "by_size"]


@dataclass(frozen=True)
class Fill:
    """One Megatron module global filled from a kind.

    ``name`` is the global, ``value`` what it holds. ``fallback`` names the global whose value
    it takes when this rank did not build the kind (MCore's aliases). ``collection`` is the
    ``ProcessGroupCollection`` field ``use_mpu_process_groups()`` fills from this global.
    """

    name: str
    value: FillValue = "group"
    fallback: str | None = None
    collection: str | None = None


@dataclass(frozen=True)
class GroupKind:
    """One kind of process group MCore builds.

    Attributes:
        name: the kind (MCore's NCCL config key where one exists).
        desc: the ``group_desc`` MCore gives its groups (``{level}`` / ``{size}`` filled in for
            the hierarchical and hybrid kinds).
        what: a description.
        view: the rank generator its groups come from: ``"dense"`` or ``"expert"`` (read off
            ``get_ranks(dims)``), ``"derived"`` (computed from other kinds), ``"all_gather"``
            (the all-gather generators).
        dims: the ``get_ranks`` tokens (``gtp_remat`` is dropped before 0.19); empty when derived.
        fills: the module globals it is published in.
        exists: :class:`ReleaseFacts` attributes of which one must hold for a release to build
            the kind (empty: every release).
        when: the configuration under which ``initialize_model_parallel`` builds it.
        gloo_desc: the ``group_desc`` of its gloo twin (``None``: it has none).
        nccl_key: the ``nccl_comm_cfgs`` key of its options (``None``: no options).
        gloo_nccl_options: its gloo twin is given the kind's NCCL options too (as MCore does).
        timeout: ``"init"`` (``distributed_timeout_minutes``) or ``"torch"`` (torch's default).
        timeout_flipped_by: a :class:`ReleaseFacts` attribute under which the other timeout applies.
        gloo_timeout: the gloo twin's timeout rule.
        several: what a rank in several groups of the kind keeps (a 0.12/0.13 encoder rank in
            several pipelines): ``"list"`` all of them, ``"last"`` the last one created.
    """

    name: str
    desc: str
    what: str
    view: Literal["dense", "expert", "derived", "all_gather"] = "dense"
    dims: tuple[str, ...] = ()
    fills: tuple[Fill, ...] = ()
    exists: tuple[str, ...] = ()
    when: str = "always"
    gloo_desc: str | None = None
    nccl_key: str | None = None
    gloo_nccl_options: bool = False
    timeout: Literal["init", "torch"] = "init"
    timeout_flipped_by: str | None = None
    gloo_timeout: Literal["init", "torch"] = "init"
    several: Literal["list", "last"] = "last"

    def timeout_rule(self, facts: ReleaseFacts) -> Literal["init", "torch"]:
        """The timeout rule of this kind's groups in the release of ``facts``."""
        if self.timeout_flipped_by and getattr(facts, self.timeout_flipped_by):
            return "torch" if self.timeout == "init" else "init"
        return self.timeout
