"""The per-release data for the releases compat does not serve (0.12.3, 0.13.1) against their modules.

compat serves 0.14-0.19 from ``parallel_state_ng.releases.parallel_state``, and
``tests/test_releases_compat.py`` checks compat against each of those releases (which checks the
data they share). The data also knows 0.12 and 0.13 (``KNOWN_SERIES``, for ``port --upgrade``):
here each of those releases' own ``parallel_state``, imported in its own process, is compared
with what the data says about it — functions with parameter names, kinds, defaults and module
order, state globals with their import-time values, ``RankGenerator`` — both directions.
"""

from __future__ import annotations

import pytest

import mcore_releases
from parallel_state_ng.releases import KNOWN_SERIES, SUPPORTED_SERIES


def test_legacy_series_are_known_not_supported():
    assert set(mcore_releases.LEGACY_RELEASES) == set(KNOWN_SERIES) - set(SUPPORTED_SERIES)


@pytest.mark.parametrize("version", sorted(mcore_releases.LEGACY_RELEASES.values()))
def test_data_matches_legacy_release(version):
    result = mcore_releases.run_in_release(version, "release_facts_checks", "facts_report", version)
    assert result["functions"] >= 80 and result["globals"] >= 45 and result["rank_generator_methods"] == 3, result
    assert not result["problems"], "\n".join(result["problems"])
