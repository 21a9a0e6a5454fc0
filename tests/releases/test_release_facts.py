"""The legacy releases' data (0.12.3, 0.13.1) against their own modules, apart from compat.

compat serves every supported release from ``parallel_state_ng.releases.parallel_state``, and
``tests/releases/test_releases_compat.py`` checks compat against each release (which checks the data it
serves). The 0.12/0.13 entries are written as differences from 0.14
(``releases/parallel_state/legacy.py``) and also drive ``port --upgrade``: here each legacy
release's own ``parallel_state``, imported in its own process, is compared directly with what
the data says about it — functions with parameter names, kinds, defaults and module order,
state globals with their import-time values, ``RankGenerator`` — both directions.
"""

from __future__ import annotations

import pytest

from parallel_state_ng.releases import KNOWN_SERIES, SUPPORTED_SERIES, parse_release
from tests.support.releases import wheels


def test_legacy_series_are_supported():
    assert set(wheels.LEGACY_RELEASES) <= set(SUPPORTED_SERIES) == set(KNOWN_SERIES)
    assert [s for s in SUPPORTED_SERIES if parse_release(s).before("0.14")] == sorted(wheels.LEGACY_RELEASES)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
@pytest.mark.parametrize("version", sorted(wheels.LEGACY_RELEASES.values()))
def test_data_matches_legacy_release(version):
    result = wheels.run_in_release(version, "tests.support.releases.facts_checks", "facts_report", version)
    assert result["functions"] >= 80 and result["globals"] >= 45 and result["rank_generator_methods"] == 3, result
    assert not result["problems"], "\n".join(result["problems"])
