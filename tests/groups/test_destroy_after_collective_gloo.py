"""Freeing destroyed groups right after a collective (torch before 2.8: a GIL deadlock).

Torch before 2.8 destroys a ProcessGroup's backend under the GIL when the last Python reference
goes, while a gloo worker thread may still hold the backend's work mutex and wait for the GIL to
free a finished collective's tensor (TORCH_FACTS ``pg_destructor_releases_gil``). The engine's
``destroy_groups`` keeps destroyed groups' backends until its next call there. The gloo test is
the measured case (docs/results/torch.md: a rank hung within the first 5 cycles on 2.5.1 and 2.6.0
without the kept backends); the torch matrix runs it on those releases.
"""

from __future__ import annotations

import pytest
import torch

from parallel_state_ng.groups import creation
from tests.compat.test_compat_handles_gloo import _handles_agree_with_getters


@pytest.mark.multiprocess
def test_groups_freed_right_after_collectives_do_not_hang(gloo_world):
    # Each run: init with gloo twins, collectives through the state's handles, destroy; the
    # handles, the groups' last references, go when the function returns.
    world = gloo_world(4)
    for _ in range(10):
        for facts, *_ in world.run(_handles_agree_with_getters, timeout=60):
            assert all(facts.values()), facts


def test_before_torch_2_8_destroy_keeps_backends_until_its_next_call(fake_world, monkeypatch):
    monkeypatch.setattr(creation, "torch_has", lambda fact: fact != "pg_destructor_releases_gil")
    fake_world(0, 4)
    first = [creation.new_member_group([0, 1]), creation.new_member_group([0, 2])]
    assert creation.destroy_groups(first) == 2
    kept = list(creation._kept_backends)
    assert len(kept) >= 2 and all(b is not None for b in kept)
    second = [creation.new_member_group([0, 3])]
    assert creation.destroy_groups(second) == 1
    assert not any(any(b is k for k in kept) for b in creation._kept_backends)  # the first call's freed
    creation._free_kept_backends()  # what exit runs
    assert creation._kept_backends == []


def test_from_torch_2_8_destroy_keeps_nothing(fake_world):
    if not creation.torch_has("pg_destructor_releases_gil"):
        pytest.skip(f"torch {torch.__version__} frees a group's backend under the GIL")
    fake_world(0, 4)
    assert creation.destroy_groups([creation.new_member_group([0, 1])]) == 1
    assert creation._kept_backends == []
