"""The one group factory (parallel_state_ng.groups.factory): the only door to the creation paths.

The first test scans the whole tree: a module other than the factory that imports the member
path (``new_member_group``), the split path (``split_member``) or the sharing pool
(``GroupPool``), or a library module that calls torch's ``new_group`` / ``split_group`` itself,
fails it. The others check what the factory decides on simulated ranks.
"""

from __future__ import annotations

import ast
import os
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from parallel_state_ng.groups import creation, registry, split
from parallel_state_ng.groups.factory import GroupFactory, member_only_group
from parallel_state_ng.groups.sharing import record_requests
from tests.docs.test_house import python_files
from tests.support.paths import ROOT

#: The creation primitives and where they are defined: only the factory imports them.
PRIMITIVES = {"new_member_group": "creation", "split_member": "split", "GroupPool": "sharing"}
#: Library modules allowed to call torch's creation functions, and why.
TORCH_CALLERS = {
    "parallel_state_ng/groups/creation.py": "the member path itself",
    "parallel_state_ng/groups/split.py": "the split path itself",
    "parallel_state_ng/groups/factory.py": "every_group: MCore's all-rank creation, asked for on purpose",
    "compat/_helpers.py": "Megatron's public create_group, which hands its arguments to torch as MCore does",
}
FACTORY = "parallel_state_ng/groups/factory.py"
PRIMITIVE_HOMES = {f"parallel_state_ng/groups/{home}.py" for home in PRIMITIVES.values()}
#: Modules that play torch's part in tests (they stand in for torch's own functions), and why.
STAND_INS = {
    "parallel_state_ng/testing/split_stand_in.py": "gloo's stand-in for torch's split_group, made of member groups",
    "parallel_state_ng/testing/shrink_stand_in.py": "gloo's stand-in for torch's shrink_group",
}


def _violations(path: str) -> list[str]:
    if path in STAND_INS:
        return []
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read(), filename=path)
    library = path.startswith(("parallel_state_ng/", "compat/"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and path != FACTORY and path not in PRIMITIVE_HOMES:
            for alias in node.names:
                if alias.name in PRIMITIVES:
                    found.append(f"{path}:{node.lineno} imports {alias.name} from {node.module}")
        elif isinstance(node, ast.Attribute) and path != FACTORY and path not in PRIMITIVE_HOMES:
            if node.attr in PRIMITIVES:
                found.append(f"{path}:{node.lineno} reaches {node.attr} through an attribute")
        if library and isinstance(node, ast.Call) and path not in TORCH_CALLERS:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("new_group", "split_group"):
                found.append(f"{path}:{node.lineno} calls torch's {name} itself")
    return found


def test_only_the_factory_reaches_the_creation_paths():
    scanned = [p for p in python_files() if p.startswith(("parallel_state_ng/", "compat/", "scripts/"))]
    assert FACTORY in scanned and len(scanned) > 100
    found = [line for path in scanned for line in _violations(path)]
    assert not found, "create groups through parallel_state_ng.groups.factory:\n" + "\n".join(found)


def test_the_scan_catches_a_direct_import(tmp_path, monkeypatch):
    bad = tmp_path / "parallel_state_ng" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(
        "from parallel_state_ng.groups.creation import new_member_group\n"
        "import torch.distributed as dist\n"
        "g = dist.new_group([0])\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    found = _violations("parallel_state_ng/bad.py")
    assert len(found) == 2 and "imports new_member_group" in found[0] and "calls torch's new_group" in found[1]


def test_member_path_shares_only_when_the_setting_allows(fake_world):
    fake_world(1, 4)
    off = GroupFactory(share="off")
    a, new_a = off.group([0, 1], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    b, new_b = off.group([0, 1], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    assert a is not b and new_a and new_b and off.created == 2
    on = GroupFactory(share="build")
    c, _ = on.group([1, 0], timeout=timedelta(minutes=1))
    d, new_d = on.group([0, 1], timeout=timedelta(minutes=1))
    e, new_e = on.group([0, 1], timeout=timedelta(minutes=1), shareable=False)
    assert d is c and not new_d and e is not c and new_e
    assert on.group(None) == (None, False)  # not a member: nothing on the member path
    assert off.destroy([a, b]) == 2 and on.destroy([c, e]) == 2
    assert not creation.live_groups()


def test_process_sharing_takes_the_lease_and_destroy_gives_it_back(fake_world):
    fake_world(0, 4)
    first, second = GroupFactory(share="process"), GroupFactory(share="process")
    a, _ = first.group([0, 1, 2, 3])
    b, new = second.group([0, 1, 2, 3])
    assert a is b and new and registry.holders(a) == 2 and len(first.lease) == 1
    assert first.destroy([a]) == 0  # the other layout still holds it
    assert second.destroy([b]) == 1 and not registry.entries()


def test_member_only_group_is_never_shared_and_tracked(fake_world):
    fake_world(2, 4)
    one, two = member_only_group([2, 3]), member_only_group([2, 3])
    assert one is not two and {id(one), id(two)} <= {id(g) for g in creation.live_groups()}
    creation.destroy_groups([one, two])


def test_the_split_path_joins_one_split_per_request(fake_world, monkeypatch):
    fake_world(3, 4)
    calls = []

    def fake_split(parent, split_ranks, **kwargs):
        calls.append((split_ranks, kwargs.get("group_desc")))
        mine = [ranks for ranks in split_ranks if dist.get_rank() in ranks]
        return dist.new_group(mine[0], use_local_synchronization=True) if mine else None

    monkeypatch.setattr(dist, "split_group", fake_split, raising=False)
    monkeypatch.setattr(split.nonblocking, "check_nonblocking_bound", lambda: None)
    factory = GroupFactory(path="split", share="build")
    g, new = factory.group([2, 3], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    again, new_again = factory.group([2, 3], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    outside, _ = factory.group(None, group_desc="EXPERT_MODEL_PARALLEL_GROUP")
    twin, new_twin = factory.group([0, 1, 2, 3], backend="gloo")  # gloo never splits: members only
    # three splits: this rank's group, the shared request (no colour), the kind it is not in
    assert [c[0] for c in calls] == [[[2, 3]], [[0]], [[0]]]
    assert new and again is g and not new_again and outside is None and new_twin and twin is not g
    factory.destroy([g, twin])


def test_the_recording_tools_count_through_the_factory():
    with record_requests(share="build") as planned:
        factory = GroupFactory()
        factory.group([0, 1], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
        factory.group([0, 1], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    assert len(planned) == 1 and planned[0].descs == ["TENSOR_MODEL_PARALLEL_GROUP"] * 2


def test_a_bad_path_is_refused():
    with pytest.raises(ValueError, match="path must be 'member' or 'split', got 'both'"):
        GroupFactory(path="both")  # type: ignore[arg-type]
