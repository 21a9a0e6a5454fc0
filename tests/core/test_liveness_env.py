"""The environment bounds of failure detection and of the destroy-time readiness wait."""

from __future__ import annotations

from datetime import timedelta

import pytest

from parallel_state_ng.core import liveness, naming


def test_unset_or_blank_bounds_take_their_defaults(monkeypatch):
    monkeypatch.delenv(liveness.ENV_FAILURE_TIMEOUT, raising=False)
    monkeypatch.setenv(naming.ENV_SETTLE_TIMEOUT, "  ")
    assert liveness.failure_timeout() == 30.0
    assert naming._settle_timeout() == timedelta(seconds=30)


def test_bounds_are_read_as_seconds(monkeypatch):
    monkeypatch.setenv(liveness.ENV_FAILURE_TIMEOUT, "4.5")
    monkeypatch.setenv(naming.ENV_SETTLE_TIMEOUT, "0")
    assert liveness.failure_timeout() == 4.5
    assert naming._settle_timeout() == timedelta(seconds=0.001)  # never an unbounded wait


@pytest.mark.parametrize("variable", [liveness.ENV_FAILURE_TIMEOUT, naming.ENV_SETTLE_TIMEOUT])
def test_a_bound_that_is_not_a_number_names_the_variable_and_value(monkeypatch, variable):
    monkeypatch.setenv(variable, "30s")
    read = liveness.failure_timeout if variable == liveness.ENV_FAILURE_TIMEOUT else naming._settle_timeout
    with pytest.raises(ValueError, match=rf"{variable} must be a number of seconds, got '30s'"):
        read()


def test_a_negative_failure_bound_is_refused(monkeypatch):
    monkeypatch.setenv(liveness.ENV_FAILURE_TIMEOUT, "-1")
    with pytest.raises(ValueError, match=rf"{liveness.ENV_FAILURE_TIMEOUT} must be >= 0, got -1.0"):
        liveness.failure_timeout()
