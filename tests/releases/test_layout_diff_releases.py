"""``layout --diff`` between releases against the releases themselves.

For each configuration of :data:`scripts.examples.release_pairs.CONFIGS` every supported release
runs its own ``initialize_model_parallel`` (default options: gloo twins on) once, recorded by
:func:`tests.support.releases.layout_checks.record_layouts` in a process bound to that release
(8 subprocess calls in all, each recording every configuration). The recordings become
snapshots; for every pair of releases the diff of the two recordings
(:func:`~parallel_state_ng.layout.layout_diff.diff_snapshots`) must be exactly what
``layout --diff --release A --against B`` claims from our model: the kinds that appear or vanish,
the groups and ranks that change, desc / timeout / gloo-twin changes, communicators per rank.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from parallel_state_ng.layout.kinds import GROUP_KINDS
from parallel_state_ng.layout.layout_diff import diff_snapshots
from parallel_state_ng.layout.snapshot import SCHEMA, validate_snapshot
from scripts.examples.release_pairs import CONFIGS, claimed_diff
from tests.support.releases.wheels import RELEASES, run_in_release

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.network]

NAMES = list(CONFIGS)


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[dict[str, Any]]]:
    """Per release: its recorded init of every configuration (one subprocess per release)."""
    configs = list(CONFIGS.values())
    return {
        series: run_in_release(version, "tests.support.releases.layout_checks", "record_layouts", series, configs)
        for series, version in RELEASES.items()
    }


def real_snapshot(series: str, record: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """A release's recorded init as a snapshot (``config``: the claimed snapshot's, the same inputs).

    ``flipped_by`` is the table's explanation of a timeout rule, not something a recording shows.
    """
    assert "error" not in record, f"{series} rejected the configuration: {record.get('error')}"
    assert record["problems"] == [], record["problems"]
    kinds = {}
    for kind, entry in record["kinds"].items():
        row = GROUP_KINDS["hcp" if kind.startswith("hcp") else kind]
        kinds[kind] = {**entry, "timeout": {"rule": entry["timeout"], "flipped_by": row.timeout_flipped_by}}
    return validate_snapshot(
        {"schema": SCHEMA, "release": series, "config": config, "kinds": kinds}, f"{series} recording"
    )


@pytest.mark.parametrize("name", NAMES)
def test_release_pair_diffs_match_the_releases(recorded, name: str) -> None:
    index = NAMES.index(name)
    changed_pairs = 0
    for old, new in itertools.combinations(RELEASES, 2):
        claimed = claimed_diff(CONFIGS[name], old, new)
        real_old = real_snapshot(old, recorded[old][index], claimed["old"]["config"])
        real_new = real_snapshot(new, recorded[new][index], claimed["new"]["config"])
        real = diff_snapshots(real_old, real_new, old, new).as_json()
        assert claimed == real, f"{name}: {old} -> {new}"
        changed_pairs += not claimed["same"]
    assert changed_pairs > 0  # some pair differs for every configuration (0.12 -> 0.19 at least)
