"""Our HyperCommGrid against one megatron-core release's, inside a process bound to that release.

:func:`run_checks` runs in a child started by ``tests.support.releases.wheels.run_in_release`` (so
``megatron.core.hyper_comm_grid`` is that release's and ``current_release()`` picks it) and
returns counts per kind of check and the list of mismatches. Both grids get the same calls;
an outcome is the returned value (a process group as its sorted ranks) or the exception:
where megatron raises, ours must raise an instance of the same built-in type; where megatron
accepts, ours must give the same value (or refuse, which is counted as ``stricter``).
"""

from __future__ import annotations

import inspect
import itertools
import os
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def rank_enum(grid: Any, dims: str | list[str]) -> list[list[int]]:
    """``grid.get_rank_enum(dims)``, or on a release without it (before 0.16) the rows it would
    give: ``_gen_rank_enum`` of the dims put in the grid's order, as 0.16's method does.
    """
    if hasattr(grid, "get_rank_enum"):
        return grid.get_rank_enum(dims)
    return grid._gen_rank_enum(grid._order_dims(dims)[0])


def _params(fn: Callable[..., Any]) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _builtin_base(exc: BaseException) -> type:
    return next(cls for cls in type(exc).__mro__ if cls.__module__ == "builtins")


def _outcome(call: Callable[[], Any]) -> tuple[str, Any, Any]:
    """(``"raises"``, exception, exception) or (``"value"``, value, comparable form)."""
    try:
        value = call()
    except Exception as exc:  # noqa: BLE001 - the exception is the outcome
        return ("raises", exc, exc)
    if isinstance(value, dist.ProcessGroup):
        return ("value", value, ("pg", dist.get_process_group_ranks(value)))
    return ("value", value, value)


def _returns(call: Callable[[], Any], expected: Any) -> bool:
    """Whether ``call()`` returns ``expected`` itself (no exception)."""
    kind, value, _ = _outcome(call)
    return kind == "value" and value is expected


class _Report:
    def __init__(self) -> None:
        self.checks: Counter[str] = Counter()
        self.mismatches: list[str] = []

    def same(self, kind: str, what: str, theirs: Callable[[], Any], ours: Callable[[], Any]) -> tuple[Any, Any]:
        """Run both calls, compare outcomes, return (their value or exception, ours) as returned."""
        t, o = _outcome(theirs), _outcome(ours)
        self.checks[kind] += 1
        if t[0] == "raises":
            base = _builtin_base(t[1])
            if o[0] != "raises" or not isinstance(o[1], base):
                got = f"{type(o[1]).__name__}: {o[1]}" if o[0] == "raises" else f"returned {o[2]!r}"
                self.mismatches.append(f"{kind} {what}: megatron raises {base.__name__} ({t[1]}), ours {got}")
        elif o[0] == "raises":
            self.checks["stricter"] += 1
        elif t[2] != o[2]:
            self.mismatches.append(f"{kind} {what}: megatron {t[2]!r}, ours {o[2]!r}")
        return t[1], o[1]

    def true(self, kind: str, what: str, ok: bool) -> None:
        self.checks[kind] += 1
        if not ok:
            self.mismatches.append(f"{kind} {what}")


