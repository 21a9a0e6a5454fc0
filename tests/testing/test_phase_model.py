"""The scale model of scripts/bench/phases.py: the fitted lines and MCore's calls x per-call cost."""

from __future__ import annotations

import pytest

from scripts.bench.phases import fit, model


def test_fit_recovers_a_line():
    a, b = fit({4: 1.0 + 0.5 * 4, 8: 1.0 + 0.5 * 8, 16: 1.0 + 0.5 * 16})
    assert a == pytest.approx(1.0) and b == pytest.approx(0.5)


def test_mcore_creation_grows_as_calls_times_per_call_cost_compat_keeps_its_calls():
    def row(calls: float, per_call: float) -> dict:
        return {
            "agreement_s": 0.01,
            "closing_s": 0.0,
            "protocol_store_s": 0.0,
            "first_use_s": 0.1,
            "calls": calls,
            "create_s": calls * per_call,
        }

    # MCore: 6 calls per 1 rank of world (linear), each costing 0.001 s per rank of world
    mcore = model({8: row(48, 0.008), 16: row(96, 0.016)}, "mcore")
    assert mcore[1024]["calls"] == pytest.approx(6144)
    assert mcore[1024]["create_s"] == pytest.approx(6144 * 1.024)
    compat = model({8: row(17, 0.01), 16: row(17, 0.01)}, "compat")
    assert compat[65536]["calls"] == 17 and compat[65536]["create_s"] == pytest.approx(0.17)
    assert compat[65536]["total_s"] == pytest.approx(0.01 + 0.17 + 0.1)
