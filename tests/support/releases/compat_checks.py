"""Checks of ``compat.parallel_state`` against one Megatron-Core release, run inside that release.

:func:`run` is called by ``tests/releases/test_releases_compat.py`` through
``wheels.run_in_release`` — one process per release, in which ``megatron.core.parallel_state``
is that release's module (the reference) and compat picks the release from
``importlib.metadata``. Four sections: ``api``, ``differential``, ``helpers``, ``bad_input``
(what each checks: :func:`run`).
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import signal
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from parallel_state_ng.releases import parse_release

# Public functions compat has in every release on top of Megatron-Core's (documented in
# docs/compat.md: several grids in one job; docs/reliability.md: abort). Anything else compat
# exposes must be the release's; each of these must exist (the list cannot go stale).
COMPAT_EXTRAS = frozenset(
    {
        "get_state",
        "use_state",
        "detach_state",
        "destroy_state",
        "abort_model_parallel",
        "use_collection",
        "sleep_model_parallel",
        "wake_model_parallel",
        "model_parallel_asleep",
    }
)
# The attribute that says which release compat serves.
VERSION_ATTRIBUTE = "MEGATRON_VERSION"

# Default differential plan for one release: hand-written configurations plus random ones per
# world size (world size -> count). Sized for ~2 minutes of the whole suite under -n 2.
RELEASE_PLAN: dict[int, int] = {
    2: 2,
    4: 3,
    8: 6,
    12: 2,
    16: 6,
    24: 2,
    32: 4,
    64: 4,
    96: 1,
    128: 2,
    256: 2,
    512: 1,
    1024: 1,
}
ALARM_S = 60


# --------------------------------------------------------------------------- helpers


def _shape(fn: Callable) -> list[list]:
    """``[name, kind, repr(default)]`` for every parameter (``<none>`` without a default)."""
    return [
        [p.name, p.kind.name, "<none>" if p.default is inspect.Parameter.empty else repr(p.default)]
        for p in inspect.signature(fn).parameters.values()
    ]


def _section(name: str, fn: Callable[[], dict], out: dict) -> None:
    """Run one section; a crash is reported as a problem of that section, not lost."""
    start, cpu = time.perf_counter(), time.process_time()
    try:
        result = fn()
    except Exception:
        result = {"problems": [f"{name} crashed:\n{traceback.format_exc()[-3000:]}"]}
    result["seconds"] = round(time.perf_counter() - start, 2)
    result["cpu_seconds"] = round(time.process_time() - cpu, 2)
    out[name] = result


def _release_names(path: Path) -> tuple[set, set]:
    """(public function names, ``_``-state global names) of a release's parallel_state.py, read with ast."""
    tree = ast.parse(path.read_text())
    functions, state = set(), set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            functions.add(node.name)
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            if isinstance(target, ast.Name) and target.id.startswith("_") and not target.id.startswith("__"):
                state.add(target.id)
    return functions, state


def known_release_names() -> tuple[set, set]:
    """Union over every supported release (cached wheels) of public functions and state globals."""
    from tests.support.releases import wheels

    functions, state = set(), set()
    for version in wheels.RELEASES.values():
        f, s = _release_names(wheels.release_dir(version) / "megatron" / "core" / "parallel_state.py")
        functions |= f
        state |= s
    return functions, state


def _compat_functions(ps: Any) -> dict[str, Callable]:
    """Compat's public callables that are ours (not classes, not imported library helpers)."""
    out = {}
    for name, obj in vars(ps).items():
        if name.startswith("_") or inspect.isclass(obj) or inspect.ismodule(obj) or not callable(obj):
            continue
        module = getattr(obj, "__module__", "") or ""
        if module.split(".")[0] in ("compat", "parallel_state_ng"):
            out[name] = obj
    return out


# --------------------------------------------------------------------------- API


