"""What differs between ``compat.parallel_state`` now and a never-initialized one.

A never-initialized module has every global at the served release's import-time value (``None``,
or an empty container where the release starts one so: 0.12's hierarchical context-parallel
list, 0.16's hybrid groups' dict), no state object, and torch holds only the process groups it
held before. Tests of failed, refused and repeated initialization compare against it.
"""

from __future__ import annotations

import torch.distributed as dist

import compat.parallel_state as ps
from compat import _publish as published
from parallel_state_ng.releases import parallel_state as release_api
from tests.support.served import served

__all__ = ["pristine_problems"]


def pristine_problems(pg_before: set) -> list[str]:
    """Each difference from a never-initialized compat module, in words (empty: none).

    ``pg_before``: the keys of torch's ``_world.pg_map`` before the code under test ran.
    """
    problems = []
    if ps.is_initialized():
        problems.append("is_initialized() is True")
    if ps.get_state() is not None:
        problems.append("get_state() is not None")
    initial = release_api.globals_of(served())  # a global's container type where it starts as one
    for name in (*published.state_globals(vars(ps)), *published.OVERRIDE_GLOBALS, *published.BUFFER_GLOBALS):
        value, kind = getattr(ps, name, None), initial.get(name)
        if not (value is None or (kind is not None and value == kind())):
            problems.append(f"{name} is set")
    now = set(dist.distributed_c10d._world.pg_map)
    if now != pg_before:
        problems.append(f"{len(now - pg_before)} new live groups, {len(pg_before - now)} gone")
    return problems
