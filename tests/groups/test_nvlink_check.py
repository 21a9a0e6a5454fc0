"""The runtime NVLink-domain check: ids on the agreement round, the domain map, the verdict.

The protocol is exercised with threads on one in-process store (ids ride in the fingerprint
keys: still 5 store operations per rank), the check itself on domain maps, NVML through a stand-in
``pynvml`` module, and the whole path on the session's gloo world of 4 with a per-rank
``PSNG_NVLINK_DOMAIN`` (compat's init, ``build_megatron_groups``, ``build_topology``).
"""

from __future__ import annotations

import os
import sys
import threading
import types
import warnings

import pytest
import torch.distributed as dist

from parallel_state_ng.groups import agreement_protocol, nvlink_check
from parallel_state_ng.groups.nvlink_check import (
    NvlinkDomainError,
    NvlinkDomainIdError,
    NvlinkDomainWarning,
    check_domains,
    encode_domain_id,
    local_domain_id,
    nvml_domain_id,
    round_arguments,
    summarize_domain_ids,
)
from parallel_state_ng.layout.megatron_layout import MegatronLayout


# --------------------------------------------------------------------------- the round
def _round(values: list[str | None]) -> dict[int, object]:
    """One agreement round of ``len(values)`` threads, participant ``i`` sending ``values[i]``."""
    store = dist.HashStore()
    out: dict[int, object] = {}
    n = len(values)

    def participant(i: int) -> None:
        try:
            out[i] = agreement_protocol.run_round(
                dist.PrefixStore("r/", store),
                i,
                range(n),
                {"tp": 2},
                name="threads",
                timeout=10.0,
                rank_value=values[i],
                summarize=summarize_domain_ids,
            )
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=participant, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_ids_ride_on_the_round_without_extra_store_operations():
    values = [encode_domain_id(("env", "rack-a" if i < 6 else "rack-b")) for i in range(8)]
    out = _round(values)
    results = [out[i] for i in range(8)]
    assert all(isinstance(r, tuple) for r in results), results
    assert sorted(r[0] for r in results) == [5] * 8  # as without ids
    summaries = {str(r[2]) for r in results}
    assert len(summaries) == 1
    summary = results[0][2]
    assert summary == {"ranks": {"range": [0, 8]}, "runs": [[0, 6], [1, 2]], "ids": ["rack-a", "rack-b"]}


def test_ids_of_different_types_or_lengths_fail_on_every_rank():
    values = [encode_domain_id(("env", "a")), encode_domain_id(("callable", 7)), None]
    values.append(encode_domain_id(("nvml", ("ab" * 16, 3))))
    out = _round(values)
    summary = out[0][2]  # type: ignore[index]
    assert all(out[i][2] == summary for i in range(4))  # type: ignore[index]
    with pytest.raises(NvlinkDomainIdError) as err:
        check_domains(summary, lambda kinds: {}, name="init", rank=0)
    text = str(err.value)
    for part in ("env: str on ranks 0", "callable: int on ranks 1", "no id on ranks 2", "nvml: tuple of 2 on ranks 3"):
        assert part in text


def test_no_ids_means_no_summary_and_no_check():
    assert summarize_domain_ids(range(3), [None, None, None]) is None
    assert check_domains(None, lambda kinds: pytest.fail("not called"), name="init", rank=0) == []


# --------------------------------------------------------------------------- the check
def _summary(domains: list[str]) -> dict:
    return summarize_domain_ids(range(len(domains)), [encode_domain_id(("env", d)) for d in domains])


def _layout_groups(layout: MegatronLayout):
    return lambda kinds: {"": {k: layout.enumerate(k) for k in kinds if k in layout.kinds()}}


def test_crossing_tp_group_warns_on_the_first_participant_only(monkeypatch):
    monkeypatch.delenv(nvlink_check.ENV_CHECK, raising=False)
    monkeypatch.delenv(nvlink_check.ENV_KEEP_INSIDE, raising=False)
    layout = MegatronLayout(world_size=8, tensor_model_parallel_size=4, release="0.19")
    summary = _summary(["a"] * 6 + ["b"] * 2)  # tp group [4..7] sits in both
    with pytest.warns(NvlinkDomainWarning, match=r"tp: 1 of 2 groups cross NVLink domains") as record:
        findings = check_domains(summary, _layout_groups(layout), name="init", rank=0)
    assert 'ranks 4-7 in domains 0 ("a"), 1 ("b")' in str(record[0].message)
    assert [f.split(":")[0] for f in findings] == ["tp", "ep_tp", "tp_ep_mp"]  # etp defaults to tp
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_domains(summary, _layout_groups(layout), name="init", rank=5) == findings  # no warning


