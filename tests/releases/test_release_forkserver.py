"""The fork server behind ``run_in_release`` (``tests/support/releases/forkserver.py``).

Each call is a process of its own, forked from the release's zygote: what one call changes
(module globals, ``torch.distributed`` functions, ``sys.modules``, the environment) is not seen
by the next; the caller's environment reaches the call; a failing or hanging call is reported
as a fresh interpreter's would be, and the server keeps serving.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.releases import wheels

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.network]

VERSION = wheels.RELEASES["0.14"]
_TOUCHED: list[int] = []  # a module global the first call changes


def touch_everything() -> dict:
    """Child side: change module state, torch.distributed, sys.modules and the environment."""
    import torch.distributed as dist

    _TOUCHED.append(os.getpid())
    dist.new_group = None
    sys.modules["megatron.core.user_code"] = sys.modules[__name__]
    os.environ["PSNG_TOUCHED"] = "1"
    return {"pid": os.getpid()}


def observe(name: str) -> dict:
    """Child side: what this process sees of the state a previous call may have changed."""
    import importlib
    import importlib.metadata

    import torch.distributed as dist

    return {
        "pid": os.getpid(),
        "touched": list(_TOUCHED),
        "new_group": callable(dist.new_group),
        "user_code": "megatron.core.user_code" in sys.modules,
        "touched_env": os.environ.get("PSNG_TOUCHED"),
        "env": os.environ.get(name),
        "release": importlib.metadata.version("megatron-core"),
        "parallel_state": importlib.import_module("megatron.core.parallel_state").__file__.startswith(
            str(wheels.release_dir(VERSION))
        ),
        "cwd": os.getcwd(),
    }


def fail() -> None:
    """Child side: raise."""
    raise ValueError("failed on purpose")


def hang() -> None:
    """Child side: never return."""
    import time

    time.sleep(600)


def test_calls_are_isolated_and_see_the_callers_environment():
    first = wheels.run_in_release(VERSION, __name__, "touch_everything")
    forked = wheels.run_in_release(VERSION, __name__, "observe", "PSNG_PROBE", env={"PSNG_PROBE": "forked"})
    fresh = wheels.run_in_release(VERSION, __name__, "observe", "PSNG_PROBE", env={"PSNG_PROBE": "forked"}, fresh=True)
    assert len({first["pid"], forked["pid"], fresh["pid"]}) == 3
    expected = {
        "touched": [],
        "new_group": True,
        "user_code": False,
        "touched_env": None,
        "env": "forked",
        "release": VERSION,
        "parallel_state": True,
        "cwd": str(wheels.ROOT),
    }
    for seen in (forked, fresh):
        assert {k: v for k, v in seen.items() if k != "pid"} == expected


def test_failures_and_timeouts_are_reported_and_the_server_keeps_serving():
    with pytest.raises(RuntimeError, match=r"(?s)fail on megatron-core .*ValueError: failed on purpose"):
        wheels.run_in_release(VERSION, __name__, "fail")
    with pytest.raises(subprocess.TimeoutExpired):
        wheels.run_in_release(VERSION, __name__, "hang", timeout=2)
    assert wheels.run_in_release(VERSION, __name__, "observe", "PSNG_PROBE")["release"] == VERSION
