"""``build_megatron_groups(...).collection()`` against each release's ``use_mpu_process_groups()``.

Each release with a ``ProcessGroupCollection`` (0.15 on) runs in its own process
(:func:`tests.support.releases.wheels.run_in_release`): hand-written and seeded configurations,
0.17+ also placed on part of a larger world (``rank_offset`` / ``local_world_size``), several
ranks each, fake backend. Every field of every sampled rank must hold the ranks MCore's own
collection holds after ``initialize_model_parallel`` with the same arguments, and what MCore
rejects must be rejected (:mod:`tests.support.releases.collection_checks`).
"""

from __future__ import annotations

import pytest

from parallel_state_ng.releases import installed_megatron_version
from parallel_state_ng.releases import process_groups_config as facts
from tests.support import rotation
from tests.support.releases import wheels

SEED = 17
SERIES = [s for s, cls in facts.COLLECTION_CLASS.items() if cls is not None]
INSTALLED_SERIES = ".".join((installed_megatron_version() or "").split(".")[:2])


def test_series_with_a_collection():
    assert SERIES == ["0.15", "0.16", "0.17", "0.18", "0.19"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
# the installed series and 0.19 in every run, the others rotating in 3 parts (tests/support/rotation.py)
@pytest.mark.parametrize("series", rotation.sample(SERIES, keep={INSTALLED_SERIES, "0.19"}, parts=3))
def test_collection_matches_release(series):
    version = wheels.RELEASES[series]
    result = wheels.run_in_release(version, "tests.support.releases.collection_checks", "run", SEED, 24)
    print(
        f"{version}: {result['configs']} configs, {result['ranks']} ranks, {result['fields']} fields, "
        f"{result['rejected_by_both']} rejected by both, {len(result['mismatches'])} mismatches"
    )
    assert not result["mismatches"], "\n".join(result["mismatches"][:10])
    assert result["ranks"] >= 50 and result["fields"] >= 50 * 20, result
    # 0.17+ place modules on part of the world: those configurations are compared too
    assert (result["offset_configs"] > 0) == (series >= "0.17"), result
    assert (result["gtp_configs"] > 0) == (series >= "0.19"), result