def _fake(rank: int, world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def _check_surface(report: _Report, theirs: type, ours: type, engine: type, facts: Any) -> None:
    names = {
        n
        for n, v in vars(theirs).items()
        if callable(v) and (not n.startswith("_") or n in ("__init__", "_gen_rank_enum"))
    }
    report.true(
        "surface",
        f"data lists {sorted(facts.method_names())}, release has {sorted(names)}",
        names == set(facts.method_names()),
    )
    for name in sorted(names):
        report.true(
            "surface",
            f"{name}: ours {_params(getattr(ours, name))} != {_params(getattr(theirs, name))}",
            _params(getattr(ours, name)) == _params(getattr(theirs, name)),
        )
        # the superset engine accepts every call the release accepts, with the same meaning:
        # the release's parameters unchanged, extras keyword-only with a default
        release_params = _params(getattr(theirs, name))
        engine_params = _params(getattr(engine, name))
        known = {p[0] for p in release_params}
        extras = [p for p in engine_params if p[0] not in known]
        ok = [p for p in engine_params if p[0] in known] == release_params and all(
            p[1] == inspect.Parameter.KEYWORD_ONLY and p[2] is not inspect.Parameter.empty for p in extras
        )
        report.true("surface", f"engine {name} {engine_params} is not a superset of {release_params}", ok)
    os.environ["WORLD_SIZE"] = "8"
    instance = ours([2, 4], ["tp", "dp"])
    del os.environ["WORLD_SIZE"]
    for name in facts.all_method_names():
        if name not in names:
            report.true(
                "surface",
                f"{name} should be absent",
                not hasattr(ours, name) and not hasattr(instance, name) and name not in dir(instance),
            )


def _random_shapes(rng: random.Random, count: int) -> list[tuple[list[int], list[str], int]]:
    pool = ["tp", "cp", "ep", "dp", "pp", "x"]
    out = []
    for _ in range(count):
        k = rng.randint(1, 4)
        out.append(([rng.choice([1, 2, 3, 4]) for _ in range(k)], rng.sample(pool, k), rng.randint(0, 3)))
    return out


def _check_enumerations(report: _Report, theirs: type, ours: type, seed: int) -> None:
    rng = random.Random(seed)
    os.environ["WORLD_SIZE"] = "512"
    has_enum = hasattr(theirs, "get_rank_enum")
    for shape, names, offset in _random_shapes(rng, 14):
        t, o = theirs(shape, names, rank_offset=offset), ours(shape, names, rank_offset=offset)
        for attr in ("shape", "dim_names", "rank_offset", "size", "backend"):
            report.true("attributes", f"{attr} of {shape} {names}", getattr(t, attr) == getattr(o, attr))
        for k in range(1, len(names) + 1):
            for subset in itertools.combinations(names, k):
                dims = rng.sample(list(subset), k)  # any order: megatron orders within the group by it
                what = f"{shape} {names} +{offset} {dims}"
                report.same(
                    "_gen_rank_enum", what, lambda: t._gen_rank_enum(list(dims)), lambda: o._gen_rank_enum(list(dims))
                )
                if has_enum:
                    report.same(
                        "get_rank_enum", what, lambda: t.get_rank_enum(list(dims)), lambda: o.get_rank_enum(list(dims))
                    )
                    if k == 1:
                        report.same(
                            "get_rank_enum", what, lambda: t.get_rank_enum(dims[0]), lambda: o.get_rank_enum(dims[0])
                        )
    del os.environ["WORLD_SIZE"]


MEMBERSHIP = [  # (shape, dim_names, rank_offset) on a fake world of 24
    ([2, 3, 2], ["tp", "dp", "pp"], 0),
    ([2, 2, 2], ["pp", "tp", "dp"], 8),
    ([4, 1, 3], ["dp", "cp", "tp"], 12),
]
MEMBERSHIP_RANKS = [0, 9, 13, 23]


def _check_membership(report: _Report, theirs: type, ours: type) -> None:
    lifecycle = hasattr(theirs, "destroy")
    for rank in MEMBERSHIP_RANKS:
        _fake(rank, 24)
        for shape, names, offset in MEMBERSHIP:
            t, o = theirs(shape, names, offset), ours(shape, names, offset)
            subsets = [list(c) for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)]
            made = []
            for dims in subsets:
                what = f"rank {rank} {names} +{offset} {dims}"
                tpg, opg = report.same(
                    "create_pg",
                    what,
                    lambda: t.create_pg(list(reversed(dims))),
                    lambda: o.create_pg(list(reversed(dims))),
                )
                report.true(
                    "get_pg", what, _returns(lambda: t.get_pg(dims), tpg) and _returns(lambda: o.get_pg(dims), opg)
                )
                made.append(opg)
            if lifecycle:
                report.same(
                    "is_current_rank_in_grid",
                    f"rank {rank} +{offset}",
                    t.is_current_rank_in_grid,
                    o.is_current_rank_in_grid,
                )
                t.destroy()
                o.destroy()
                alive = dist.distributed_c10d._world.pg_map
                report.true("destroy", f"rank {rank} {names}", not any(pg in alive for pg in made if pg is not None))
                report.same(
                    "destroy",
                    f"get_pg after destroy, rank {rank}",
                    lambda: t.get_pg(names[0]),
                    lambda: o.get_pg(names[0]),
                )


