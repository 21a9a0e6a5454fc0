"""NCCL config values NCCL refuses are refused first, before any group exists (docs/results/gpus.md).

The check is pure (:mod:`parallel_state_ng.groups.nccl_config`); compat's
``initialize_model_parallel`` reads MCore's YAML and ``build_megatron_groups`` takes the parsed
dict, both on the fake backend here (the refusal comes before any NCCL options object is made,
so a CPU build of torch serves).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import compat.parallel_state as ps
from parallel_state_ng import build_megatron_groups
from parallel_state_ng.groups.nccl_config import (
    FIRST_VERSION,
    NCCL_RULES,
    NcclConfigError,
    NcclRule,
    check_nccl_config,
    installed_nccl_version,
)

V2289 = (2, 28, 9)

REFUSED = [
    ({"pp": {"min_ctas": 2}}, r"group 'pp', key 'min_ctas' \(min_ctas=2\): min_ctas needs max_ctas"),
    ({"tp": {"min_ctas": 8, "max_ctas": 4}}, r"group 'tp', key 'min_ctas' \(max_ctas=4, min_ctas=8\): .*not exceed"),
    ({"tp": {"min_ctas": 40, "max_ctas": 33}}, r"min_ctas must not exceed max_ctas"),  # compared before capping
    ({"dp": {"max_ctas": 0}}, r"group 'dp', key 'max_ctas' \(max_ctas=0\): max_ctas must be an integer of at least 1"),
    ({"dp": {"min_ctas": -1, "max_ctas": 8}}, r"key 'min_ctas'.*at least 1"),
    ({"ep": {"cga_cluster_size": -2}}, r"group 'ep', key 'cga_cluster_size'.*at least 0"),
    ({"ep": {"max_ctas": "16"}}, r"key 'max_ctas' \(max_ctas='16'\): max_ctas must be an integer"),
    ({"ep": {"max_ctas": True}}, r"key 'max_ctas'.*must be an integer"),
    ({"tp": {"max_ctas": 8}, "pp": {"min_ctas": 2}}, r"group 'pp'"),  # the first broken group is named
]

ACCEPTED = [
    {},
    {"pp": {"min_ctas": 2, "max_ctas": 24}},  # the GPU check's YAML, fixed
    {"tp": {"max_ctas": 16}},  # max without min: NCCL's unset min (INT_MIN) is below it
    {"tp": {"max_ctas": 64, "min_ctas": 40}},  # over 32: capped by NCCL, not refused
    {"tp": {"cga_cluster_size": 16}},  # over 8: capped by NCCL
    {"tp": {"cga_cluster_size": 0, "is_high_priority_stream": True, "net_name": "socket"}},
]


@pytest.mark.parametrize("cfgs,message", REFUSED)
def test_values_nccl_refuses_are_refused_naming_group_key_and_rule(cfgs, message):
    with pytest.raises(NcclConfigError, match=message) as info:
        check_nccl_config(cfgs, version=V2289)
    assert isinstance(info.value, ValueError)
    assert "[NCCL 2.28.9]" in str(info.value)


@pytest.mark.parametrize("cfgs", ACCEPTED)
def test_values_nccl_takes_pass(cfgs):
    check_nccl_config(cfgs, version=V2289)
    check_nccl_config(cfgs, version=None)


def test_an_unknown_version_applies_the_rules_of_every_release_and_says_so():
    with pytest.raises(NcclConfigError, match=r"NCCL version unknown \(torch has no NCCL here\)"):
        check_nccl_config({"pp": {"min_ctas": 2}}, version=None)
    assert all(rule.holds_for(None) for rule in NCCL_RULES)  # today every rule holds for every release
    later = NcclRule("max_ctas", "a rule of a later release", lambda cfg: True, since=(2, 30, 0))
    assert not later.holds_for(None) and not later.holds_for(V2289) and later.holds_for((2, 30, 1))
    ended = NcclRule("max_ctas", "a rule that ended", lambda cfg: True, until=(2, 20, 0))
    assert not ended.holds_for(None) and ended.holds_for(FIRST_VERSION) and not ended.holds_for(V2289)


def test_an_nccl_without_config_fields_is_not_checked():
    check_nccl_config({"pp": {"min_ctas": 2}}, version=(2, 14, 3))


def test_release_0_12_defaults_are_what_nccl_gets():
    # 0.12 fills max_ctas 32 where the group leaves it out: min_ctas alone is then fine
    check_nccl_config({"pp": {"min_ctas": 2}}, legacy_defaults=True, version=V2289)
    with pytest.raises(NcclConfigError, match=r"min_ctas=40.*not exceed"):
        check_nccl_config({"pp": {"min_ctas": 40}}, legacy_defaults=True, version=V2289)


def test_options_that_are_not_a_mapping_are_a_type_error():
    with pytest.raises(TypeError, match=r"group 'pp' must be a mapping"):
        check_nccl_config({"pp": [2]}, version=V2289)


def test_the_installed_version_is_read_from_torch():
    import torch

    version = installed_nccl_version()
    if not hasattr(torch._C, "_nccl_version"):
        assert version is None  # a CPU build
    else:
        assert version is not None and version >= (2, 0, 0)


def _no_group_made(before: set) -> None:
    assert set(dist.distributed_c10d._world.pg_map) == before, "a group was created before the refusal"


def test_compat_refuses_the_yaml_before_any_group(fake_world, tmp_path):
    fake_world(3, 8)
    yaml = tmp_path / "nccl.yaml"
    # pp's min_ctas is refused by every release's reading: without max_ctas (0.13 on), and over
    # the max_ctas 32 that 0.12 fills in (release fact nccl_config_defaults)
    yaml.write_text("tp:\n  max_ctas: 16\n  min_ctas: 4\npp:\n  min_ctas: 40\n")
    before = set(dist.distributed_c10d._world.pg_map)
    with pytest.raises(NcclConfigError, match=rf"nccl_communicator_config_path '{yaml}': group 'pp', key 'min_ctas'"):
        ps.initialize_model_parallel(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, nccl_communicator_config_path=str(yaml)
        )
    _no_group_made(before)
    assert not ps.model_parallel_is_initialized()


def test_build_megatron_groups_refuses_the_dict_before_any_group(fake_world):
    fake_world(0, 8)
    before = set(dist.distributed_c10d._world.pg_map)
    with pytest.raises(NcclConfigError, match=r"nccl_comm_cfgs: group 'dp', key 'min_ctas'.*not exceed"):
        build_megatron_groups(tensor_model_parallel_size=2, nccl_comm_cfgs={"dp": {"min_ctas": 9, "max_ctas": 8}})
    _no_group_made(before)
