"""Queries of the per-release facts (``parallel_state_ng.releases.parallel_state`` and
``.process_groups_config``).

The facts themselves are checked against every release's own module by
``tests/releases/test_releases_compat.py`` (compat serves exactly them); here: the queries an upgrade
checker relies on, and the counts docs/releases.md states.
"""

from __future__ import annotations

import pytest

from parallel_state_ng.releases import KNOWN_SERIES
from parallel_state_ng.releases import parallel_state as api
from parallel_state_ng.releases import process_groups_config as pgc
from parallel_state_ng.releases.facts import release_facts


@pytest.mark.parametrize(
    "series, functions, globals_, fields",
    [
        ("0.12", 86, 47, 0),
        ("0.13", 87, 49, 0),
        ("0.14", 79, 47, 0),
        ("0.15", 80, 48, 20),
        ("0.16", 86, 52, 20),
        ("0.17", 82, 51, 20),
        ("0.18", 82, 50, 22),
        ("0.19", 90, 60, 27),
    ],
)
def test_counts_per_release(series, functions, globals_, fields):
    assert len(api.functions(series)) == functions
    assert len(api.globals_of(series)) == globals_
    assert len(pgc.collection_fields(series)) == fields


def test_positional_changes_name_the_moved_parameters():
    assert api.positional_changes("get_data_parallel_group", "0.18", "0.19") == [
        (1, "partial_data_parallel", "with_gtp_remat")
    ]
    assert api.positional_changes("get_tensor_and_data_parallel_group", "0.14", "0.15") == [
        (0, "with_context_parallel", "check_initialized")
    ]
    assert api.positional_changes("get_data_parallel_group", "0.16", "0.17") == []
    # 0.18 drops independent_all_gather (third positional of 0.16/0.17)
    assert api.positional_changes("get_data_parallel_group", "0.17", "0.18") == [(2, "independent_all_gather", None)]
    moved = api.positional_changes("initialize_model_parallel", "0.18", "0.19")
    assert moved[0] == (9, "num_distributed_optimizer_instances", "gtp_remat_size") and len(moved) == 12
    with pytest.raises(ValueError, match="does not exist in megatron-core 0.14"):
        api.positional_changes("update_pg_timeout", "0.14", "0.15")


def test_has_and_signature_queries():
    assert api.has("initialize_model_parallel.rank_offset", "0.17.1")
    assert not api.has("initialize_model_parallel.rank_offset", "0.16")
    assert api.has("create_all_gather_groups", "0.18") and not api.has("has_separate_all_gather_group", "0.18")
    assert release_facts("0.16").expert_group_timeout and not release_facts("0.15").expert_group_timeout
    assert release_facts("0.12").nccl_config_defaults and not release_facts("0.13").nccl_config_defaults
    assert api.signature("is_unitialized", "0.17") is None
    assert dict(api.signature("get_data_parallel_group", "0.19"))["with_gtp_remat"] is True
    assert "gtp_remat" in dict(api.rank_generator_methods("0.19")["__init__"])
    assert "get_gtp_ranks" not in api.rank_generator_methods("0.18")
    with pytest.raises(KeyError, match="unknown name"):
        api.has("no_such_fact", "0.19")
    with pytest.raises(ValueError, match="not a known series"):
        api.functions("0.11")


def test_every_variant_range_is_ordered_and_disjoint():
    series = list(KNOWN_SERIES)  # the supported releases and the legacy ones the data knows (0.12, 0.13)
    for table in (api.FUNCTIONS, api.RANK_GENERATOR):
        for name, variants in table.items():
            covered = [s for v in variants for s in series if v.covers(s)]
            assert len(covered) == len(set(covered)), f"{name}: overlapping variants"
            assert covered == sorted(covered, key=series.index), f"{name}: variants out of order"
