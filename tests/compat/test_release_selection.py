"""Which megatron-core release compat serves, and what serving it means.

Release selection (:func:`parallel_state_ng.releases.select_release`): an explicit request,
``$PSNG_MEGATRON_VERSION``, the installed megatron-core, the newest supported; newer releases
warn, older ones raise. ``compat.parallel_state.MEGATRON_VERSION`` says which release is
served, and the module then has that release's surface — checked here in fresh processes
(one per release, several checks each) with the positional-meaning headline of issue 10:
0.19's ``get_data_parallel_group(with_context_parallel, with_gtp_remat, partial_data_parallel)``.
Also ``compat.install(hyper_comm_grid=True)`` on the installed megatron-core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from parallel_state_ng.releases import (
    ENV_VAR,
    SUPPORTED_SERIES,
    UnsupportedReleaseError,
    installed_megatron_version,
    select_release,
)
from parallel_state_ng.releases import parallel_state as api
from tests.support import rotation
from tests.support.paths import ROOT


def _run(code: str, env_version: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop(ENV_VAR, None)
    if env_version is not None:
        env[ENV_VAR] = env_version
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_explicit_request_and_environment(monkeypatch):
    assert select_release("0.19").series == "0.19"
    assert select_release("0.17.1").version == "0.17.1"
    monkeypatch.setenv(ENV_VAR, "0.15")
    assert select_release().series == "0.15"
    assert select_release("0.18").series == "0.18"  # an explicit request wins over the environment
    monkeypatch.delenv(ENV_VAR)
    installed = installed_megatron_version()
    expected = SUPPORTED_SERIES[-1] if installed is None else ".".join(installed.split(".")[:2])
    assert select_release().series == expected


def test_newer_warns_naming_both_and_serves_the_newest():
    with pytest.warns(UserWarning, match=r"0\.25\.0.*0\.19"):
        release = select_release("0.25.0")
    assert release.series == SUPPORTED_SERIES[-1] and release.version == "0.25.0"


@pytest.mark.parametrize("version", ["0.11.0", "0.9"])
def test_older_raises_naming_the_supported_range(version):
    with pytest.raises(UnsupportedReleaseError, match=r"0\.12 to 0\.19"):
        select_release(version)


def test_garbage_version_is_a_value_error():
    with pytest.raises(ValueError, match="cannot read a megatron-core release"):
        select_release("latest")


_SURFACE = r"""
import inspect, json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import compat.parallel_state as ps
from parallel_state_ng.releases import parallel_state as api
out = {"version": ps.MEGATRON_VERSION, "series": ps.MEGATRON_RELEASE.series,
       "warnings": [str(w.message) for w in caught]}
functions = api.functions(ps.MEGATRON_RELEASE)
out["missing"] = [n for n in functions if not hasattr(ps, n)]
out["absent_present"] = [n for n in api.FUNCTIONS if n not in functions and hasattr(ps, n)]
def shape(fn):
    return [(p.name, p.kind.name, repr(p.default)) for p in inspect.signature(fn).parameters.values()]
out["signature_mismatch"] = [
    n for n, params in functions.items()
    if [(a, "POSITIONAL_OR_KEYWORD", repr(inspect.Parameter.empty) if d is api.REQUIRED else repr(d)) for a, d in params]
    != shape(getattr(ps, n))
]
expected_globals = api.globals_of(ps.MEGATRON_RELEASE)
ours = {n for n, v in vars(ps).items() if n.startswith("_") and not n.startswith("__")
        and not (callable(v) or inspect.ismodule(v) or inspect.isclass(v))}
out["globals_extra"] = sorted(ours - set(expected_globals))
out["globals_missing"] = sorted(set(expected_globals) - ours)
out["rank_generator"] = {n: [p.name for p in inspect.signature(getattr(ps.RankGenerator, n)).parameters.values()]
                         for n in api.rank_generator_methods(ps.MEGATRON_RELEASE)}
out["rank_generator_extra"] = [n for n in api.RANK_GENERATOR if n not in out["rank_generator"]
                               and hasattr(ps.RankGenerator, n)]
try:
    ps.get_tensor_model_parallel_group(True, "extra")
except TypeError as e:
    out["type_error"] = str(e)
print("@@" + json.dumps(out))
"""


def _surface(env_version):
    done = _run(_SURFACE, env_version)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("@@")[-1])


@pytest.mark.slow
@pytest.mark.multiprocess
# 0.19 in every run, the others rotating in 2 parts (tests/support/rotation.py)
@pytest.mark.parametrize(
    "requested", rotation.sample(["0.12", "0.13.1", "0.14", "0.17.1", "0.19"], keep={"0.19"}, parts=2)
)
def test_module_serves_exactly_the_requested_release(requested):
    """MEGATRON_VERSION is the request; functions, signatures, globals and RankGenerator are its."""
    out = _surface(requested)
    assert out["version"] == requested and out["series"] == requested[:4]
    assert out["missing"] == [] and out["absent_present"] == [] and out["signature_mismatch"] == []
    assert out["globals_extra"] == [] and out["globals_missing"] == []
    assert out["rank_generator"] == {
        n: ["self", *(p for p, _ in params)] for n, params in api.rank_generator_methods(requested).items()
    }
    assert out["rank_generator_extra"] == []
    assert (
        out["type_error"] == "get_tensor_model_parallel_group() takes from 0 to 1 positional arguments but 2 were given"
    )


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.rotating(1, 2)  # a fresh interpreter: part 2 of 2 (docs/testing.md, "Rotating parts")
def test_newer_release_at_import_warns_and_older_fails():
    newer = _surface("0.99.0")
    assert newer["version"] == "0.99.0" and newer["series"] == SUPPORTED_SERIES[-1]
    assert any("0.99.0" in w and SUPPORTED_SERIES[-1] in w for w in newer["warnings"])
    done = _run("import compat.parallel_state", "0.11")
    assert done.returncode != 0 and "UnsupportedReleaseError" in done.stderr and "0.12 to 0.19" in done.stderr


_POSITIONAL = r"""
import json, sys, types
import torch.distributed as dist
calls = []
# Stand-ins for the megatron modules whose state 0.17+/0.19 destroy_model_parallel releases.
symmetric = types.ModuleType("megatron.core.inference.symmetric_memory")
symmetric.SymmetricMemoryManager = type("SymmetricMemoryManager", (), {"destroy": staticmethod(lambda: calls.append("symmetric"))})
fused = types.ModuleType("megatron.core.transformer.moe.fused_a2a")
def finalize():
    calls.append("nccl_ep")
    raise RuntimeError("finalize failures are ignored, as in megatron")
