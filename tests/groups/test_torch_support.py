"""The torch facts table (parallel_state_ng/groups/torch_support.py) and compat following it."""

from __future__ import annotations

import pytest

from parallel_state_ng.groups import torch_support as T
from parallel_state_ng.layout.order import EmptyGroupAssertionError, EmptyGroupError


@pytest.mark.parametrize(
    "version,split,empty",
    [("2.4.1", False, TypeError), ("2.5.1", True, TypeError), ("2.6.0", True, TypeError), ("2.13.0+cpu", True, TypeError),
     ("2.14.1+cu130", True, AssertionError), ("2.15.0", True, AssertionError)],
)  # fmt: skip
def test_facts_by_version(version, split, empty):
    assert T.torch_has("split_group", version) is split
    assert T.empty_group_error(version) is empty


def test_facts_of_a_torch_attribute_match_the_torch_at_hand():
    """Each fact that is an attribute of torch agrees with the installed torch (the matrix runs it on each)."""
    import inspect

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed import fake_pg

    present = {
        "split_group": hasattr(dist, "split_group"),
        "abort_process_group": hasattr(dist.distributed_c10d, "_abort_process_group"),
        "shrink_group": hasattr(dist, "shrink_group"),
        "abort_process_group_any_backend": hasattr(dist.distributed_c10d, "_abort_process_group")
        and "only has implementation for ProcessGroupNCCL"
        not in inspect.getsource(dist.distributed_c10d._abort_process_group),
        # the extended API's creator takes (common_opts, backend_opts); the old one four arguments
        "fake_backend_takes_options": len(inspect.signature(fake_pg._create_fake_pg).parameters) == 2,
        "device_mesh_flatten_mapping": "self._flatten_mapping" in inspect.getsource(DeviceMesh),
        "unregistered_group_backend_valueerror": "is not initialized in the world group map"
        in inspect.getsource(dist.get_backend),
    }
    assert {fact: T.torch_has(fact) for fact in present} == present


def test_bad_fact_and_version():
    with pytest.raises(KeyError, match="unknown torch fact 'nope'.*split_group"):
        T.torch_has("nope")
    with pytest.raises(ValueError, match="not a torch version: 'x'"):
        T.torch_release("x")


def test_report_names_every_internal():
    found = T.report()
    assert set(found["facts"]) == set(T.TORCH_FACTS)
    assert found["internals"]["_world.pg_map"] is True
    assert found["internals"]["_new_process_group_helper(backend)"] is True
    assert found["internals"]["fake backend + FakeStore"] is True


def test_compat_raises_what_mcore_raises_on_this_torch(fake_world):
    import compat.parallel_state as ps

    fake_world(3, 8)
    with pytest.raises(EmptyGroupError, match="get_embedding_ranks returned no ranks") as info:
        ps.initialize_model_parallel(
            pipeline_model_parallel_size=4, get_embedding_ranks=lambda ranks: [], create_gloo_process_groups=False
        )
    assert isinstance(info.value, T.empty_group_error())
    assert isinstance(info.value, EmptyGroupAssertionError) is (T.empty_group_error() is AssertionError)
    assert not ps.model_parallel_is_initialized()