def api_report(version: str) -> dict:
    """Names, signatures, globals and ``RankGenerator`` of compat vs the release, both directions."""
    import megatron.core.parallel_state as ref

    import compat.parallel_state as ps
    from tests.support.differential import library as D

    problems: list[str] = []
    served = getattr(ps, VERSION_ATTRIBUTE, None)
    if served is None or str(served) != version:
        problems.append(f"compat.parallel_state.{VERSION_ATTRIBUTE} is {served!r}, expected {version!r}")

    theirs = D.reference_functions()
    ours = _compat_functions(ps)
    for name, fn in theirs.items():
        mine = getattr(ps, name, None)
        if mine is None:
            problems.append(f"missing function {name}{inspect.signature(fn)}")
        elif inspect.isclass(mine) or not callable(mine):
            problems.append(f"{name} is not a function in compat: {type(mine).__name__}")
        elif _shape(mine) != _shape(fn):
            problems.append(f"signature of {name}: release {inspect.signature(fn)} != compat {inspect.signature(mine)}")
    for name in sorted(COMPAT_EXTRAS - set(ours)):
        problems.append(f"compat lacks its documented extra {name} (or COMPAT_EXTRAS is stale)")
    for name in sorted(set(ours) - set(theirs) - COMPAT_EXTRAS):
        problems.append(f"compat has public function {name}{inspect.signature(ours[name])}, which {version} lacks")

    known_functions, known_state = known_release_names()
    globals_ = D.reference_globals()
    for name in globals_:
        if not hasattr(ps, name):
            problems.append(f"missing global {name}")
    for name in sorted(known_state - set(globals_)):
        if name in vars(ps):
            problems.append(f"compat has global {name}, which {version} lacks (another release has it)")
    for name in sorted(known_functions - set(theirs)):
        if hasattr(ps, name):
            problems.append(f"compat has {name}, which {version} lacks (another release has it): hasattr must be False")

    methods = {
        n
        for n, o in vars(ref.RankGenerator).items()
        if inspect.isfunction(o) and (not n.startswith("_") or n == "__init__")
    }
    rg = getattr(ps, "RankGenerator", None)
    if not inspect.isclass(rg):
        problems.append("compat.parallel_state.RankGenerator is not a class")
        mine_methods: set = set()
    else:
        mine_methods = {n for n in dir(rg) if callable(getattr(rg, n)) and not n.startswith("_")} | {"__init__"}
    for name in sorted(methods):
        if name not in mine_methods:
            problems.append(f"RankGenerator lacks {name}")
        elif _shape(getattr(rg, name)) != _shape(getattr(ref.RankGenerator, name)):
            problems.append(
                f"RankGenerator.{name}: release {inspect.signature(getattr(ref.RankGenerator, name))} "
                f"!= compat {inspect.signature(getattr(rg, name))}"
            )
    for name in sorted(mine_methods - methods):
        problems.append(f"compat RankGenerator has {name}, which {version}'s lacks")
    return {
        "functions": len(theirs),
        "globals": len(globals_),
        "rank_generator_methods": len(methods),
        "compat_functions": len(ours),
        "problems": problems,
    }


# --------------------------------------------------------------------------- differential


def differential_report(
    plan: dict, hand_written: bool, max_configs: int, shard: int = 0, shards: int = 1, lead: bool | None = None
) -> dict:
    """The differential harness over this release's configurations; mismatches as text.

    ``shard`` of ``shards``: every ``shards``-th configuration from the ``shard``-th, so that
    several processes share one release's plan (or a run covers one part of it); the
    uninitialized state and the harness self-check run where ``lead`` (default: in shard 0).
    """
    lead = shard == 0 if lead is None else lead
    import megatron.core.parallel_state as ref
    import torch.distributed as dist

    import compat.parallel_state as ps
    from tests.support.differential import configs as C
    from tests.support.differential import legacy_layout, plans
    from tests.support.differential import library as D
    from tests.support.differential import run as diff_run

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    problems: list[str] = []
    # uninitialized: without a default group, then in a world
    if dist.is_initialized():
        dist.destroy_process_group()
    for world, rank in ((None, None), (8, 3), (64, 63)) if lead else ():
        if world is not None:
            D.fake_world(rank, world)
        D.reset_mcore()
        ps.destroy_model_parallel()
        diffs = D.compare(D.snapshot_uninitialized(ref), D.snapshot_uninitialized(ps))
        if diffs:
            problems.append(f"uninitialized (world {world}, rank {rank}): " + D.describe(diffs, limit=6))

    configs = plans.all_configs({int(w): n for w, n in plan.items()}, hand_written=hand_written)[:max_configs]
    whole_plan = configs
    configs = configs[shard::shards]
    features = {
        "gtp": lambda c: c.kwargs.get("gtp_remat_size", 1) != 1 or c.kwargs.get("expert_gtp_remat_size", 1) != 1,
        "sub_world": lambda c: "local_world_size" in c.kwargs or "rank_offset" in c.kwargs,
        "after_init": lambda c: bool(c.after_init),
        "encoder": legacy_layout.has_encoder,  # 0.12/0.13: an encoder block
        "split_rank": legacy_layout.has_split_rank,  # 0.12/0.13: a pipeline split rank
    }
    present = {
        "gtp": C.has("gtp_remat_size"),
        "sub_world": C.has("local_world_size"),
        "after_init": C.has_function("create_all_gather_groups"),
        "encoder": C.has(legacy_layout.ENC_PP),
        "split_rank": C.has(legacy_layout.SPLIT),
    }
    tally = diff_run.Tally()
    worlds = set()
    with tempfile.TemporaryDirectory() as tmp:
        # the harness against itself: the release compared with itself shows no difference, on
        # the first configuration and the first valid one of each feature the release has (on its
        # first and last compared rank)
        sample = (
            []
            if not lead
            else configs[:1]
            + [
                next((c for c in configs if is_feature(c) and not c.expected_invalid), None)
                for name, is_feature in features.items()
                if present[name]
            ]
        )
        for cfg in filter(None, sample):
            for rank in sorted({cfg.ranks()[0], cfg.ranks()[-1]}):  # e.g. an encoder rank and a decoder rank
                first, second = (diff_run.run_side(ref, cfg, rank, Path(tmp)) for _ in range(2))
                diffs = D.compare(first.comparable(), second.comparable())
                if diffs or (cfg.after_init and first.outcome == "ok" and not first.after_init):
                    problems.append(f"harness self-check {cfg.id} rank {rank}: " + D.describe(diffs, 4))
        for cfg in configs:
            worlds.add(cfg.world)
            failures = diff_run.compare_config(ps, cfg, Path(tmp), tally)
            if failures:
                problems.append(f"{cfg.id}\n" + "\n\n".join(failures)[:6000])
    if dist.is_initialized():
        dist.destroy_process_group()
    return {
        "configs": tally.configs,
        "runs": tally.runs,
        "valid_runs": tally.valid_runs,
        "max_world": max(worlds, default=0),
        "getter_calls": len(D.getter_calls(8)),
        "features": present,
        **{f"with_{name}": sum(1 for c in configs if is_feature(c)) for name, is_feature in features.items()},
        # the same counts over the whole plan (every part), so a part's run checks the plan it is part of
        **{f"plan_with_{name}": sum(1 for c in whole_plan if is_feature(c)) for name, is_feature in features.items()},
        "mismatching_configs": len(tally.mismatches),
        "problems": problems,
    }