VIEWS = [  # (base shape, base names, view name, view shape, view names, shared dims), 16 ranks
    ([2, 1, 4, 2], ["tp", "cp", "dp", "pp"], "expert", [1, 4, 2, 2], ["etp", "ep", "edp", "pp"], ["pp"]),
    ([2, 2, 2, 2], ["tp", "cp", "dp", "pp"], "merged", [4, 2, 2], ["tpcp", "dp", "pp"], ["dp", "pp"]),
]


def _check_views(report: _Report, theirs: type, ours: type) -> None:
    for rank in (0, 6, 15):
        _fake(rank, 16)
        for shape, names, view, vshape, vnames, shared in VIEWS:
            t, o = theirs(shape, names), ours(shape, names)
            report.same(
                "register_view",
                view,
                lambda: t.register_view(view, vshape, vnames, shared_dims=shared),
                lambda: o.register_view(view, vshape, vnames, shared_dims=shared) and None,
            )
            for k in range(1, len(vnames) + 1):
                for dims in map(list, itertools.combinations(vnames, k)):
                    what = f"rank {rank} {view} {dims}"
                    report.same(
                        "view get_rank_enum",
                        what,
                        lambda: t.get_rank_enum(dims, view=view),
                        lambda: o.get_rank_enum(dims, view=view),
                    )
                    report.same(
                        "view create_pg",
                        what,
                        lambda: t.create_pg(dims, view=view),
                        lambda: o.create_pg(dims, view=view),
                    )
            # dims all shared: the view's group is the base group, created once
            for dims in [[d] for d in shared] + ([shared] if len(shared) > 1 else []):
                what = f"rank {rank} {view} shared {dims}"
                report.same(
                    "shared reuse",
                    what,
                    lambda: t.get_pg(dims, view=view) is t.get_pg(dims),
                    lambda: o.get_pg(dims, view=view) is o.get_pg(dims),
                )
                report.same("shared reuse", what, lambda: t.create_pg(dims), lambda: o.create_pg(dims))
            report.same("view keyword-only", view, lambda: t.get_pg(vnames[0], view), lambda: o.get_pg(vnames[0], view))
            report.same(
                "view keyword-only", view, lambda: t.create_pg(vnames[0], view), lambda: o.create_pg(vnames[0], view)
            )
            report.same(
                "view keyword-only",
                view,
                lambda: t.get_rank_enum(vnames[0], view),
                lambda: o.get_rank_enum(vnames[0], view),
            )
            t.destroy()
            o.destroy()
        # created through the view first, then found in the base view
        t, o = theirs([2, 4, 2], ["tp", "dp", "pp"]), ours([2, 4, 2], ["tp", "dp", "pp"])
        for g in (t, o):
            g.register_view("expert", [4, 2, 2], ["ep", "edp", "pp"], shared_dims=["pp"])
        report.same(
            "shared reuse",
            f"rank {rank} view first",
            lambda: t.create_pg("pp", view="expert") is t.get_pg("pp"),
            lambda: o.create_pg("pp", view="expert") is o.get_pg("pp"),
        )
        report.same("shared reuse", f"rank {rank} view first", lambda: t.create_pg("pp"), lambda: o.create_pg("pp"))
        t.destroy()
        o.destroy()


BRIDGE_GRIDS = [  # (shape, dim_names, rank_offset) over 32 ranks; bridge code needs tp, cp, pp, dp
    ([2, 1, 2, 2], ["tp", "cp", "pp", "dp"], 0),
    ([1, 1, 4, 2], ["tp", "cp", "pp", "dp"], 8),
    ([2, 1, 2, 4], ["tp", "cp", "dp", "pp"], 16),
    ([4, 1, 2, 1], ["pp", "tp", "dp", "cp"], 3),
]