def test_error_mode_raises_and_keep_inside_chooses_the_kinds(monkeypatch):
    layout = MegatronLayout(
        world_size=8,
        tensor_model_parallel_size=2,
        expert_model_parallel_size=4,
        expert_tensor_parallel_size=1,
        release="0.19",
    )
    summary = _summary(["a"] * 4 + ["b"] * 4)  # tp and ep inside; dp (stride 2) crosses
    monkeypatch.setenv(nvlink_check.ENV_CHECK, "error")
    assert check_domains(summary, _layout_groups(layout), name="init", rank=0) == []
    monkeypatch.setenv(nvlink_check.ENV_KEEP_INSIDE, "tp,dp")
    with pytest.raises(NvlinkDomainError, match=r"dp: 2 of 2 groups cross"):
        check_domains(summary, _layout_groups(layout), name="init", rank=3)
    monkeypatch.setenv(nvlink_check.ENV_CHECK, "off")
    assert check_domains(summary, _layout_groups(layout), name="init", rank=0) == []


def test_round_arguments_fold_bad_settings_into_the_compared_field(monkeypatch):
    monkeypatch.setenv(nvlink_check.ENV_CHECK, "loud")
    field, value, summarize = round_arguments()
    assert field.startswith("invalid: environment variable PSNG_NVLINK_CHECK") and value is None
    with pytest.raises(NvlinkDomainIdError, match=r"init: NVLink domain check: environment variable PSNG_NVLINK_CHECK"):
        nvlink_check.raise_if_invalid(field, "init")
    monkeypatch.setenv(nvlink_check.ENV_CHECK, "warn")

    def broken() -> str:
        raise RuntimeError("no rack file")

    previous = nvlink_check.set_nvlink_domain_source(broken)
    try:
        assert round_arguments()[0] == "invalid: RuntimeError: no rack file"
    finally:
        nvlink_check.set_nvlink_domain_source(previous)
    monkeypatch.setenv(nvlink_check.ENV_CHECK, "off")
    assert round_arguments() == ("off", None, None)
    monkeypatch.setenv(nvlink_check.ENV_CHECK, "warn")
    monkeypatch.setenv(nvlink_check.ENV_DOMAIN, "rack-7")
    monkeypatch.setenv(nvlink_check.ENV_KEEP_INSIDE, "tp,ep")
    assert round_arguments() == ("warn:tp,ep", '["env","rack-7"]', summarize_domain_ids)


def test_the_callable_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(nvlink_check.ENV_DOMAIN, "rack-7")
    previous = nvlink_check.set_nvlink_domain_source(lambda: ("cluster", 3))
    try:
        assert local_domain_id() == ("callable", ("cluster", 3))
        nvlink_check.set_nvlink_domain_source(lambda: 2.5)
        with pytest.raises(NvlinkDomainIdError, match=r"set_nvlink_domain_source.*got 2.5"):
            local_domain_id()
    finally:
        nvlink_check.set_nvlink_domain_source(previous)
    assert local_domain_id() == ("env", "rack-7")


# --------------------------------------------------------------------------- NVML
def _fake_pynvml(state: int, uuid: bytes, clique: int) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    import ctypes

    class Info(ctypes.Structure):
        _fields_ = [
            ("version", ctypes.c_uint),
            ("clusterUuid", ctypes.c_ubyte * 16),
            ("status", ctypes.c_int),
            ("cliqueId", ctypes.c_uint),
            ("state", ctypes.c_ubyte),
        ]

    def fill(handle, ref):
        info = ref._obj
        ctypes.memmove(info.clusterUuid, uuid, 16)
        info.cliqueId, info.state, info.status = clique, state, 0

    module.c_nvmlGpuFabricInfoV_t = Info  # type: ignore[attr-defined]
    module.nvmlGpuFabricInfo_v2 = 2  # type: ignore[attr-defined]
    module.NVML_GPU_FABRIC_STATE_COMPLETED = 3  # type: ignore[attr-defined]
    module.nvmlInit = lambda: None  # type: ignore[attr-defined]
    module.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = lambda index: index  # type: ignore[attr-defined]
    module.nvmlDeviceGetGpuFabricInfoV = fill  # type: ignore[attr-defined]
    return module


