"""compat's sleep and wake (``sleep_model_parallel`` / ``wake_model_parallel``) on 4 gloo ranks.

After ``initialize_model_parallel`` (tp 2 pp 2, gloo twins on) and a ``build_megatron_groups``
beside it, every getter's group sleeps: a collective on it raises at once naming its kind and
saying to wake first; after ``wake_model_parallel`` every getter returns the very same object,
whose all-reduce gives the same sums as before. The context manager wakes on an error inside it.
The mechanism itself (fence, native suspend, agreement, leaks over 50 cycles):
tests/groups/test_sleep_gloo.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

GETTERS = (
    "get_tensor_model_parallel_group",
    "get_pipeline_model_parallel_group",
    "get_data_parallel_group",
    "get_model_parallel_group",
    "get_embedding_group",
)


def _sums(ps) -> list[float]:
    out = []
    for name in GETTERS:
        x = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(x, group=getattr(ps, name)())
        out.append(x.item())
    x = torch.tensor([1.0])
    dist.all_reduce(x, group=ps.get_data_parallel_group_gloo())
    return [*out, x.item()]


def _sleep_and_wake() -> dict:
    import compat.parallel_state as ps
    from parallel_state_ng import build_megatron_groups
    from parallel_state_ng.groups.sleep import GroupAsleepError, is_asleep

    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    beside = build_megatron_groups(tensor_model_parallel_size=4, pipeline_model_parallel_size=1)
    try:
        objects = {name: getattr(ps, name)() for name in GETTERS}
        before = _sums(ps)
        report = ps.sleep_model_parallel(timeout=30)
        asleep = all(is_asleep(g) for g in objects.values()) and is_asleep(beside.group("tp"))
        try:
            dist.all_reduce(torch.ones(1), group=ps.get_tensor_model_parallel_group())
            refused = ""
        except GroupAsleepError as err:
            refused = str(err)
        ps.wake_model_parallel(timeout=30)
        module = beside.sleep(timeout=30)  # the engine's object: its own groups only
        module_only = is_asleep(beside.group("tp")) and not is_asleep(objects["get_tensor_model_parallel_group"])
        beside.wake(timeout=30)
        same = all(getattr(ps, name)() is group for name, group in objects.items())
        after = _sums(ps)
        try:
            with ps.model_parallel_asleep(timeout=30):
                raise KeyError("inside the block")
        except KeyError:
            pass
        awake = not any(is_asleep(g) for g in objects.values())
        mechanisms = sorted({g.mechanism for g in report.groups})
        return {"before": before, "after": after, "same": same, "asleep": asleep, "refused": refused,
                "awake": awake, "mechanisms": mechanisms, "slept": len(report.groups),
                "module_only": module_only and not is_asleep(beside.group("tp")), "module": len(module.groups)}  # fmt: skip
    finally:
        beside.destroy()
        ps.destroy_model_parallel()


@pytest.mark.multiprocess
def test_compat_sleeps_and_wakes_behind_the_same_groups(gloo_world):
    for got in gloo_world(4).run(_sleep_and_wake, timeout=120):
        assert got["before"] == got["after"] and got["same"] and got["asleep"] and got["awake"]
        assert "TENSOR_MODEL_PARALLEL_GROUP" in got["refused"] and "wake it first" in got["refused"]
        assert got["mechanisms"] == ["fenced"]  # gloo cannot suspend: the groups are fenced, not freed
        assert got["slept"] >= 10  # compat's groups, their gloo twins and the collection's
        assert got["module_only"] and 0 < got["module"] < got["slept"]  # MegatronGroups.sleep: its own
