"""The split path's protocol against every supported release (simulated worlds, every rank played).

In a process bound to each release (:mod:`tests.support.releases.split_checks`), compat's
``initialize_model_parallel`` (and ``create_all_gather_groups`` where the release has it) runs
on every rank of each configuration the release takes, on the split path and on the member
path: every rank makes the same splits, colours agree within a group and differ across
groups, and each rank's groups are the member path's. See docs/gpus.md.
"""

from __future__ import annotations

import pytest

from tests.support.releases import wheels


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.parametrize("series", list(wheels.RELEASES))
def test_split_protocol_matches_the_member_path(series):
    result = wheels.run_in_release(wheels.RELEASES[series], "tests.support.releases.split_checks", "run")
    print(
        f"split protocol {result['release']}: {result['configs']} configs, {result['ranks']} ranks played, "
        f"{result['splits']} splits, {result['mismatches']} mismatches ({result['seconds']} s)"
    )
    assert result["configs"] >= 10, result
    assert result["mismatches"] == 0 and not result["problems"], "\n".join(result["problems"])
