"""NCCL options fidelity: each group's pg_options, timeout and desc as each release's own init gives them.

For every supported release, a process bound to it (:mod:`tests.support.releases.options_checks`)
records torch's creation calls (``new_group``, and ``split_group`` on the split path) with a
stand-in ``ProcessGroupNCCL.Options``, for MCore's ``initialize_model_parallel`` and compat's on
the member and the split path, on three ranks of five 16-rank configurations, with a
communicator config naming every group key the release reads (and ``high_priority_stream_groups``).
"""

from __future__ import annotations

import pytest

from tests.support.releases import wheels

# The fewest groups one release's played ranks hold over its configurations (0.12: 202).
MIN_GROUPS = 150


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.parametrize("series", list(wheels.RELEASES))
def test_group_options_match_release(series):
    version = wheels.RELEASES[series]
    result = wheels.run_in_release(version, "tests.support.releases.options_checks", "run")
    compared, mismatches = result["compared"], result["mismatches"]
    print(
        f"\n{version}: {len(result['configs'])} configs, {result['keys']} config keys, "
        f"{result['helper_calls']} get_nccl_options calls; groups compared member {compared['member']} "
        f"split {compared['split']}; mismatches member {mismatches['member']} split {mismatches['split']}; "
        f"options objects reused mcore {result['option_reuse']['mcore']} "
        f"compat {result['option_reuse']['member']}/{result['option_reuse']['split']}"
    )
    assert len(result["configs"]) >= 4, result["configs"]
    assert compared["member"] == compared["split"] >= MIN_GROUPS, compared
    assert not result["problems"], "\n".join(result["problems"][:40])
    assert mismatches == {"member": 0, "split": 0}
