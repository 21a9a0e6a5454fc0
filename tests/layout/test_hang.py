"""The hang diagnosis as pure math: records, placement in the layout, the chain of waits, dumps.

No process group: records are written by hand in the shapes torch's flight recorder and the
hang watch produce (the live and offline proofs on 8 gloo ranks: tests/groups/test_hang_watch_gloo.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallel_state_ng.__main__ import main
from parallel_state_ng.groups.hang_watch import HangWatch
from parallel_state_ng.layout.hang import OpRecord, Placer, RankRecord, diagnose, render
from parallel_state_ng.layout.hang.flight_recorder import (
    DumpError,
    load_dump,
    read_dump_dir,
    record_of_dump,
    records_dump,
)
from parallel_state_ng.layout.megatron_layout import MegatronLayout

TP, DP, PP = "TENSOR_MODEL_PARALLEL_GROUP", "DATA_PARALLEL_GROUP", "PIPELINE_MODEL_PARALLEL_GROUP"


def _done(group, desc, op, seq, **kw):
    return OpRecord(group, desc, op, seq, state="completed", **kw)


def test_chain_of_waits_ends_at_the_rank_in_no_collective():
    layout = MegatronLayout(16, 2, 2, release="0.19")  # rank = tp + 2 dp + 8 pp
    placer = Placer(layout)
    records = [
        RankRecord(12, [_done("t", TP, "all_reduce", 1), OpRecord("d", DP, "all_reduce", 1, time_ns=5)]),
        RankRecord(14, [_done("t", TP, "all_reduce", 1), OpRecord("p", PP, "recv", 1, p2p=True, peer=6)]),
        RankRecord(6, [_done("t", TP, "all_reduce", 1)], note="data loader"),
        RankRecord(8, [OpRecord("d", DP, "all_reduce", 1)]),
        RankRecord(10, [OpRecord("d", DP, "all_reduce", 1)]),
    ]
    found = diagnose(records, placer)
    assert found.culprit == 6 and found.stuck is not None and found.stuck.rank == 14
    assert [w.rank for w in found.chain] == [8, 14] or [w.rank for w in found.chain] == [12, 14]
    text = render(found, placer)
    first = text.splitlines()[0]
    assert first.startswith("hang: likely culprit rank 6 (tp=0 dp=3 pp=0), in no collective (data loader)")
    assert "stuck group pp at tp=0 dp=3 (PIPELINE_MODEL_PARALLEL_GROUP), ranks [6, 14] at recv from 6 #1" in first
    assert "waits in dp on rank 14; rank 14 waits in pp on rank 6; rank 6 is in no collective" in text


def test_a_mismatch_names_the_odd_one_out_even_between_two():
    placer = Placer(MegatronLayout(8, 2, 2, release="0.19"))
    records = [
        RankRecord(0, [_done("a", TP, "all_reduce", 1), OpRecord("a", TP, "all_reduce", 2)]),
        RankRecord(1, [_done("a", TP, "all_reduce", 1), OpRecord("a", TP, "all_gather", 2)]),
        RankRecord(2, [_done("b", TP, "all_reduce", 1), _done("b", TP, "all_reduce", 2)]),
        RankRecord(3, [_done("b", TP, "all_reduce", 1), _done("b", TP, "all_reduce", 2)]),
    ]
    found = diagnose(records, placer)
    assert found.culprit == 1
    assert found.reasons[1] == "issued all_gather #2 where its peers issued all_reduce"
    assert "stuck group tp at dp=0 pp=0" in render(found, placer).splitlines()[0]


def test_an_operation_queued_behind_a_blocked_one_has_not_arrived():
    # NCCL: rank 2's CPU went on past its blocked tp all-reduce and queued the dp one
    placer = Placer(MegatronLayout(8, 2, 2, release="0.19"))
    records = [
        RankRecord(0, [_done("t0", TP, "all_reduce", 1), OpRecord("d0", DP, "all_reduce", 1)]),
        RankRecord(1, [_done("t0", TP, "all_reduce", 1)]),
        RankRecord(2, [OpRecord("t2", TP, "all_reduce", 1), OpRecord("d0", DP, "all_reduce", 1)]),
        RankRecord(3, [], note="data loader"),
    ]
    found = diagnose(records, placer)
    assert found.culprit == 3 and [w.rank for w in found.chain] == [0, 2]


def test_a_rank_that_did_not_report_and_a_cycle():
    placer = Placer(MegatronLayout(4, 2, release="0.19"))
    found = diagnose([RankRecord(0, [OpRecord("a", TP, "all_reduce", 1)])], placer)
    assert found.culprit == 1 and found.reasons[1] == "did not report"
    cycle = diagnose(
        [
            RankRecord(0, [OpRecord("p", PP, "recv", 1, p2p=True, peer=1)]),
            RankRecord(1, [OpRecord("p", PP, "recv", 1, p2p=True, peer=0)]),
        ]
    )
    assert cycle.culprit is None and cycle.cycle == (0, 1)
    assert "a deadlock" in render(cycle)
    idle = diagnose([RankRecord(0, [_done("a", TP, "all_reduce", 1)])])
    assert idle.culprit is None and "no rank waits" in render(idle)


def test_a_shared_group_is_placed_as_every_kind_and_layouts_are_told_apart():
    shared = f"{TP}+EXPERT_TENSOR_PARALLEL_GROUP"
    place = Placer(MegatronLayout(8, 2, 2, release="0.19")).place("7", shared, 5)
    assert [k.kind for k in place.kinds] == ["tp", "ep_tp"] and place.ranks == (4, 5)
    assert place.kind_names == "tp+ep_tp"
    train, infer = MegatronLayout(8, 2, 2, release="0.19"), MegatronLayout(8, 4, release="0.19")
    both = Placer({"train": train, "infer": infer})
    assert [k.layout for k in both.place("9", TP, 5, ranks=[4, 5, 6, 7]).kinds] == ["infer"]
    assert [k.layout for k in both.place("9", TP, 5).kinds] == ["train", "infer"]
    mcore_only = Placer(None).place("3", "DATA_PARALLEL_GROUP_GLOO", 0, [0, 2])
    assert mcore_only.kind_names == "dp" and mcore_only.ranks == (0, 2)


def _nccl_dump():
    """A dump as torch 2.13's NCCL flight recorder writes it (fields of ``_dump_fr_trace``)."""

    def entry(i, name, coll, p2p, state, retired, pg=("3", PP)):
        return {
            "record_id": i, "pg_id": 3, "process_group": pg, "collective_seq_id": coll, "p2p_seq_id": p2p,
            "op_id": i + 1, "profiling_name": name, "time_created_ns": 100 + i, "input_sizes": [[4]],
            "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"], "state": state,
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None, "retired": retired,
            "timeout_ms": 600000, "is_p2p": p2p > 0, "frames": [], "thread_id": "1", "thread_name": "python",
        }  # fmt: skip

    return {
        "version": "2.10",
        "pg_config": {"3": {"name": "3", "desc": PP, "ranks": "[1, 5]"}},
        "pg_status": {"3": {"last_enqueued_collective": 1, "last_started_collective": 1}},
        "comm_lib_version": "2.27.3",
        "nccl_comm_state": {},
        "entries": [
            entry(0, "nccl:all_reduce", 1, 0, "completed", True),
            entry(1, "nccl:recv 1<-0", 0, 1, "started", False),
            entry(2, "nccl:coalesced", 2, 0, "scheduled", False),
        ],
    }


