"""Every group compat creates names its kinds in its ``group_desc``, and the layout places it back.

The hang diagnosis reads a group's description from a flight-recorder dump and the layout
(parallel_state_ng/layout/hang/place.py): each description must name a kind (all of them when
the group is shared, ``A+B``) and the kind's group on any member must be exactly the group's
members. One simulated rank of 16 (fake backend), every dense and expert kind, unshared and
under ``PSNG_SHARE_GROUPS=safe``.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import compat.parallel_state as ps
from parallel_state_ng.groups.creation import live_groups
from parallel_state_ng.groups.sharing import set_group_sharing
from parallel_state_ng.layout.hang import Placer
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.sharing_policy import kinds_of_desc
from parallel_state_ng.testing.worlds import simulated_rank

SIZES = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "context_parallel_size": 2}


@pytest.mark.parametrize("sharing", ["off", "safe"])
def test_every_group_names_its_kinds_and_is_placed_back(sharing):
    rank = 13
    layout = MegatronLayout(16, expert_model_parallel_size=2, **SIZES)
    placer = Placer(layout)
    set_group_sharing(sharing)
    try:
        with simulated_rank(rank, 16):
            ps.initialize_model_parallel(expert_model_parallel_size=2, **SIZES)
            try:
                shared = 0
                for group in live_groups():
                    members = dist.get_process_group_ranks(group)
                    assert rank in members
                    desc = group.group_desc
                    kinds = kinds_of_desc(desc)
                    assert kinds, f"group {members} has no kind's description: {desc!r}"
                    place = placer.place("g", desc, rank, members)
                    assert [k.kind for k in place.kinds] == list(kinds), (desc, members, place)
                    shared += len(kinds) > 1
                assert (shared > 0) == (sharing == "safe")
            finally:
                ps.destroy_model_parallel()
    finally:
        set_group_sharing(None)
