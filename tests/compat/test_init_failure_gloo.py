"""A rank dies while groups are being created: every survivor raises, names it, leaves nothing.

Real 4-rank gloo worlds with a short failure bound (``PSNG_FAILURE_TIMEOUT``): rank 3 exits
inside its k-th ``new_group`` call during ``initialize_model_parallel``, ``build_megatron_groups``,
a grid's ``create_pg`` or ``build_topology``. Every survivor must raise
:class:`~parallel_state_ng.groups.liveness.RankFailureError` naming rank 3, well within the
bound (not the 30-minute group timeout), with no group left in torch's registry.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.support import rotation
from tests.support.worlds.failure import run_world

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORLD = 4
LOST = 3
BOUND = "4"
ENV = {"PSNG_FAILURE_TIMEOUT": BOUND}


def _die_at_new_group(rank: int, k: int) -> None:
    """Make rank LOST exit inside its k-th torch new_group call (before connecting)."""
    import torch.distributed as dist

    if rank != LOST:
        return
    original = dist.new_group
    calls = [0]

    def dying(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            os._exit(1)
        return original(*args, **kwargs)

    dist.new_group = dying


def _build(what: str) -> object:
    if what == "initialize_model_parallel":
        import compat.parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        return ps
    if what == "build_megatron_groups":
        from parallel_state_ng import build_megatron_groups

        return build_megatron_groups(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    if what == "create_pg":
        from parallel_state_ng import HyperCommGrid

        grid = HyperCommGrid([2, 2], ["tp", "dp"], backend="gloo")
        try:
            grid.create_pg("tp")
            grid.create_pg("dp")
            grid.create_pg(["tp", "dp"])
        except BaseException:
            grid.destroy()
            raise
        return grid
    from parallel_state_ng import ModuleSpec, build_topology

    return build_topology(
        [
            ModuleSpec("vision", ranks=range(0, 2), tensor_model_parallel_size=2),
            ModuleSpec("language", ranks=range(2, 4), tensor_model_parallel_size=2, language=True),
        ],
        release="0.19",
    )


def init_with_a_death(rank: int, directory: str, what: str, k: int) -> dict:
    import torch.distributed as dist

    from parallel_state_ng.groups.liveness import RankFailureError

    dist.barrier()  # past the world's own start-up
    _die_at_new_group(rank, k)
    start = time.monotonic()
    try:
        _build(what)
        outcome = {"error": None}
    except RankFailureError as err:
        outcome = {"error": "RankFailureError", "dead": err.dead, "message": str(err), "step": err.step}
    except Exception as err:  # reported as is: the test shows what it was
        outcome = {"error": type(err).__name__, "message": str(err)}
    outcome["seconds"] = time.monotonic() - start
    outcome["left"] = len(dist.distributed_c10d._world.pg_map)
    if what == "initialize_model_parallel":
        import compat.parallel_state as ps

        outcome["initialized"] = ps.model_parallel_is_initialized()
    return outcome


CASES = [
    ("initialize_model_parallel", 4),
    ("build_megatron_groups", 3),
    ("create_pg", 2),
    ("build_topology", 2),
]


# compat's init in every run, the other entry points in turn (docs/testing.md, "Rotating parts")
@pytest.mark.parametrize(("what", "k"), rotation.sample(CASES, keep={CASES[0]}, parts=3))
def test_survivors_raise_naming_the_dead_rank(tmp_path, what, k):
    results = run_world(WORLD, str(tmp_path), init_with_a_death, what, k, expect=WORLD - 1, timeout=90, env=ENV)
    assert sorted(results) == [0, 1, 2], results
    affected = [r for r in results.values() if r["error"] is not None]
    # Every survivor of a collective build raises; with a grid, those sharing a group with rank 3.
    if what != "create_pg":
        assert len(affected) == 3, results
    else:
        assert affected, results
    for r in affected:
        assert r["error"] == "RankFailureError", r
        assert r["dead"] == [LOST], r
        assert f"[{LOST}]" in r["message"], r
        assert r["seconds"] < 4 * float(BOUND), r  # the bound, not the 30-minute group timeout
        assert r["left"] == 1, r  # only the default group: the rollback destroyed everything
        assert r.get("initialized") in (None, False), r