def test_an_nccl_dump_is_read_from_torch_format(tmp_path):
    rec = record_of_dump(load_dump(pickle.dumps(_nccl_dump()), "d"), 5)
    assert [op.label() for op in rec.ops] == ["all_reduce #1", "recv from 1 #1"]
    assert rec.current is not None and rec.current.ranks == (1, 5) and rec.current.state == "started"
    as_json = load_dump(json.dumps(_nccl_dump()).encode(), "d")
    assert record_of_dump(as_json, 5) == rec
    again = record_of_dump(records_dump(rec), 5)
    assert [(o.op, o.seq, o.peer, o.done) for o in again.ops] == [(o.op, o.seq, o.peer, o.done) for o in rec.ops]
    (tmp_path / "nccl_trace_rank_5").write_bytes(pickle.dumps(_nccl_dump()))
    (tmp_path / "notes.txt").write_text("ignored: no rank at the end")
    assert [r.rank for r in read_dump_dir(str(tmp_path))] == [5]


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def test_bad_dumps_and_records_are_refused_naming_the_field(tmp_path):
    with pytest.raises(DumpError, match="holds no class"):
        load_dump(pickle.dumps(_Evil()), "evil")
    with pytest.raises(DumpError, match="entries"):
        load_dump(pickle.dumps([1, 2]), "list")
    with pytest.raises(DumpError, match="entries: an entry lacks"):
        record_of_dump({"entries": [{"profiling_name": "nccl:all_reduce"}]}, 0)
    with pytest.raises(DumpError, match="pg_config"):
        record_of_dump({"entries": [_nccl_dump()["entries"][0]], "pg_config": {"3": {"ranks": "[x"}}}, 0)
    with pytest.raises(DumpError, match="no dump files"):
        read_dump_dir(str(tmp_path))
    with pytest.raises(DumpError, match="not a directory"):
        read_dump_dir(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="seq must be"):
        OpRecord("1", TP, "all_reduce", -1)
    with pytest.raises(ValueError, match="state must be"):
        OpRecord("1", TP, "all_reduce", 1, state="stuck")
    with pytest.raises(ValueError, match="rank must be"):
        RankRecord(-1)
    with pytest.raises(ValueError, match="appears twice"):
        diagnose([RankRecord(0), RankRecord(0)])
    with pytest.raises(ValueError, match="layouts must be"):
        Placer("tp2")  # type: ignore[arg-type]
    for bad, match in (({"bound_s": 0}, "bound_s"), ({"bound_s": 1, "ring": 0}, "ring"),
                       ({"bound_s": 1, "dump_dir": str(tmp_path / "no")}, "dump_dir"),
                       ({"bound_s": 1, "layout": "tp2"}, "layout")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            HangWatch(**bad)


def _cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_the_cli_reads_a_folder_and_refuses_bad_input(tmp_path):
    for rank, ops in ((1, [_done("p", PP, "all_reduce", 1)]), (5, [OpRecord("p", PP, "recv", 1, p2p=True, peer=1)])):
        rec = RankRecord(rank, [OpRecord(o.group, o.desc, o.op, o.seq, o.state, o.p2p, o.peer, (1, 5)) for o in ops])
        (tmp_path / f"psng_hang_rank_{rank}").write_bytes(pickle.dumps(records_dump(rec)))
    code, out, _ = _cli("diagnose", str(tmp_path), "--world-size", "8", "--tp", "2", "--pp", "2")
    assert code == 0 and out.startswith("hang: likely culprit rank 1 (tp=1 dp=0 pp=0), in no collective"), out
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    for name, sizes in (("train", ["--tp", "2", "--pp", "2"]), ("infer", ["--tp", "4"])):
        code, _, _ = _cli("layout", "--world-size", "8", *sizes, "--format", "json", "-o", str(snapshots / name))
        assert code == 0
    code, out, _ = _cli(
        "diagnose",
        str(tmp_path),
        "--layout",
        f"train={snapshots / 'train'}",
        "--layout",
        f"infer={snapshots / 'infer'}",
    )
    assert code == 0 and "stuck group [train] pp at tp=1 dp=0" in out.splitlines()[0], out
    code, _, err = _cli(
        "diagnose", str(tmp_path), "--layout", f"a={snapshots / 'train'}", "--layout", f"a={snapshots / 'infer'}"
    )
    assert code == 2 and "given twice" in err
    code, _, err = _cli("diagnose", str(tmp_path / "missing"))
    assert code == 2 and "DUMP_DIR" in err
    code, _, err = _cli("diagnose", str(tmp_path), "--layout", "x.json", "--world-size", "8")
    assert code == 2 and "--layout" in err
    code, _, err = _cli("diagnose", str(tmp_path), "--world-size", "8", "--tp", "3")
    assert code == 2 and "--tp" in err


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    entries=st.lists(
        st.dictionaries(
            st.sampled_from(
                [
                    "process_group",
                    "profiling_name",
                    "collective_seq_id",
                    "p2p_seq_id",
                    "state",
                    "retired",
                    "is_p2p",
                    "input_sizes",
                    "time_created_ns",
                ]
            ),  # fmt: skip
            st.one_of(
                st.none(),
                st.booleans(),
                st.integers(-3, 3),
                st.text(max_size=12),
                st.lists(st.integers(-2, 5), max_size=3),
                st.tuples(st.text(max_size=3), st.text(max_size=30)),
            ),  # fmt: skip
        ),
        max_size=4,
    ),
    rank=st.integers(-2, 9),
)
def test_hostile_dumps_raise_dump_error_or_read(entries, rank):
    try:
        record_of_dump({"entries": entries, "pg_config": {}}, rank)
    except DumpError:
        pass
    data = pickle.dumps({"entries": entries})
    try:
        load_dump(data, "fuzz")
    except DumpError:
        pass
