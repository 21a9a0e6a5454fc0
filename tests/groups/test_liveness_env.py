"""The environment bounds of failure detection and of the destroy-time readiness wait; the per-build
creation context that reads them; the one-round-trip read of the verdict rounds.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from parallel_state_ng.groups import creation, liveness


def test_unset_or_blank_bounds_take_their_defaults(monkeypatch):
    monkeypatch.delenv(liveness.ENV_FAILURE_TIMEOUT, raising=False)
    monkeypatch.setenv(creation.ENV_SETTLE_TIMEOUT, "  ")
    assert liveness.failure_timeout() == 30.0
    assert creation._settle_timeout() == timedelta(seconds=30)


def test_bounds_are_read_as_seconds(monkeypatch):
    monkeypatch.setenv(liveness.ENV_FAILURE_TIMEOUT, "4.5")
    monkeypatch.setenv(creation.ENV_SETTLE_TIMEOUT, "0")
    assert liveness.failure_timeout() == 4.5
    assert creation._settle_timeout() == timedelta(seconds=0.001)  # never an unbounded wait


@pytest.mark.parametrize("variable", [liveness.ENV_FAILURE_TIMEOUT, creation.ENV_SETTLE_TIMEOUT])
def test_a_bound_that_is_not_a_number_names_the_variable_and_value(monkeypatch, variable):
    monkeypatch.setenv(variable, "30s")
    read = liveness.failure_timeout if variable == liveness.ENV_FAILURE_TIMEOUT else creation._settle_timeout
    with pytest.raises(ValueError, match=rf"{variable} must be a finite number of seconds, got '30s'"):
        read()


def test_a_negative_failure_bound_is_refused(monkeypatch):
    monkeypatch.setenv(liveness.ENV_FAILURE_TIMEOUT, "-1")
    with pytest.raises(ValueError, match=rf"{liveness.ENV_FAILURE_TIMEOUT} must be >= 0, got -1.0"):
        liveness.failure_timeout()


# --------------------------------------------------------------------------- creation context
def test_creation_context_is_unbounded_on_the_fake_backend_and_without_a_world(fake_world):
    fake_world(3, 8)
    context = liveness.CreationContext.current()
    assert (context.bound, context.rank, context.store) == (0.0, 3, None)
    assert "fake" in context.default_backend
    dist.destroy_process_group()
    assert liveness.CreationContext.current() == liveness.CreationContext(0.0, "", 0, None)


def _context_in_this_world(failure_timeout: str | None) -> tuple[float, str, int, bool]:
    import os

    previous = os.environ.pop(liveness.ENV_FAILURE_TIMEOUT, None)
    if failure_timeout is not None:
        os.environ[liveness.ENV_FAILURE_TIMEOUT] = failure_timeout
    try:
        context = liveness.CreationContext.current()
    finally:
        os.environ.pop(liveness.ENV_FAILURE_TIMEOUT, None)
        if previous is not None:
            os.environ[liveness.ENV_FAILURE_TIMEOUT] = previous
    return context.bound, context.default_backend, context.rank, context.store is not None


def test_creation_context_reads_the_bound_backend_rank_and_store_of_a_gloo_world(gloo_world):
    world = gloo_world(2)
    assert world.run(_context_in_this_world, None) == [(21.0, "gloo", 0, True), (21.0, "gloo", 1, True)]
    assert world.run(_context_in_this_world, "10") == [(7.0, "gloo", 0, True), (7.0, "gloo", 1, True)]
    # the bound off: no creation is bounded, so no store is needed
    assert world.run(_context_in_this_world, "0") == [(0.0, "gloo", 0, False), (0.0, "gloo", 1, False)]


# --------------------------------------------------------------------------- one-round-trip read
def test_read_present_returns_the_value_and_leaves_it_unchanged():
    from parallel_state_ng.groups.agreement_protocol import read_present

    store = dist.HashStore()
    store.set("verdict", '{"status": "ok"}')
    assert read_present(store, "verdict") == b'{"status": "ok"}'
    assert store.get("verdict") == b'{"status": "ok"}'
    prefixed = dist.PrefixStore("round/", store)
    prefixed.set("verdict", "mismatch")
    assert read_present(prefixed, "verdict") == b"mismatch"
    assert prefixed.get("verdict") == b"mismatch"
