"""The scripts' world launcher: CPU processes joined in one gloo world, on
:class:`parallel_state_ng.testing.worlds.GlooWorld`.

A script hands a module-level function (importable by the workers: defined in a module of
``scripts``, never in ``__main__``) and its arguments; every rank calls it with the default
process group set to the gloo world, and the results come back ordered by rank. Failures are
:class:`~parallel_state_ng.testing.worlds.GlooWorld`'s, naming the ranks.

* :func:`open_world`: a world kept for several runs (``with open_world(4) as world: ...``);
* :func:`run_on_world`: one run on a fresh world, closed afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from parallel_state_ng.testing.worlds import GlooWorld

#: The workers' environment of a script whose ranks import Megatron: its warnings silenced.
QUIET = {"PYTHONWARNINGS": "ignore"}


def open_world(
    world_size: int,
    *,
    timeout: float = 120.0,
    start_timeout: float = 180.0,
    env: Mapping[str, str] | None = None,
) -> GlooWorld:
    """A gloo world of ``world_size`` CPU processes, kept until closed (use it in a ``with``).

    Args:
        world_size: the number of processes (ranks).
        timeout: seconds a run may take unless the run says otherwise.
        start_timeout: seconds the workers may take to start and join.
        env: variables set in the workers on top of this process's environment (e.g. :data:`QUIET`).
    """
    return GlooWorld(world_size, env=env, timeout=timeout, start_timeout=start_timeout)


def run_on_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    start_timeout: float = 180.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """``fn(*args)`` on every rank of a fresh gloo world of ``world_size`` processes; the
    results by rank. The world is closed afterwards, whatever happened.

    ``timeout`` bounds the run, ``start_timeout`` the start; ``env`` as in :func:`open_world`.
    """
    with open_world(world_size, timeout=timeout, start_timeout=start_timeout, env=env) as world:
        return world.run(fn, *args)
