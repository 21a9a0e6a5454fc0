"""``PSNG_SHARE_GROUPS=safe`` changes no group identity the policy does not list: every release.

For each release (0.12 ... 0.19), one process bound to it runs
``tests.support.releases.identity_checks.run``: over the size-1 corners (a single rank,
tp = pp = cp = ep = etp = 1, dp x cp = 1, ...) and a rotating part of random layouts of 2 to 64
ranks, on three ranks each (half the releases and a quarter of the random layouts a run,
rotating), compat's module globals are initialized with sharing unset and
under ``safe``, and every pair of group globals (so every pair of getters and of
``ProcessGroupCollection`` fields filled from them) is compared with ``is``. A pair that ``safe``
joins must be allowed by a rule of the policy (parallel_state_ng/layout/sharing_policy.py) and
cross no audited tie (a use of group objects Megatron makes, docs/compat.md "Identity audit");
``safe`` must not split an alias MCore makes itself. The merges found are the list
docs/compat.md prints.
"""

from __future__ import annotations

import pytest

from tests.support import rotation
from tests.support.releases import wheels

pytestmark = pytest.mark.slow

# Half the releases a run (every release in two runs), a quarter of the random layouts each:
# ~12 s a release on this 2-core machine. PSNG_TEST_ROTATION=all runs everything.
VERSIONS = rotation.sample(list(wheels.RELEASES.values()), keep=(), parts=2)
PARTS = 4
MIN_CONFIGS, MIN_RANKS = 12, 20


@pytest.mark.parametrize("version", VERSIONS)
def test_safe_changes_only_listed_identities(version):
    part = rotation.parts_to_run(PARTS)
    results = [
        wheels.run_in_release(version, "tests.support.releases.identity_checks", "run", p, PARTS, timeout=300)
        for p in part
    ]
    problems = [line for result in results for line in result["problems"]]
    assert not problems, f"megatron-core {version}:\n" + "\n".join(problems[:40])
    assert all(r["configs"] >= MIN_CONFIGS and r["ranks"] >= MIN_RANKS for r in results), results
    assert all(r["release"].startswith(version.rsplit(".", 1)[0]) for r in results)
    merged = {key for result in results for key in result["merges"]}
    assert merged, "safe joined nothing on any layout: the check saw no size-1 corner"
