"""Object collectives without numpy (torch's own need it; our runtime dependency is torch only)."""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from parallel_state_ng.groups.objects import all_gather_objects, broadcast_object, object_to_tensor, tensor_to_object


def test_round_trip():
    for obj in [None, 3, "text", {"a": [1, 2, (3, 4)]}, list(range(1000))]:
        assert tensor_to_object(object_to_tensor(obj)) == obj
    payload = object_to_tensor({"x": 1})
    padded = torch.cat([payload, torch.zeros(7, dtype=torch.uint8)])
    assert tensor_to_object(padded, payload.numel()) == {"x": 1}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_works_where_numpy_is_missing():
    code = textwrap.dedent(
        """
        import sys, warnings
        warnings.simplefilter("ignore")
        sys.modules["numpy"] = None  # numpy cannot be imported in this process
        import torch
        from parallel_state_ng.groups.objects import object_to_tensor, tensor_to_object
        t = object_to_tensor({"ok": [1, 2]})
        try:
            t.numpy()
            print("numpy-available")
        except RuntimeError:
            print("numpy-missing")
        print(tensor_to_object(t))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["numpy-missing", "{'ok':", "[1,", "2]}"]


def _collectives():
    rank = dist.get_rank()
    gathered = all_gather_objects({"rank": rank, "payload": "x" * rank})
    sent = broadcast_object({"from": rank} if rank == 2 else None, src=2)
    return gathered, sent


def test_collectives_on_gloo(gloo_world):
    for gathered, sent in gloo_world(4).run(_collectives):
        assert gathered == [{"rank": r, "payload": "x" * r} for r in range(4)]
        assert sent == {"from": 2}
