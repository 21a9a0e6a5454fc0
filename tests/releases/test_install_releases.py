"""``compat.install()`` and the ProcessGroupCollection export on every supported release.

One subprocess per release (``tests.support.releases.wheels.run_in_release``): the release's own
``megatron.core.parallel_state``, ``process_groups_config`` and ``hyper_comm_grid`` are loaded
first, plus a module that binds names with ``from megatron.core.parallel_state import ...``;
then ``compat.install(hyper_comm_grid=True)`` must rebind all of them to compat (serving that
release), the release's own ``ProcessGroupCollection.use_mpu_process_groups()`` must then give
exactly the groups of ``compat.pg_collection.to_process_group_collection()``, and
``uninstall()`` must restore every name. 0.12 and 0.13 have no ``HyperCommGrid``:
``install(hyper_comm_grid=True)`` must refuse there and leave nothing installed, and their
``ModelCommProcessGroups.use_mpu_process_groups()`` (0.13) must read compat's groups.
"""

from __future__ import annotations

import pytest

from parallel_state_ng.releases import installed_megatron_version
from tests.support import rotation
from tests.support.releases import wheels

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.network]

VERSIONS = list(wheels.RELEASES.values())


def check_install(version: str) -> dict:
    """Child side: run in a process bound to megatron-core ``version``; returns what was seen."""
    import dataclasses
    import sys
    import types

    import megatron.core.parallel_state as theirs
    import megatron.core.process_groups_config as pgc
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallel_state_ng.releases import UnsupportedReleaseError

    try:
        import megatron.core.hyper_comm_grid as mgrid
    except ImportError:  # 0.12, 0.13
        mgrid = None

    user = types.ModuleType("megatron.core.user_code")  # a module with MCore-style from-imports
    exec(
        "from megatron.core.parallel_state import get_data_parallel_group, get_tensor_model_parallel_rank\n"
        + ("from megatron.core.hyper_comm_grid import HyperCommGrid\n" if mgrid else ""),
        user.__dict__,
    )
    sys.modules[user.__name__] = user

    import compat
    import compat.parallel_state as ps
    from compat.pg_collection import to_process_group_collection
    from parallel_state_ng.builders.grid_releases import hyper_comm_grid_class

    out: dict = {"served": ps.MEGATRON_VERSION}
    if mgrid is None:
        try:
            compat.install(hyper_comm_grid=True)
            out["grid_refused"] = "installed"
        except UnsupportedReleaseError as exc:
            out["grid_refused"] = str(exc)
        out["untouched"] = sys.modules["megatron.core.parallel_state"] is theirs
        compat.install()
    else:
        our_grid = hyper_comm_grid_class(ps.MEGATRON_RELEASE)  # the served release's grid surface
        compat.install(hyper_comm_grid=True)
    out["rebound"] = {
        "sys.modules": sys.modules["megatron.core.parallel_state"] is ps,
        "megatron.core attribute": sys.modules["megatron.core"].parallel_state is ps,
        "process_groups_config": getattr(pgc, "parallel_state", ps) is ps,  # 0.12's does not import it
        "from-import function": user.get_data_parallel_group is ps.get_data_parallel_group,
        "from-import rank getter": user.get_tensor_model_parallel_rank is ps.get_tensor_model_parallel_rank,
    }
    if mgrid is not None:
        out["rebound"]["grid module"] = mgrid.HyperCommGrid is our_grid
        out["rebound"]["from-import grid"] = user.HyperCommGrid is our_grid
    dist.init_process_group("fake", rank=3, world_size=8, store=FakeStore())
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=2,
            expert_model_parallel_size=2,
            create_gloo_process_groups=False,
        )
        collection = getattr(pgc, "ProcessGroupCollection", None)
        if collection is None:  # 0.14: ModelCommProcessGroups, no ProcessGroupCollection
            try:
                to_process_group_collection()
                out["export"] = "no error"
            except ImportError as exc:
                out["export"] = f"ImportError: {exc}"
            if hasattr(pgc.ModelCommProcessGroups, "use_mpu_process_groups"):  # 0.12 has none
                model = pgc.ModelCommProcessGroups.use_mpu_process_groups()
                out["model_comm_tp_is_compat"] = model.tp is ps.get_tensor_model_parallel_group()
                out["model_comm_pp_is_compat"] = model.pp is ps.get_pipeline_model_parallel_group()
        else:
            reference = collection.use_mpu_process_groups()  # the release's own method, on compat
            ours = to_process_group_collection()
            names = [f.name for f in dataclasses.fields(collection)]
            out["fields"] = len(names)
            out["differing_fields"] = [n for n in names if getattr(reference, n) is not getattr(ours, n)]
            out["unset_fields"] = sorted(n for n in names if getattr(ours, n) is None)
        ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    compat.uninstall()
    out["restored"] = {
        "sys.modules": sys.modules["megatron.core.parallel_state"] is theirs,
        "process_groups_config": getattr(pgc, "parallel_state", theirs) is theirs,
        "from-import function": user.get_data_parallel_group is theirs.get_data_parallel_group,
    }
    if mgrid is not None:
        out["restored"]["grid module"] = mgrid.HyperCommGrid is not our_grid
        out["restored"]["from-import grid"] = user.HyperCommGrid is mgrid.HyperCommGrid
    return out


# the installed release and 0.19.2 in every run, the others rotating in 3 parts (tests/support/rotation.py)
@pytest.mark.parametrize(
    "version", rotation.sample(VERSIONS, keep={installed_megatron_version(), wheels.RELEASES["0.19"]}, parts=3)
)
def test_install_on_release(version):
    out = wheels.run_in_release(version, "tests.releases.test_install_releases", "check_install", version)
    assert out["served"] == version
    assert all(out["rebound"].values()), out["rebound"]
    assert all(out["restored"].values()), out["restored"]
    if "fields" in out:
        assert out["differing_fields"] == [], out
        assert out["fields"] == {"0.18": 22, "0.19": 27}.get(version[:4], 20)
        assert {"inter_dist_opt", "hcp"} <= set(out["unset_fields"])  # one optimizer instance, no hierarchical cp
    else:
        assert out["export"].startswith("ImportError") and version[:4] in out["export"]
        if version[:4] != "0.12":  # 0.12's ModelCommProcessGroups has no use_mpu_process_groups
            assert out["model_comm_tp_is_compat"] and out["model_comm_pp_is_compat"]
    if version[:4] in ("0.12", "0.13"):
        assert "no HyperCommGrid" in out["grid_refused"] and out["untouched"], out