# --------------------------------------------------------------------------- helpers


def helpers_report() -> dict:
    """``RankGenerator`` (attributes, every token combination, ``get_gtp_ranks``) and the public
    helpers (``create_group``, ``update_pg_timeout``, ...) of compat against the release's.
    """
    import torch.distributed as dist

    import compat.parallel_state as ps
    from tests.support.differential import helper_cases as H

    problems: list[str] = []
    generators, helpers = H.rank_generator_cases(), H.helper_cases()
    for case in generators:
        try:
            problems += H.compare_rank_generator(ps, case)
        except Exception:
            problems.append(f"RankGenerator({H.case_id(case)}) crashed:\n{traceback.format_exc()[-2000:]}")
    for case in helpers:
        try:
            problems += H.compare_helper(ps, case)
        except Exception:
            problems.append(f"helper {case} crashed:\n{traceback.format_exc()[-2000:]}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"rank_generator_cases": len(generators), "helper_cases": len(helpers), "problems": problems}


# --------------------------------------------------------------------------- bad input


class _Alarm:
    def __enter__(self):
        def expire(signum, frame):
            raise TimeoutError(f"case did not finish within {ALARM_S} s")

        self.previous = signal.signal(signal.SIGALRM, expire)
        signal.alarm(ALARM_S)

    def __exit__(self, *exc):
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.previous)


