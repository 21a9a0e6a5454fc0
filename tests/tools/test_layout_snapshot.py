"""Layout snapshots (``layout --format json``), ``layout --check`` and ``layout --diff``.

Snapshots are compared with :class:`MegatronLayout` and the group plan (the desc and timeout of
every step a rank creates); check and diff claims with brute force over the layouts (each
rank's group of each kind) and with the communicators the group plan creates per rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallel_state_ng.__main__ import main
from parallel_state_ng.layout.layout_diff import diff_snapshots
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.plan import CreateGroup, group_plan
from parallel_state_ng.layout.snapshot import SCHEMA, dumps_snapshot, load_snapshot, snapshot_of
from parallel_state_ng.tools.layout.communicators import planned_groups

# (CLI options, MegatronLayout keyword arguments)
CONFIGS = [
    (["--world-size", "8", "--tp", "2", "--pp", "2", "--release", "0.16"], dict(world_size=8, release="0.16")),
    (
        ["--world-size", "16", "--tp", "2", "--cp", "4", "--hcp-sizes", "2,2", "--release", "0.12"],
        dict(world_size=16, context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2], release="0.12"),
    ),
    (
        ["--world-size", "32", "--tp", "2", "--pp", "2", "--ep", "2", "--gtp-remat-size", "2", "--release", "0.19"],
        dict(world_size=32, expert_model_parallel_size=2, gtp_remat_size=2, release="0.19"),
    ),
    (
        ["--world-size", "16", "--tp", "2", "--num-dist-opt-instances", "2", "--etp", "1", "--release", "0.13"],
        dict(world_size=16, num_distributed_optimizer_instances=2, expert_tensor_parallel_size=1, release="0.13"),
    ),
]
IDS = ["dense-0.16", "hcp-0.12", "gtp-0.19", "instances-0.13"]


def _layout(kwargs: dict) -> MegatronLayout:
    sizes = {"tensor_model_parallel_size": 2}
    if kwargs["release"] in ("0.16", "0.19"):
        sizes["pipeline_model_parallel_size"] = 2
    return MegatronLayout(**{**sizes, **kwargs})


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["layout", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("cli,kwargs", CONFIGS, ids=IDS)
def test_snapshot_round_trip_and_facts(capsys, tmp_path: Path, cli, kwargs) -> None:
    layout = _layout(kwargs)
    code, out, _ = _run(capsys, *cli, "--format", "json", "--rank", "3")
    assert code == 0
    snapshot = load_snapshot(out)
    assert snapshot == snapshot_of(layout)  # the report part ("report") is not the snapshot's
    assert json.loads(out)["report"]["rank"]["rank"] == 3
    assert snapshot["schema"] == SCHEMA and snapshot["release"] == kwargs["release"]
    assert list(snapshot["kinds"]) == layout.kinds()
    # the snapshot's text is stable: written again from what was read, the same lines
    assert dumps_snapshot(snapshot) == dumps_snapshot(snapshot_of(layout))
    assert out.startswith(dumps_snapshot(snapshot).rsplit("\n  }\n", 1)[0])
    # desc and timeout rule: those of the group plan's steps on every rank (stated once)
    for rank in range(layout.world_size):
        for step in group_plan(layout, rank):
            if not isinstance(step, CreateGroup):
                continue
            entry = snapshot["kinds"][step.key.removesuffix("_gloo")]
            if step.key.endswith("_gloo"):
                assert entry["gloo"] == {"desc": step.desc, "timeout": step.timeout}
            else:
                assert (entry["desc"], entry["timeout"]["rule"]) == (step.desc, step.timeout), step.key
                assert list(step.ranks) in entry["groups"]
    # the configuration recomputes the layout: --check passes
    path = tmp_path / "snapshot.json"
    path.write_text(out)
    code, out, err = _run(capsys, "--check", str(path))
    assert (code, err) == (0, "")
    groups = sum(len(e["groups"]) for e in snapshot["kinds"].values())
    assert out == (
        f"OK: {path} matches the layout recomputed for megatron-core {kwargs['release']}, world size "
        f"{layout.world_size}: tp={layout.tensor_model_parallel_size} pp={layout.pipeline_model_parallel_size} "
        f"cp={layout.context_parallel_size} ep={layout.expert_model_parallel_size} "
        f"etp={layout.expert_tensor_parallel_size} order={layout.order}"
        + (
            f" num_distributed_optimizer_instances={layout.num_distributed_optimizer_instances}"
            if layout.num_distributed_optimizer_instances > 1
            else ""
        )
        + (f" hcp={[2, 2]}" if layout.hierarchical_levels else "")
        + (" gtp=2 egtp=1" if layout.gtp_active else "")
        + f" ({len(snapshot['kinds'])} kinds, {groups} groups)\n"
    )


def _snapshot_file(capsys, tmp_path: Path, name: str, *argv: str) -> Path:
    path = tmp_path / name
    assert main(["layout", *argv, "--format", "json", "--output", str(path)]) == 0
    capsys.readouterr()
    return path


def test_check_reports_a_tampered_snapshot(capsys, tmp_path: Path) -> None:
    path = _snapshot_file(
        capsys, tmp_path, "s.json", "--world-size", "8", "--tp", "2", "--pp", "2", "--release", "0.16"
    )
    data = json.loads(path.read_text())
    data["kinds"]["tp"]["groups"][:2] = [[0, 2], [1, 3]]  # ranks 1 and 2 swapped between two groups
    data["kinds"]["ep"]["timeout"]["rule"] = "torch"  # as 0.15 had it
    data["kinds"]["pp"]["desc"] = "PIPELINE_GROUP"
    path.write_text(json.dumps(data))
    code, out, err = _run(capsys, "--check", str(path))
    assert (code, err) == (1, "")
    assert out.splitlines() == [
        f"FAILED: {path} differs from the layout recomputed for megatron-core 0.16, world size 8: tp=2 pp=2 cp=1 "
        "ep=1 etp=2 order=tp-cp-ep-dp-pp (snapshot -> recomputed):",
        "  configuration: world size 8: tp=2 pp=2 cp=1 ep=1 etp=2 order=tp-cp-ep-dp-pp",
        "  kinds: 0 appear, 0 vanish, 3 change, 14 unchanged",
        "  ~ tp [TENSOR_MODEL_PARALLEL_GROUP]:",
        "      2 groups removed, 2 added, 4 ranks change group",
        "      removed: [0, 2], [1, 3]",
        "      added:   [0, 1], [2, 3]",
        "      rank 0: [0, 2] -> [0, 1]",
        "      rank 1: [1, 3] -> [0, 1]",
        "      rank 2: [0, 2] -> [2, 3]",
        "      rank 3: [1, 3] -> [2, 3]",
        "  ~ pp [PIPELINE_MODEL_PARALLEL_GROUP]:",
        "      group_desc PIPELINE_GROUP -> PIPELINE_MODEL_PARALLEL_GROUP",
        "  ~ ep [EXPERT_MODEL_PARALLEL_GROUP]:",
        "      timeout torch's default timeout -> the init timeout (ReleaseFacts.expert_group_timeout)",
        "  communicators per rank (gloo twins on, no sharing): snapshot 19-20, recomputed 19-20; no rank changes",
    ]
    code, out, _ = _run(capsys, "--check", str(path), "--format", "json")
    result = json.loads(out)
    assert code == 1 and result["ok"] is False and set(result["diff"]["kinds"]) == {"tp", "pp", "ep"}


def _counts(layout: MegatronLayout) -> list[int]:
    return [len(planned_groups(layout, rank, gloo=True, share=False)) for rank in range(layout.world_size)]


@pytest.mark.parametrize(
    "old,new,sizes",
    [
        ("0.18", "0.19", dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
        ("0.12", "0.13", dict(tensor_model_parallel_size=2, num_distributed_optimizer_instances=2)),
        ("0.12", "0.16", dict(context_parallel_size=4, hierarchical_context_parallel_sizes=[2, 2])),
    ],
)
def test_release_diff_against_the_layouts(capsys, old: str, new: str, sizes: dict) -> None:
    a = MegatronLayout(world_size=16, release=old, **sizes)
    b = MegatronLayout(world_size=16, release=new, **sizes)
    cli = ["--world-size", "16", "--tp", str(a.tensor_model_parallel_size), "--cp", str(a.context_parallel_size)]
    cli += ["--pp", str(a.pipeline_model_parallel_size)]
    cli += ["--num-dist-opt-instances", str(a.num_distributed_optimizer_instances)]
    if a.hierarchical_levels:
        cli += ["--hcp-sizes", "2,2"]
    code, out, _ = _run(capsys, *cli, "--diff", "--release", old, "--against", new, "--format", "json")
    diff = json.loads(out)
    assert code == 1 and diff["same"] is False
    statuses = {kind: change["status"] for kind, change in diff["kinds"].items()}
    assert {k for k, s in statuses.items() if s == "added"} == set(b.kinds()) - set(a.kinds())
    assert {k for k, s in statuses.items() if s == "removed"} == set(a.kinds()) - set(b.kinds())
    for kind in set(a.kinds()) & set(b.kinds()):  # moved ranks: brute force over every rank
        moved = [r for r in range(16) if a.group(kind, r) != b.group(kind, r)]
        got = [m["rank"] for m in diff["kinds"].get(kind, {}).get("ranks_moved", [])]
        assert got == moved, kind
    # the timeout rules that flip between the two releases (ep at 0.16, hcp after 0.12)
    flipped = {k for k, c in diff["kinds"].items() if "timeout" in c and c["status"] == "changed"}
    expected = {"ep"} if new == "0.16" else set()
    if new == "0.16":
        expected |= {"hcp0", "hcp1"}
    assert flipped == expected
    # communicators per rank: those the group plan creates (gloo twins on, no sharing)
    changed = {(c["rank"], c["old"], c["new"]) for c in diff["communicators"]["ranks_changed"]}
    assert changed == {(r, x, y) for r, (x, y) in enumerate(zip(_counts(a), _counts(b), strict=True)) if x != y}
    # the text names the same kinds, one line each
    code, text, _ = _run(capsys, *cli, "--diff", "--release", old, "--against", new)
    marks = {"added": "+", "removed": "-", "changed": "~"}
    for kind, status in statuses.items():
        assert any(line.startswith(f"  {marks[status]} {kind} [") for line in text.splitlines()), kind


def test_diff_files_and_configurations(capsys, tmp_path: Path) -> None:
    sizes = ["--world-size", "8", "--tp", "2", "--pp", "2"]
    a = _snapshot_file(capsys, tmp_path, "a.json", *sizes, "--release", "0.16")
    b = _snapshot_file(capsys, tmp_path, "b.json", *sizes, "--release", "0.19")
    code, files_out, _ = _run(capsys, "--diff", str(a), str(b), "--format", "json")
    _, releases_out, _ = _run(capsys, *sizes, "--diff", "--release", "0.16", "--against", "0.19", "--format", "json")
    by_files, by_releases = json.loads(files_out), json.loads(releases_out)
    assert code == 1 and by_files["old"]["label"] == str(a) and by_files["new"]["label"] == str(b)
    for key in ("kinds", "unchanged", "communicators", "same"):
        assert by_files[key] == by_releases[key], key
    assert [k for k, c in by_files["kinds"].items() if c["status"] == "added"] == [
        "gtp_remat",
        "expt_gtp_remat",
        "tp_ep_gtp_remat_pp",
    ]
    code, out, _ = _run(capsys, "--diff", str(a), str(a))
    assert code == 0 and out.startswith(f"layout diff {a} -> {a}: the same")
    # a configuration change: --against-set, ranks moved as the layouts say
    code, out, _ = _run(capsys, *sizes, "--release", "0.16", "--diff", "--against-set", "order=tp-pp-dp", "--full")
    old = MegatronLayout(world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, release="0.16")
    new = MegatronLayout(
        world_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, order="tp-pp-dp", release="0.16"
    )
    lines = out.splitlines()
    assert code == 1 and lines[0] == "layout diff 0.16 -> 0.16 with order=tp-pp-dp: they differ"
    for rank in range(8):
        a_group, b_group = old.group("dp", rank), new.group("dp", rank)
        assert (f"      rank {rank}: {a_group} -> {b_group}" in lines) == (a_group != b_group)
    diff = diff_snapshots(snapshot_of(old), snapshot_of(new))
    as_sets = {k: ({tuple(g) for g in old.enumerate(k)}, {tuple(g) for g in new.enumerate(k)}) for k in old.kinds()}
    assert [c.kind for c in diff.changes] == [k for k, (x, y) in as_sets.items() if x != y]
