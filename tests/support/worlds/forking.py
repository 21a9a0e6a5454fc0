"""When a process forked from a server that has imported torch may stand in for a fresh one.

Shared by the gloo worlds' workers (:mod:`tests.support.worlds.gloo`) and the release-bound
calls (:mod:`tests.support.releases.forkserver`): ``$PSNG_RELEASE_FORK=0`` turns forking off,
and a server serves only callers whose environment matches the one it started with
(:func:`env_key`).
"""

from __future__ import annotations

DISABLE_VAR = "PSNG_RELEASE_FORK"  # "0": every call in a fresh interpreter


def env_key(env: dict[str, str]) -> dict[str, str]:
    """What of ``env`` torch could read at import: all but ``PSNG_*`` (read only by this project)
    and ``PYTEST_CURRENT_TEST``; a server started with another key cannot serve ``env``.
    """
    return {k: v for k, v in env.items() if not k.startswith("PSNG_") and k != "PYTEST_CURRENT_TEST"}
