"""Megatron 0.19's inference shards, served by the engine: the same groups, rank by rank.

One process bound to megatron-core 0.19 (:func:`tests.support.releases.wheels.run_in_release`)
runs :func:`tests.support.releases.inference_checks.run`: Megatron's own
``build_inference_pg_collection`` / ``build_inference_pg_collections_for_shards`` against
:mod:`parallel_state_ng.builders.inference` on a table of (configuration, rank) pairs, the bad
specs and sizes (Megatron's exception types), and ``compat.install()`` serving ours under
Megatron's names. The release facts are checked against every unzipped release's files here.
"""

from __future__ import annotations

import re

import pytest

from parallel_state_ng.releases import inference_shards as facts
from tests.support.releases import wheels


@pytest.mark.parametrize("series", list(wheels.RELEASES))
def test_served_functions_are_the_release_s(series):
    """``SERVED_FUNCTIONS`` lists exactly the shard builders each release's module defines."""
    version = wheels.RELEASES[series]
    path = wheels.cache_root() / version / "megatron" / "core" / "inference" / "shards.py"
    if not (wheels.cache_root() / version / "megatron").is_dir():
        pytest.skip(f"megatron-core {version} is not unzipped in the cache")
    defined = set(re.findall(r"^def (build_inference_\w+)\(", path.read_text(), re.M)) if path.is_file() else set()
    assert set(facts.SERVED_FUNCTIONS[series]) == defined


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
def test_inference_shards_match_release():
    result = wheels.run_in_release(wheels.RELEASES["0.19"], "tests.support.releases.inference_checks", "run")
    print(
        f"{result['pairs']} pairs ({result['single_pairs']} windows, {result['shards_pairs']} shard layouts, "
        f"{result['outside_pairs']} outside), {result['fields']} fields; new_group calls megatron "
        f"{result['megatron_calls']} (max {result['max_megatron_calls']}/rank), ours {result['our_calls']} "
        f"(max {result['max_our_calls']}/rank); {result['bad_cases']} bad cases ({result['bad_checks']} checks); "
        f"{result['install_checks']} install checks; stand-in parser {result['stand_in_pairs']} pairs; split path "
        f"{result['split_ranks']} ranks (max {result['splits_per_rank']} splits/rank)"
    )
    assert not result["mismatches"], "\n".join(result["mismatches"][:10])
    assert result["pairs"] >= 40 and result["outside_pairs"] >= 5 and result["fields"] >= 400, result
    assert result["shards_types_same"] == result["shards_pairs"], result
    assert result["bad_cases"] >= 8 and result["install_checks"] >= 7, result
    print("\n".join(result["bad_messages"]))
    assert result["max_our_calls"] <= 15 < result["max_megatron_calls"], result
    assert result["stand_in_pairs"] >= 10 and result["split_ranks"] >= 20, result
