"""The pg_collection path's release data and set-up helper against each release (0.15 on).

The data in :mod:`parallel_state_ng.releases.new_code_path` is compared with each
release's sources (``ast``, no import); :func:`parallel_state_ng.megatron_schedule` and
:func:`parallel_state_ng.ensure_global_memory_buffer` run in a process bound to each release
whose schedules import without triton (0.15–0.18; 0.19's schedules import triton, which the
CPU torch lacks) and must pick MCore's own schedule and neighbours
(:mod:`tests.support.releases.new_code_path_checks`).
"""

from __future__ import annotations

import pytest

from parallel_state_ng.releases import as_release, installed_megatron_version
from parallel_state_ng.releases import new_code_path as facts
from parallel_state_ng.releases import parallel_state as api
from tests.support import rotation
from tests.support.releases import wheels
from tests.support.releases.new_code_path_checks import source_facts

SERIES = list(facts.FORWARD_BACKWARD_FUNC_PARAMS)
INSTALLED_SERIES = ".".join((installed_megatron_version() or "").split(".")[:2])
# What a grid-free function may name among parallel_state's globals.
_BUFFERS = {"_GLOBAL_MEMORY_BUFFER", "_MOE_LAYER_WISE_LOGGING_TRACKER"}


def test_series_with_a_pg_collection_path():
    assert SERIES == ["0.15", "0.16", "0.17", "0.18", "0.19"]
    assert set(facts.P2P_COMMUNICATOR_TAKERS) == set(facts.P2P_COMMUNICATOR) == set(SERIES)


@pytest.mark.network
@pytest.mark.parametrize("series", SERIES)
def test_release_data_matches_the_sources(series):
    root = wheels.release_dir(wheels.RELEASES[series]) / "megatron" / "core"
    found = source_facts(str(root), list(api.globals_of(series)))
    assert tuple(found["get_forward_backward_func"]) == facts.FORWARD_BACKWARD_FUNC_PARAMS[series]
    params = found["schedule_params"]
    for name in facts.SCHEDULE_FUNCTIONS:
        assert "pg_collection" in params[name], (series, name)
    takers = tuple(name for name in facts.SCHEDULE_FUNCTIONS if "p2p_communicator" in params[name])
    assert takers == facts.P2P_COMMUNICATOR_TAKERS[series]
    assert tuple(found["p2p_init"]) == facts.P2P_COMMUNICATOR[series][2]
    used = found["globals_used"]
    for name in facts.GRID_FREE_FUNCTIONS & set(api.functions(series)):
        assert set(used[name]["globals"]) <= _BUFFERS, f"{series} {name} reads {used[name]}: not grid-free"
        assert not set(used[name]["calls"]) & set(api.functions(series)) - facts.GRID_FREE_FUNCTIONS, (series, name)
    probes = set(facts.INITIALIZATION_PROBES) & set(api.functions(series))
    for name in probes:
        # a probe reads a global, or asks another probe (0.15/0.16 is_unitialized)
        assert used[name]["globals"] or set(used[name]["calls"]) & probes, f"{series} {name} is not a probe"
    assert as_release(series).series == series


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.network
# the installed series in every run, the others rotating in 2 parts (tests/support/rotation.py)
@pytest.mark.parametrize("series", rotation.sample(["0.15", "0.16", "0.17", "0.18"], keep={INSTALLED_SERIES}, parts=2))
def test_schedule_and_buffer_match_release(series):
    result = wheels.run_in_release(wheels.RELEASES[series], "tests.support.releases.new_code_path_checks", "run")
    assert result["cases"] == 5, result
    assert not result["problems"], "\n".join(result["problems"])