def _bridge_module() -> Any:
    """Megatron's ``bridge_communicator`` of this release, loaded without its package's
    ``__init__`` (which imports the whole pipeline stack); ``None`` before 0.15.
    """
    import importlib
    import sys
    import types

    import megatron.core

    name = "megatron.core.pipeline_parallel"
    path = os.path.join(megatron.core.__path__[0], "pipeline_parallel")
    if not os.path.isfile(os.path.join(path, "bridge_communicator.py")):
        return None
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [path]
        sys.modules[name] = package
    return importlib.import_module(name + ".bridge_communicator")


def _check_megatron_callers(report: _Report, theirs: type, ours: type) -> None:
    """Megatron's own bridge code (it calls ``grid._gen_rank_enum``) on both grids."""
    bridge = _bridge_module()
    if bridge is None:
        return
    from types import SimpleNamespace

    comm = bridge.BridgeCommunicator
    os.environ["WORLD_SIZE"] = "32"
    for shape, names, offset in BRIDGE_GRIDS:
        t, o = theirs(shape, names, offset), ours(shape, names, offset)
        for rank in range(offset, offset + 8):
            me = SimpleNamespace(current_rank=rank)
            for is_src in (True, False):
                what = f"{names} {shape} +{offset} rank {rank} src={is_src}"
                report.same(
                    "bridge_communicator",
                    what,
                    lambda: comm.get_leader_rank(me, t, is_src),
                    lambda: comm.get_leader_rank(me, o, is_src),
                )
                report.same(
                    "bridge_communicator",
                    what,
                    lambda: comm.get_boundary_pp_stage_ranks(me, t, is_src),
                    lambda: comm.get_boundary_pp_stage_ranks(me, o, is_src),
                )
    del os.environ["WORLD_SIZE"]