def bad_input_report() -> dict:
    """Each bad input of the release: compat's error (type, argument named, atomic) vs the release's."""
    import megatron.core.parallel_state as ref
    import torch.distributed as dist

    import compat.parallel_state as ps
    from tests.compat import test_bad_input as B
    from tests.support.differential import library as D

    parameters = set(inspect.signature(ref.initialize_model_parallel).parameters)
    cases = B._build_cases(parameters, parse_release(importlib.metadata.version("megatron-core")))
    problems: list[str] = []
    uncovered = parameters - {c.argument for c in cases}
    if uncovered:
        problems.append(f"initialize_model_parallel parameters without a bad input: {sorted(uncovered)}")
    release_rejects = 0
    for case in cases:
        kwargs: dict[str, Any] = {"create_gloo_process_groups": False, **case.kwargs}
        try:
            with _Alarm():
                D.fake_world(B.RANK, B.WORLD)
                pg_before = set(dist.distributed_c10d._world.pg_map)
                before = D.snapshot(ps, B.RANK)
                try:
                    ps.initialize_model_parallel(**kwargs)
                    ours = None
                except Exception as exc:
                    ours = exc
                if ours is None:
                    ps.destroy_model_parallel()
                    problems.append(f"{case.case_id}: compat accepts it")
                    continue
                if case.argument not in str(ours):
                    problems.append(
                        f"{case.case_id}: message does not name {case.argument}: {type(ours).__name__}: {ours}"
                    )
                left = D.compare(before, D.snapshot(ps, B.RANK))
                if left or set(dist.distributed_c10d._world.pg_map) != pg_before:
                    problems.append(f"{case.case_id}: compat not untouched after its error: " + D.describe(left, 4))
                ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
                if ps.get_tensor_model_parallel_world_size() != 2:
                    problems.append(f"{case.case_id}: a good init after it does not work")
                ps.destroy_model_parallel()
                if not case.run_mcore:
                    continue
                D.fake_world(B.RANK, B.WORLD)
                theirs = B._mcore_outcome(ref, kwargs)
                D.reset_mcore()
                if theirs is not None:
                    release_rejects += 1
                if theirs is not None and case.mcore_fails_for_other_reason is None:
                    expected = B._builtin_type(type(theirs))
                    if not isinstance(ours, expected):
                        problems.append(
                            f"{case.case_id}: the release raises {type(theirs).__name__} ({theirs}); "
                            f"compat raises {type(ours).__name__} ({ours})"
                        )
        except Exception:
            problems.append(f"{case.case_id} crashed:\n{traceback.format_exc()[-2000:]}")
    extra = 0
    if "create_all_gather_groups" in D.reference_functions():  # 0.18+: needs an initialized state
        extra += 1
        D.fake_world(B.RANK, B.WORLD)
        outcomes = []
        for module in (ref, ps):
            fn = getattr(module, "create_all_gather_groups", None)
            result = D.MISSING if fn is None else D._call(fn, {})[0]
            outcomes.append(D.raised(result) if isinstance(result, Exception) else D.encode(result))
        if not D.equivalent(*outcomes):
            problems.append(f"create_all_gather_groups before init: release {outcomes[0]}, compat {outcomes[1]}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return {"cases": len(cases) + extra, "release_rejects": release_rejects, "problems": problems}


# --------------------------------------------------------------------------- entry point


def run(
    version: str,
    plan: dict,
    hand_written: bool = True,
    max_configs: int = 10_000,
    shard: int = 0,
    shards: int = 1,
    lead: bool | None = None,
) -> dict:
    """All checks against the release this process is bound to; returns the JSON summary.

    Per section, what was checked (counts, so a silently empty run is visible) and the problems
    found (plain strings; the parent test asserts the lists are empty):

    * ``api``: both directions — every public function of the release exists in compat with
      equal parameter names, kinds and defaults, and compat has no public function the release
      lacks (apart from :data:`COMPAT_EXTRAS`); every state global of the release exists in
      compat, and compat has none that another supported release has and this one lacks;
      ``RankGenerator``'s constructor and methods both ways; ``MEGATRON_VERSION`` names the
      release.
    * ``differential``: :mod:`tests.support.differential.configs` configurations (hand-written
      and seeded random, world sizes to 1,024, on the fake backend) on several ranks each, every
      getter and global of the release compared (:mod:`tests.support.differential.library`);
      plus the uninitialized state.
    * ``helpers``: ``RankGenerator`` and the public helper functions
      (:mod:`tests.support.differential.helper_cases`).
    * ``bad_input``: the table of ``tests/compat/test_bad_input.py`` restricted to the release's
      parameters: compat raises at once naming the argument, stays untouched, accepts a good call
      next; where the release raises, compat's exception is an instance of the release's type.

    ``shard`` of ``shards`` splits the differential (see :func:`differential_report`); the
    ``api``, ``helpers`` and ``bad_input`` sections run where ``lead`` (default: in shard 0).
    """
    lead = shard == 0 if lead is None else lead
    start = time.perf_counter()
    out: dict[str, Any] = {"version": version, "installed": importlib.metadata.version("megatron-core")}
    if out["installed"] != version:
        return {**out, "problems": [f"process is bound to {out['installed']}, not {version}"]}
    if lead:
        _section("api", lambda: api_report(version), out)
    _section("differential", lambda: differential_report(plan, hand_written, max_configs, shard, shards, lead), out)
    if lead:
        _section("helpers", helpers_report, out)
        _section("bad_input", bad_input_report, out)
    out["seconds"] = round(time.perf_counter() - start, 2)
    out["cpu_seconds"] = round(time.process_time(), 2)  # of the whole child, imports included
    return out
