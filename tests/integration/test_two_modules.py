"""Two modules wired by Megatron 0.19's own bridge communicators: our topology vs Megatron's grids.

``scripts/examples/two_modules.py`` on fresh gloo processes with megatron-core 0.19.2's wheel: an
encoder-like module feeds a language-like module through ``BridgeCommunicator`` (disjoint
ranks: 0-1 and 2-5) or ``ColocatedBridgeCommunicator`` (both on ranks 0-3), forward and
backward, with SGD steps. Built from :func:`parallel_state_ng.build_topology` and from
Megatron's ``HyperCommGrid`` assembled by hand, every rank's losses, received activations and
final weights must be identical.
"""

from __future__ import annotations

import pytest

from scripts.examples import two_modules
from tests.support.releases import wheels as mcore_releases


def _check(results: list[dict], layout: str) -> None:
    spec = two_modules.LAYOUTS[layout]
    for rank, result in enumerate(results):
        ours, theirs = result["ours"], result["megatron"]
        assert ours == theirs, f"{layout} rank {rank}: {ours} != {theirs}"
        assert (ours["encoder"] is not None) == (rank in spec["encoder"][0])
        assert (ours["language"] is not None) == (rank in spec["language"][0])
        if ours["losses"]:
            assert len(ours["losses"]) == 2 and ours["losses"][1] < ours["losses"][0]
    lm_ranks = list(spec["language"][0])
    received = {tuple(results[r]["ours"]["received"]) for r in lm_ranks}
    assert len(received) == 2, "the two data-parallel replicas of the language module get different batches"
    encoders = {results[r]["ours"]["encoder"] for r in spec["encoder"][0]}
    assert len(encoders) == 1, "the encoder's data-parallel replicas stay in sync"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.parametrize("layout", sorted(two_modules.LAYOUTS))
def test_topology_and_megatron_grids_give_identical_runs(layout):
    path = str(mcore_releases.release_dir(mcore_releases.RELEASES["0.19"]))
    _check(two_modules.launch(layout, path, steps=2, timeout=600), layout)