fused.nccl_ep_finalize = finalize
sys.modules.update({symmetric.__name__: symmetric, fused.__name__: fused})
from torch.testing._internal.distributed.fake_pg import FakeStore
import compat.parallel_state as ps
dist.init_process_group("fake", rank=5, world_size=16, store=FakeStore())
ps.initialize_model_parallel(tensor_model_parallel_size=2, gtp_remat_size=2, create_gloo_process_groups=False)
ranks = lambda g: sorted(dist.get_process_group_ranks(g))
out = {
    "default": ranks(ps.get_data_parallel_group()),               # with_gtp_remat=True
    "positional_false": ranks(ps.get_data_parallel_group(False, False)),  # 2nd positional: with_gtp_remat
    "replicate": ranks(ps._DATA_PARALLEL_GROUP),
    "full": ranks(ps._DATA_PARALLEL_GROUP_WITH_GTP_REMAT),
    "gtp": ps.get_gtp_weight_remat_global_ranks(),
    "world_size_default": ps.get_data_parallel_world_size(),
    "world_size_replicate": ps.get_data_parallel_world_size(False, False),
    "all_ranks": ps.get_all_ranks(),
    "gloo": ps._DATA_PARALLEL_GROUP_GLOO,
}
ps.destroy_model_parallel()
out["destroy_calls"] = calls
print("@@" + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_019_positional_with_gtp_remat_second():
    """On 0.19 the second positional argument of the data-parallel getters is with_gtp_remat."""
    done = _run(_POSITIONAL, "0.19")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.split("@@")[-1])
    assert out["positional_false"] == out["replicate"] != out["default"] == out["full"]
    assert out["world_size_default"] == 2 * out["world_size_replicate"] == len(out["full"])
    assert 5 in out["gtp"] and len(out["gtp"]) == 2
    assert len(out["all_ranks"].split("_")) == 6  # tp, gtp_remat, dp, cp, pp, ep
    assert out["gloo"] is None  # gloo groups are off under GTP
    assert out["destroy_calls"] == ["nccl_ep", "symmetric"]  # 0.19 destroy releases both, errors ignored


_GRID = r"""
import json, sys
import compat
import megatron.core.hyper_comm_grid as mgrid
import megatron.core.pipeline_parallel.bridge_communicator as bridge
from parallel_state_ng.builders.grid_releases import hyper_comm_grid_class
import compat.parallel_state as cps
ours = hyper_comm_grid_class(cps.MEGATRON_RELEASE)  # the served release's grid surface
theirs = mgrid.HyperCommGrid
out = {"bound_before": bridge.HyperCommGrid is theirs}
compat.install(hyper_comm_grid=True)
from megatron.core.hyper_comm_grid import HyperCommGrid as imported_after
out.update(module=mgrid.HyperCommGrid is ours, bridge=bridge.HyperCommGrid is ours, imported_after=imported_after is ours,
           parallel_state=sys.modules["megatron.core.parallel_state"] is sys.modules["compat.parallel_state"])
compat.uninstall()
out.update(restored=mgrid.HyperCommGrid is theirs and bridge.HyperCommGrid is theirs,
           ps_restored=sys.modules["megatron.core.parallel_state"] is not sys.modules["compat.parallel_state"])
compat.install()  # plain install leaves the grid alone
out["plain"] = mgrid.HyperCommGrid is theirs
compat.uninstall()
print("@@" + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.rotating(0, 2)  # a fresh interpreter: part 1 of 2 (docs/testing.md, "Rotating parts")
def test_install_hyper_comm_grid_redirects_and_uninstall_restores():
    pytest.importorskip("megatron.core.hyper_comm_grid")
    done = _run(_GRID, None)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.split("@@")[-1])
    assert out == {
        "bound_before": True,
        "module": True,
        "bridge": True,
        "imported_after": True,
        "parallel_state": True,
        "restored": True,
        "ps_restored": True,
        "plain": True,
    }


def test_getters_see_getters_patched_on_the_module(monkeypatch):
    """As in MCore, getters call the module's other getters: a patch on the module is seen."""
    import compat.parallel_state as ps

    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: 4)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda: 3)
    assert ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()
    if not hasattr(ps, "get_hybrid_data_context_parallel_groups"):
        return  # served release older than 0.16
    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda **kwargs: 8)
    monkeypatch.setattr(ps, "_DATA_PARALLEL_GROUP_WITH_CP", "the dp-cp group")
    assert ps.get_hybrid_data_context_parallel_groups(group_size=8) == "the dp-cp group"
