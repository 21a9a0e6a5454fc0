"""pytest fixtures for your own tests: a simulated rank of any world, and real gloo worlds.

Off unless enabled: pass ``-p parallel_state_ng.testing.pytest_plugin`` to pytest, or put
``pytest_plugins = ["parallel_state_ng.testing.pytest_plugin"]`` in your top-level
``conftest.py``. It then gives:

``psng_simulated_rank``
    A function ``init(rank, world_size)`` that makes this process rank ``rank`` of a
    ``world_size``-rank world on torch's fake backend (no processes;
    :func:`parallel_state_ng.testing.worlds.init_simulated_rank`). Call it again for another
    rank or size: each call replaces the default process group. After the test, model
    parallelism a test left initialized (``compat.parallel_state``'s or megatron-core's own
    ``parallel_state``) is destroyed first, then the default group, so tests stay independent
    even when one fails halfway.

``psng_gloo_world`` (session scope)
    A function ``get(world_size)`` returning a :class:`parallel_state_ng.testing.worlds.GlooWorld`
    of that many CPU processes, one per size, kept for the whole session (per pytest-xdist
    worker) and closed at its end. A world closed by a failure (a timeout, a dead worker) is
    replaced by a new one on the next ``get``. Functions run on it must be module-level
    functions of your test modules (or any importable module).

The default timeout of a run on those worlds is 120 s; set it with the ini option
``psng_gloo_timeout`` or the command-line option ``--psng-gloo-timeout SECONDS`` (which wins).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from parallel_state_ng.testing.simulated import check_int, check_seconds

if TYPE_CHECKING:
    from parallel_state_ng.testing.worlds import GlooWorld

#: The default seconds a run on a ``psng_gloo_world`` world may take.
DEFAULT_TIMEOUT_S = 120.0
_INI = "psng_gloo_timeout"
_OPTION = "--psng-gloo-timeout"


def pytest_addoption(parser: pytest.Parser) -> None:
    """The default-timeout options."""
    help_text = f"seconds a run on a psng_gloo_world world may take by default ({DEFAULT_TIMEOUT_S:g})"
    parser.addini(_INI, help_text, default=str(DEFAULT_TIMEOUT_S))
    group = parser.getgroup("parallel_state_ng", "parallel_state_ng test worlds")
    group.addoption(_OPTION, dest=_INI, default=None, metavar="SECONDS", help=help_text)


def gloo_timeout(config: pytest.Config) -> float:
    """The default run timeout: the command-line option, else the ini option, else 120 s.

    Raises:
        pytest.UsageError: the value is not a positive number of seconds (named with the option).
    """
    value = config.getoption(_INI)
    source = _OPTION
    if value is None:
        value, source = config.getini(_INI), _INI
    try:
        return check_seconds(source, float(value))
    except (TypeError, ValueError):
        raise pytest.UsageError(f"{source} must be a positive number of seconds, got {value!r}") from None


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a bad timeout option before any test runs."""
    gloo_timeout(config)


@pytest.fixture
def psng_simulated_rank() -> Iterator[Callable[[int, int], None]]:
    """``init(rank, world_size)``: this process becomes that rank of a fake world (destroyed after the test)."""
    import torch.distributed as dist

    from parallel_state_ng.testing.simulated import destroy_simulated_world, init_simulated_rank

    def init(rank: int, world_size: int) -> None:
        init_simulated_rank(rank, world_size, replace=True)

    yield init
    _destroy_left_model_parallelism()
    if dist.is_initialized():
        destroy_simulated_world()


#: Modules whose ``destroy_model_parallel`` a simulated rank's teardown calls if left initialized.
_STATE_MODULES = ("compat.parallel_state", "megatron.core.parallel_state")


def _destroy_left_model_parallelism() -> None:
    # Only modules the test already imported: the teardown imports nothing. compat.install()
    # can make both names one module, so each module object is destroyed once.
    import sys

    seen: set[int] = set()
    for name in _STATE_MODULES:
        module = sys.modules.get(name)
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        if module.model_parallel_is_initialized():
            module.destroy_model_parallel()


@pytest.fixture(scope="session")
def psng_gloo_world(pytestconfig: pytest.Config) -> Iterator[Callable[[int], GlooWorld]]:
    """``get(world_size)``: the session's :class:`~parallel_state_ng.testing.worlds.GlooWorld` of that size."""
    from parallel_state_ng.testing.worlds import GlooWorld

    timeout = gloo_timeout(pytestconfig)
    worlds: dict[int, GlooWorld] = {}

    def get(world_size: int) -> GlooWorld:
        check_int("world_size", world_size, 1)
        world = worlds.get(world_size)
        if world is None or world.closed:
            world = worlds[world_size] = GlooWorld(world_size, timeout=timeout)
        return world

    yield get
    for world in worlds.values():
        world.close()
