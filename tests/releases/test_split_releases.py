"""The split path's protocol against every supported release (simulated worlds, every rank played).

In a process bound to each release (:mod:`tests.support.releases.split_checks`), compat's
``initialize_model_parallel`` (and ``create_all_gather_groups`` where the release has it) runs
on every rank of each configuration the release takes, on the split path and on the member
path: every rank makes the same splits, colours agree within a group and differ across
groups, and each rank's groups are the member path's. See docs/results/gpus.md.

Each release's configurations are split in PARTS; a run covers the part of the day
(tests/support/rotation.py), ``PSNG_TEST_ROTATION=all`` every part.
"""

from __future__ import annotations

import pytest

from tests.support import rotation
from tests.support.releases import wheels

PARTS = 3


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.parametrize("series", list(wheels.RELEASES))
@pytest.mark.parametrize("part", rotation.parts_to_run(PARTS), ids=lambda part: f"part{part + 1}of{PARTS}")
def test_split_protocol_matches_the_member_path(series, part):
    result = wheels.run_in_release(wheels.RELEASES[series], "tests.support.releases.split_checks", "run", part, PARTS)
    print(
        f"split protocol {result['release']}: {result['configs']} configs, {result['ranks']} ranks played, "
        f"{result['splits']} splits, {result['mismatches']} mismatches ({result['seconds']} s)"
    )
    assert result["configs"] >= 10 // PARTS, result
    assert result["mismatches"] == 0 and not result["problems"], "\n".join(result["problems"])
