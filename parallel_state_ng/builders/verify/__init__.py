"""Check a live job's process groups against the layout MCore would build: :func:`verify_groups`.

Each rank computes, from :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout` and
its group plan, the groups MCore gives *its own* rank for the stated configuration (no loop over
the world; :mod:`.expected`), compares them with what the source holds (read by
:mod:`.sources`; the comparison: :mod:`.rank_check`), and one all-gather over the default group
brings every rank's findings, with a hash of its stated configuration, to every rank
(:mod:`.job`); what is found: :mod:`.findings`. Creates no group. Every public name is
importable from here. See docs/engine.md ("Checking a job's groups").
"""

from __future__ import annotations

from parallel_state_ng.builders.verify.findings import TRAPS, Mismatch, RankCheck, VerifyReport
from parallel_state_ng.builders.verify.job import GroupMembershipError, StatedConfigMismatchError, verify_groups
from parallel_state_ng.builders.verify.rank_check import check_rank_groups

__all__ = [
    "TRAPS",
    "Mismatch",
    "RankCheck",
    "VerifyReport",
    "GroupMembershipError",
    "StatedConfigMismatchError",
    "check_rank_groups",
    "verify_groups",
]
