"""Megatron 0.19's inference shards built by the engine (``parallel_state_ng.builders.inference``).

Fake backend, one process: only the rank's own ``new_group`` calls (also at 65,536 ranks), none
outside the windows, atomic failure, bad sizes raising before any group, the stand-in shard
spec parser and shard class (the installed release has no shards module). The comparison with
0.19.2's own functions, field by field and rank by rank, is in
``tests/releases/test_inference_releases.py``. Our ``timeout`` argument: checked, and under
``PSNG_SHARE_GROUPS=process`` the training layout's timeout lets the registry share.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from parallel_state_ng import build_megatron_groups
from parallel_state_ng.builders.inference import (
    InferenceShard,
    InferenceSizeError,
    build_inference_collection,
    build_inference_collections_for_shards,
    destroy_inference_collection,
)
from parallel_state_ng.groups import registry, sharing
from parallel_state_ng.groups.creation import live_groups
from parallel_state_ng.layout.shard_spec import ShardSpec, parse_shard_specs
from parallel_state_ng.releases import current_release
from parallel_state_ng.releases.inference_shards import COLLECTION_FIELDS, SERVED_FUNCTIONS

SIZES = {"tp_size": 8, "pp_size": 4, "cp_size": 1, "ep_size": 8, "expt_tp_size": 1}


def _set_fields(collection) -> dict[str, list[int]]:
    return {k: dist.get_process_group_ranks(v) for k, v in vars(collection).items() if v is not None}


def test_one_window_at_65536_ranks_makes_only_the_rank_s_groups(fake_world, new_group_calls):
    pytest.importorskip("megatron.core.process_groups_config")
    rank = 3 * 16384 + 5  # the last pipeline stage: the embedding group, not the position one
    fake_world(rank, 65536)
    collection = build_inference_collection(65536, **SIZES, check_agreement=False)
    fields = _set_fields(collection)
    assert set(vars(collection)) == set(COLLECTION_FIELDS)
    assert collection.pos_embd is None and fields["embd"] == [5, rank]
    assert all(rank in ranks for ranks in new_group_calls)
    assert len(new_group_calls) == len(fields) == 14
    assert len(fields["tp_dp_cp"]) == 65536 // 4 and fields["tp"] == list(range(rank - 5, rank + 3))
    assert destroy_inference_collection(collection) == 14


def test_a_rank_outside_the_window_makes_no_group(fake_world, new_group_calls):
    pytest.importorskip("megatron.core.process_groups_config")
    fake_world(3, 16)
    collection = build_inference_collection(8, **{**SIZES, "tp_size": 2, "ep_size": 2}, rank_offset=8)
    assert new_group_calls == [] and all(value is None for value in vars(collection).values())


def test_stand_in_shards_where_the_release_has_none(fake_world, new_group_calls):
    pytest.importorskip("megatron.core.process_groups_config")
    if SERVED_FUNCTIONS[current_release().series]:
        pytest.skip("the served release has Megatron's own shard classes")
    fake_world(5, 8)
    shards = build_inference_collections_for_shards(8, "tp=2,dp=2 + tp=2,pp=2")
    assert all(type(s) is InferenceShard for s in shards)
    assert [(s.rank_offset, s.world_size, s.spec) for s in shards] == [
        (0, 4, ShardSpec(tp=2, dp=2)),
        (4, 4, ShardSpec(tp=2, pp=2)),
    ]
    assert shards[0].pg_collection is None
    fields = _set_fields(shards[1].pg_collection)
    assert fields["tp"] == [4, 5] and fields["pp"] == fields["embd"] == [5, 7] and fields["pos_embd"] == [5]
    assert all(5 in ranks for ranks in new_group_calls) and len(new_group_calls) == 15
    destroy_inference_collection(shards[1].pg_collection)


def test_a_failed_creation_leaves_no_group(fake_world, monkeypatch):
    fake_world(2, 8)
    before = len(live_groups())
    original, made = dist.new_group, []

    def failing_sixth(*args, **kwargs):
        if len(made) == 5:
            raise RuntimeError("simulated creation failure")
        made.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(dist, "new_group", failing_sixth)
    with pytest.raises(RuntimeError, match="simulated"):
        build_inference_collection(8, 2, 2, 1, 2, 1, check_agreement=False)
    assert len(made) == 5 and len(live_groups()) == before


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"tp_size": 3}, AssertionError, "tp_size*cp_size*pp_size"),
        ({"ep_size": 3}, AssertionError, "expt_tp_size*ep_size*pp_size"),
        ({"tp_size": 0}, ZeroDivisionError, "tp_size=0"),
        ({"pp_size": 2.0}, AssertionError, "pp_size=2.0"),
        ({"tp_size": 2, "pp_size": 2, "use_tp_pp_dp_mapping": True}, AssertionError, "different pipelines"),
        ({"rank_offset": -1}, ValueError, "rank_offset=-1"),
        ({"rank_offset": 4}, RuntimeError, "rank_offset + world_size"),
        ({"timeout": 1800}, TypeError, "timeout=1800 (int)"),
        ({"timeout": timedelta(0)}, ValueError, "timeout=datetime.timedelta(0)"),
    ],
)
def test_bad_sizes_raise_before_any_group(kwargs, error, named, fake_world, new_group_calls):
    fake_world(0, 8)
    arguments = {"world_size": 8, "tp_size": 1, "pp_size": 1, "cp_size": 1, "ep_size": 1, "expt_tp_size": 1}
    with pytest.raises(error) as caught:
        build_inference_collection(**{**arguments, **kwargs})
    assert named in str(caught.value) and new_group_calls == []
    if isinstance(caught.value, InferenceSizeError):
        assert isinstance(caught.value, (AssertionError, ValueError, ZeroDivisionError))


def test_a_bad_timeout_for_shards_raises_before_any_group(fake_world, new_group_calls):
    fake_world(0, 4)
    with pytest.raises(TypeError, match=r"timeout=30.0 \(float\)"):
        build_inference_collections_for_shards(4, "tp=2,dp=2", timeout=30.0)
    with pytest.raises(ValueError, match=r"timeout must be positive, got timeout=datetime.timedelta\(days=-1"):
        build_inference_collections_for_shards(4, "tp=2,dp=2", timeout=timedelta(seconds=-1))
    assert new_group_calls == []


def test_the_training_timeout_lets_the_registry_share_inference_groups(fake_world, new_group_calls, monkeypatch):
    pytest.importorskip("megatron.core.process_groups_config")
    monkeypatch.setattr(sharing, "_override", "process")
    fake_world(0, 8)  # rank 0 of training tp2 pp2 dp2 and inference tp4 pp1 dp2
    train = build_megatron_groups(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=2, check_agreement_across_ranks=False
    )
    training = {id(pg) for pg in train.state.created}
    made = len(new_group_calls)
    sizes = {"tp_size": 4, "pp_size": 1, "cp_size": 1, "ep_size": 1, "expt_tp_size": 1}
    default = build_inference_collection(8, **sizes, check_agreement=False)  # torch's default timeout: not shared
    made_sizes = sorted(map(len, new_group_calls[made:]))  # 0.16+ also make a group of one rank
    assert made_sizes in ([2, 4, 8], [1, 2, 4, 8]), made_sizes
    # the inference groups whose members no training group has: none from 0.13 on, where the
    # training world group (0, 1, 4, 5, 2, 3, 6, 7: the intra distributed-optimizer instance) has
    # every rank; in 0.12 there is none, and the inference world group is made anew
    training_members = {frozenset(dist.get_process_group_ranks(pg)) for pg in train.state.created}
    unshared = [frozenset(c) for c in new_group_calls[made:] if frozenset(c) not in training_members]
    if "intra_dist_opt_instance" in train.state.groups:
        assert unshared == []
    made = len(new_group_calls)
    shared = build_inference_collection(8, **sizes, check_agreement=False, timeout=timedelta(minutes=30))
    # a communicator made only for members no training group has (the key is the member set)
    assert [frozenset(c) for c in new_group_calls[made:]] == unshared
    assert frozenset(range(8)) in {frozenset(key[0]) for key, _, _ in registry.entries()}
    own = {id(pg) for pg in vars(shared).values() if pg is not None} - training
    assert len(own) == len(unshared)
    assert destroy_inference_collection(shared) == len(own)
    assert destroy_inference_collection(default) == len(made_sizes)
    assert sorted(id(group) for _, group, holders in registry.entries()) == sorted(training)
    assert {holders for _, _, holders in registry.entries()} == {1}
    assert train.destroy() == len(training) and registry.entries() == []


def test_stand_in_parser_reads_strings_dicts_and_specs():
    parsed = parse_shard_specs(" tp=2 , role=PREFILL ; tp=1,dp=2,ep=2,expt_tp=1+", 4)
    assert parsed == [ShardSpec(tp=2, role="prefill"), ShardSpec(dp=2, ep=2, expt_tp=1)]
    assert parse_shard_specs([{"tp": 2}, ShardSpec(dp=2)], 4) == [ShardSpec(tp=2, expt_tp=2), ShardSpec(dp=2)]


@pytest.mark.parametrize(
    ("shards", "total", "error", "named"),
    [
        ("tp2", 2, AssertionError, "'tp2'"),
        ("tp=2,xp=1", 2, AssertionError, "'xp'"),
        ("tp=1,cp=2", 1, ValueError, "cp=2"),
        ("tp=2,ep=4", 2, ValueError, "expt_tp*ep*pp"),
        ("tp=2", 4, AssertionError, "total_world_size is 4"),
        ([{"tp": 0}], 1, ValueError, "tp=0"),
        ([{"tp": "2"}], 2, TypeError, "tp='2'"),
        (7, 1, TypeError, "got 7"),
    ],
)
def test_stand_in_parser_rejects(shards, total, error, named):
    with pytest.raises(error) as caught:
        parse_shard_specs(shards, total)
    assert named in str(caught.value)