def test_nvml_fabric_info_gives_cluster_uuid_and_clique(monkeypatch):
    uuid = bytes(range(1, 17))
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(3, uuid, 5))
    assert nvml_domain_id(0) == (uuid.hex(), 5)
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(1, uuid, 5))  # registration in progress
    assert nvml_domain_id(0) is None
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(3, bytes(16), 0))  # no fabric
    assert nvml_domain_id(0) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert nvml_domain_id(0) is None


# --------------------------------------------------------------------------- gloo
def _init_with_domain(domain: str, mode: str, how: str) -> dict:
    """Build tp=2 groups with this rank's ``PSNG_NVLINK_DOMAIN``; what happened."""
    saved = {k: os.environ.get(k) for k in (nvlink_check.ENV_DOMAIN, nvlink_check.ENV_CHECK)}
    os.environ[nvlink_check.ENV_DOMAIN], os.environ[nvlink_check.ENV_CHECK] = domain, mode
    live = len(dist.distributed_c10d._world.pg_map)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if how == "compat":
                import compat.parallel_state as ps

                ps.initialize_model_parallel(tensor_model_parallel_size=2)
                ps.destroy_model_parallel()
            elif how == "collection":
                from parallel_state_ng import build_megatron_groups

                build_megatron_groups(tensor_model_parallel_size=2).destroy()
            elif how == "topology":
                from parallel_state_ng import ModuleSpec, build_topology

                spec = [ModuleSpec("language", (0, 4), tensor_model_parallel_size=2, language=True)]
                build_topology(spec).destroy()
            else:
                from parallel_state_ng import HyperCommGrid

                HyperCommGrid([2, 2], ["tp", "dp"], check_agreement=True).destroy()
        outcome = {"error": None, "warnings": [str(w.message) for w in caught if w.category is NvlinkDomainWarning]}
    except Exception as exc:
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    outcome["new_live_groups"] = len(dist.distributed_c10d._world.pg_map) - live
    return outcome


@pytest.mark.parametrize("how", ["compat", "collection", "topology", "grid"])
def test_gloo_tp_group_across_two_domains(gloo_world, how):
    world = gloo_world(4)
    domains = ["rack-a", "rack-a", "rack-a", "rack-b"]  # tp groups [0,1] inside, [2,3] across
    errors = world.run_per_rank(_init_with_domain, [(d, "error", how) for d in domains])
    assert {e["error"] for e in errors} == {"NvlinkDomainError"}, errors
    assert all(e["new_live_groups"] == 0 for e in errors)
    assert (
        'tp: 1 of 2 groups cross NVLink domains (up to 2), e.g. ranks 2-3 in domains 0 ("rack-a"), 1 ("rack-b")'
        in (errors[0]["message"])
    )
    warned = world.run_per_rank(_init_with_domain, [(d, "warn", how) for d in domains])
    assert [e["error"] for e in warned] == [None] * 4, warned
    assert [len(e["warnings"]) for e in warned] == [1, 0, 0, 0]  # the first participant reports


def test_domains_that_are_not_intervals_are_checked_rank_by_rank(monkeypatch):
    monkeypatch.setenv(nvlink_check.ENV_CHECK, "error")
    monkeypatch.setenv(nvlink_check.ENV_KEEP_INSIDE, "tp")
    layout = MegatronLayout(world_size=8, tensor_model_parallel_size=4, release="0.19")
    # group [0..3]: its lowest and highest rank share rack "a", ranks 1-2 sit in "b"
    summary = _summary(["a", "b", "b", "a", "a", "a", "a", "a"])
    assert summary["runs"] == [[0, 1], [1, 2], [0, 5]]
    with pytest.raises(NvlinkDomainError, match=r'tp: 1 of 2 groups .* ranks 0-3 in domains 0 \("a"\), 1 \("b"\)'):
        check_domains(summary, _layout_groups(layout), name="init", rank=0)