def _bad_inputs(has: set[str]) -> list[tuple[str, Callable[[type], Any]]]:
    def grid(cls: type) -> Any:
        return cls([2, 2, 4], ["tp", "pp", "dp"])  # 16 ranks, pp stride 2

    def created(cls: type, dims: Any) -> Any:
        g = grid(cls)
        g.create_pg(dims)
        return g

    cases: list[tuple[str, Callable[[type], Any]]] = [
        ("length mismatch", lambda c: c([2, 2], ["tp"])),
        ("larger than world", lambda c: c([8, 16], ["tp", "dp"])),
        ("larger than world after offset", lambda c: c([4, 8], ["tp", "dp"], 33)),
        ("negative offset", lambda c: c([2, 2], ["tp", "dp"], -1)),
        ("size str", lambda c: c([2, "2"], ["tp", "dp"])),
        ("create_pg unknown str", lambda c: grid(c).create_pg("zz")),
        ("create_pg unknown in list", lambda c: grid(c).create_pg(["tp", "zz"])),
        ("get_pg unknown str", lambda c: grid(c).get_pg("zz")),
        ("get_pg unknown list", lambda c: grid(c).get_pg(["zz"])),
        ("_gen_rank_enum unknown", lambda c: grid(c)._gen_rank_enum(["zz"])),
        ("create_pg repeated dim", lambda c: grid(c).create_pg(["tp", "tp"])),
        ("get_pg repeated dim", lambda c: grid(c).get_pg(["tp", "tp"])),
        ("create_pg twice", lambda c: created(c, ["tp", "dp"]).create_pg(["dp", "tp"])),
        ("get_pg before create_pg", lambda c: grid(c).get_pg(["tp", "dp"])),
        ("create_pg view= keyword", lambda c: grid(c).create_pg("tp", view="base")),
        ("get_pg view= keyword", lambda c: created(c, "tp").get_pg("tp", view="base")),
    ]
    if "get_rank_enum" in has:
        cases += [
            ("get_rank_enum unknown str", lambda c: grid(c).get_rank_enum("zz")),
            ("get_rank_enum unknown list", lambda c: grid(c).get_rank_enum(["tp", "zz"])),
        ]
    if "register_view" in has:

        def view(cls: type, *args: Any, twice: bool = False, **kwargs: Any) -> Any:
            g = grid(cls)
            if twice:
                g.register_view(*args, **kwargs)
            return g.register_view(*args, **kwargs) and None

        cases += [
            ("view name taken", lambda c: view(c, "expert", [4, 2, 2], ["ep", "pp", "edp"], ["pp"], twice=True)),
            ("view named base", lambda c: view(c, "base", [4, 2, 2], ["ep", "pp", "edp"])),
            ("view length mismatch", lambda c: view(c, "expert", [4, 4], ["ep", "pp", "edp"])),
            ("view duplicate dim names", lambda c: view(c, "expert", [4, 2, 2], ["ep", "ep", "edp"])),
            ("view size zero", lambda c: view(c, "expert", [4, 0, 2], ["ep", "pp", "edp"])),
            ("view size float", lambda c: view(c, "expert", [4, 2.0, 2], ["ep", "pp", "edp"])),
            ("view wrong size", lambda c: view(c, "expert", [2, 2, 2], ["ep", "pp", "edp"])),
            ("view duplicate shared", lambda c: view(c, "expert", [4, 2, 2], ["ep", "pp", "edp"], ["pp", "pp"])),
            ("view shared not in base", lambda c: view(c, "expert", [4, 2, 2], ["ep", "pp", "edp"], ["ep"])),
            ("view shared not in view", lambda c: view(c, "expert", [4, 2, 2], ["ep", "xx", "edp"], ["pp"])),
            ("view shared membership differs", lambda c: view(c, "expert", [2, 2, 4], ["ep", "edp", "pp"], ["pp"])),
            ("unknown view get_pg", lambda c: grid(c).get_pg("tp", view="nope")),
            ("unknown view create_pg", lambda c: grid(c).create_pg("tp", view="nope")),
            (
                "dim not in view",
                lambda c: (
                    lambda g: (
                        g.register_view("e", [4, 2, 2], ["ep", "pp", "edp"], ["pp"]),
                        g.create_pg("tp", view="e"),
                    )
                )(grid(c)),
            ),
        ]
    return cases


def _check_bad_input(report: _Report, theirs: type, ours: type, has: set[str]) -> None:
    _fake(0, 64)
    for what, case in _bad_inputs(has):
        report.same("bad input", what, lambda: case(theirs), lambda: case(ours))
    dist.destroy_process_group()
    os.environ.pop("WORLD_SIZE", None)
    report.same("bad input", "no world size", lambda: theirs([2], ["tp"]), lambda: ours([2], ["tp"]))


def run_checks(seed: int) -> dict[str, Any]:
    """All checks against the release this process is bound to; JSON-able summary."""
    import time

    start = time.perf_counter()
    from megatron.core import hyper_comm_grid as mcore

    from parallel_state_ng.builders.grid import HyperCommGrid as Engine
    from parallel_state_ng.builders.grid_releases import hyper_comm_grid_class
    from parallel_state_ng.releases import current_release
    from parallel_state_ng.releases import hyper_comm_grid as facts

    theirs, ours = mcore.HyperCommGrid, hyper_comm_grid_class()
    has = set(facts.method_names())
    report = _Report()
    _check_surface(report, theirs, ours, Engine, facts)
    _check_enumerations(report, theirs, ours, seed)
    _check_membership(report, theirs, ours)
    _check_megatron_callers(report, theirs, ours)
    if "register_view" in has:
        _check_views(report, theirs, ours)
        _check_views(report, theirs, Engine)  # the superset class has the 0.19 semantics too
    _check_bad_input(report, theirs, ours, has)
    if dist.is_initialized():
        dist.destroy_process_group()
    return {
        "release": str(current_release()),
        "served": ours.megatron_release,
        "methods": sorted(has),
        "checks": dict(report.checks),
        "mismatches": report.mismatches,
        "seconds": round(time.perf_counter() - start, 2),
    }
