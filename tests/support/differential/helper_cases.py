"""Public helpers and ``RankGenerator`` of compat against the reference release.

Shared by the in-process test (``tests/compat/test_compat_differential.py``, installed release) and the
per-release check (``tests/support/releases/compat_checks.py``). Like ``tests/support/differential/library.py`` everything
follows the reference ``megatron.core.parallel_state`` of this process: a helper the reference
lacks is not called; ``RankGenerator`` facts are the reference instance's own attributes, its
own axes (0.19's ``gtp_remat`` included) and its own methods (``get_gtp_ranks`` where it has
it).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from typing import Any

import megatron.core.parallel_state as mcore_ps

from tests.support.differential import library as D

# --------------------------------------------------------------------------- RankGenerator


def _outcome(fn: Callable[[], Any]) -> Any:
    result, warned = D._call(fn, {})
    value = D.raised(result) if isinstance(result, Exception) else D.encode(result)
    return (value, warned) if warned else value


def rank_generator_facts(ps: Any, kwargs: dict, attributes: list[str], tokens: list[str]) -> dict[str, Any]:
    """Attributes of ``ps.RankGenerator(**kwargs)``, ``get_ranks`` / ``get_mask`` for token
    combinations (and ``get_gtp_ranks`` where the reference has it).
    """
    gen = ps.RankGenerator(**kwargs)
    facts = {a: D.encode(getattr(gen, a, D.MISSING)) for a in attributes}
    for n in (1, 2, 3):
        for combo in itertools.combinations(tokens + ["xx"], n):
            for token in {"-".join(combo), "-".join(reversed(combo))}:
                facts[f"get_ranks({token})"] = _outcome(lambda: gen.get_ranks(token))
                facts[f"get_mask({token})"] = _outcome(lambda: gen.get_mask(gen.order, token))
    facts["get_ranks(all)"] = _outcome(lambda: gen.get_ranks("-".join(tokens)))
    if hasattr(mcore_ps.RankGenerator, "get_gtp_ranks"):
        for size in (1, 2, kwargs.get("gtp_remat", 1)):
            facts[f"get_gtp_ranks({size})"] = _outcome(lambda: gen.get_gtp_ranks(size))
    return facts


RANK_GENERATOR_CASES: list[dict[str, Any]] = [
    dict(zip(("tp", "ep", "dp", "pp", "cp", "order", "rank_offset"), args))
    for args in [
        (2, 1, 4, 2, 1, "tp-cp-ep-dp-pp"),
        (2, 1, 2, 2, 2, "tp-cp-ep-dp-pp"),
        (1, 4, 2, 2, 1, "tp-cp-ep-dp-pp"),
        (2, 2, 2, 2, 1, "tp-pp-dp"),
        (2, 1, 2, 2, 2, "cp-tp-dp-pp"),
        (3, 1, 2, 1, 1, "TP-DP"),
        (2, 2, 1, 1, 2, "tp-cp-ep-dp-pp"),
        (2, 1, 2, 1, 1, "dp"),
        (2, 1, 2, 2, 1, "tp-dp-pp", 16),
        (1, 1, 1, 1, 1, ""),
        (2, 1, 2, 1, 1, "tp-tp-dp"),
        (4, 2, 2, 2, 1, "pp-ep-dp-tp"),
    ]
] + [  # 0.19: the GTP axis (kept where the reference's constructor takes gtp_remat)
    {"tp": 2, "ep": 1, "dp": 2, "pp": 2, "cp": 1, "order": "tp-gtp_remat-cp-ep-dp-pp", "gtp_remat": 2},
    {"tp": 1, "ep": 2, "dp": 2, "pp": 1, "cp": 1, "order": "tp-cp-ep-gtp_remat-dp-pp", "gtp_remat": 2},
    {
        "tp": 2,
        "ep": 1,
        "dp": 1,
        "pp": 2,
        "cp": 2,
        "order": "tp-gtp_remat-cp-ep-dp-pp",
        "gtp_remat": 4,
        "rank_offset": 8,
    },
    {"tp": 2, "ep": 1, "dp": 2, "pp": 1, "cp": 1, "order": "tp-cp-ep-dp-pp", "gtp_remat": 1},
    {"tp": 2, "ep": 1, "dp": 2, "pp": 1, "cp": 1, "order": "tp-cp-ep-dp-pp", "gtp_remat": 2},
]


def rank_generator_cases() -> list[dict[str, Any]]:
    """The cases whose arguments the reference's constructor takes."""
    params = set(inspect.signature(mcore_ps.RankGenerator.__init__).parameters)
    return [case for case in RANK_GENERATOR_CASES if set(case) <= params]


def case_id(case: dict[str, Any]) -> str:
    """Short readable id of a RankGenerator case."""
    return ",".join(f"{k}={v}" for k, v in case.items())


def compare_rank_generator(compat_ps: Any, case: dict[str, Any]) -> list[str]:
    """Problems of compat's ``RankGenerator(**case)`` against the reference's (empty: equal).

    A repeated order token is a documented deliberate difference: compat refuses it with a
    ValueError ("repeats token") where MCore builds a wrong layout.
    """
    tokens = case["order"].lower().split("-")
    if len(set(tokens)) != len(tokens):
        mcore_ps.RankGenerator(**case)
        result, _ = D._call(lambda: compat_ps.RankGenerator(**case), {})
        if not (isinstance(result, ValueError) and "repeats token" in str(result)):
            return [f"RankGenerator({case_id(case)}): compat should refuse the repeated token, got {result!r}"]
        return []
    reference, _ = D._call(lambda: mcore_ps.RankGenerator(**case), {})
    attributes = [] if isinstance(reference, Exception) else sorted(vars(reference))
    axes = [] if isinstance(reference, Exception) else list(reference.name_to_size)
    results = []
    for ps in (mcore_ps, compat_ps):
        facts, _ = D._call(lambda: rank_generator_facts(ps, case, attributes, axes), {})
        results.append({"construction": D.raised(facts)} if isinstance(facts, Exception) else facts)
    if any("construction" in r for r in results):  # one side refused to construct: only that counts
        results = [{"construction": r.get("construction", "ok")} for r in results]
    diffs = D.compare(*results)
    return [f"RankGenerator({case_id(case)}): " + D.describe(diffs)] if diffs else []


# --------------------------------------------------------------------------- public helpers


def with_world(ps: Any, fn: Callable[[Any], Any], rank: int = 1, world: int = 8, cuda_stub: bool = False) -> dict:
    """Run ``fn(ps)`` in a fresh fake world; return its encoded result, created-group metadata
    and the module's ``_global_process_group_list`` (where the reference has it) afterwards.
    """
    D.fake_world(rank, world)
    D.forget_recorded_groups()
    enc = D._Encoder()
    with D.preserved_environment(), D.recording(cuda_stub=cuda_stub):
        result, warned = D._call(lambda: fn(ps), {})
        value = D.raised(result) if isinstance(result, Exception) else enc(result, "result")
        out = {"result": value, "warnings": warned, **D._group_metadata(enc)}
        snap = D.snapshot(ps, rank)
        out["global_list"] = snap.get("global:_global_process_group_list", D.ABSENT)
    ps.destroy_model_parallel()
    if ps is mcore_ps:
        D.reset_mcore()
    D.forget_recorded_groups()
    return out


def _timeout_then_update(ps):
    from datetime import timedelta

    ps.create_group([0, 1, 2], group_desc="X")
    return ps.update_pg_timeout(timedelta(minutes=3))


# name -> (call on a module, with_world options); the first function each calls is named by HELPER_FUNCTION.
HELPER_CASES: dict[str, tuple[Callable, dict]] = {
    "masked_groups_tp_dp": (
        lambda ps: ps.generate_masked_orthogonal_rank_groups(8, [2, 2, 2], [True, True, False]),
        {},
    ),
    "masked_groups_none": (
        lambda ps: ps.generate_masked_orthogonal_rank_groups(12, [2, 3, 2], [False, False, False]),
        {},
    ),
    "masked_groups_all": (lambda ps: ps.generate_masked_orthogonal_rank_groups(12, [2, 3, 2], [True, True, True]), {}),
    "masked_groups_middle": (
        lambda ps: ps.generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [False, True, False]),
        {},
    ),
    "masked_groups_small_world": (
        lambda ps: ps.generate_masked_orthogonal_rank_groups(4, [2, 2, 2], [True, False, False]),
        {},
    ),
    "masked_groups_big_world": (
        lambda ps: ps.generate_masked_orthogonal_rank_groups(16, [2, 2, 2], [True, False, False]),
        {},
    ),
    "default_embedding_1": (lambda ps: ps.default_embedding_ranks([5]), {}),
    "default_embedding_3": (lambda ps: ps.default_embedding_ranks([1, 3, 5]), {}),
    "default_embedding_empty": (lambda ps: ps.default_embedding_ranks([]), {}),
    "default_position_embedding_3": (lambda ps: ps.default_position_embedding_ranks([1, 3, 5]), {}),
    "default_position_embedding_empty": (lambda ps: ps.default_position_embedding_ranks([]), {}),
    "overwrite_cfgs_new": (lambda ps: (lambda d: (ps.overwrite_nccl_comm_cfgs(d, "tp", ("max_ctas", 4)), d))({}), {}),
    "overwrite_cfgs_existing": (
        lambda ps: (lambda d: (ps.overwrite_nccl_comm_cfgs(d, "tp", ("max_ctas", 4)), d))({"tp": {"min_ctas": 1}}),
        {},
    ),
    "nccl_options_absent": (lambda ps: ps.get_nccl_options("dp", {"tp": {}}), {}),
    "nccl_options_present": (lambda ps: ps.get_nccl_options("tp", {"tp": {"max_ctas": 2}}), {}),
    "nccl_options_none_cfg": (lambda ps: ps.get_nccl_options("tp", None), {}),
    "create_group_member": (lambda ps: ps.create_group([0, 1, 4], timeout=None, group_desc="MINE"), {}),
    "create_group_not_member": (lambda ps: ps.create_group([2, 3], group_desc="OTHER"), {}),
    "create_group_ranks_none": (lambda ps: ps.create_group(group_desc="ALL"), {}),
    "create_group_local_sync": (lambda ps: ps.create_group([1, 2], use_local_synchronization=True), {}),
    "hierarchical_member": (
        lambda ps: ps.create_hierarchical_groups(1, [0, 1, 2, 3, 4, 5, 6, 7], [2, 2, 2], group_desc="H"),
        {},
    ),
    "hierarchical_two_levels": (
        lambda ps: ps.create_hierarchical_groups(1, [7, 5, 3, 1], [2, 2], pg_options=[None, None]),
        {},
    ),
    "hierarchical_not_member": (lambda ps: ps.create_hierarchical_groups(1, [0, 2, 4, 6], [2, 2]), {}),
    "hierarchical_bad_sizes": (lambda ps: ps.create_hierarchical_groups(1, [0, 1, 2, 3], [2, 3]), {}),
    "hybrid_member_8": (lambda ps: ps.create_hybrid_dp_cp_groups(1, [0, 1, 2, 3, 4, 5, 6, 7], None), {}),
    "hybrid_member_6": (lambda ps: ps.create_hybrid_dp_cp_groups(1, [0, 2, 4, 1, 3, 5], None), {}),
    "hybrid_not_member": (lambda ps: ps.create_hybrid_dp_cp_groups(1, [0, 2, 4, 6], None), {}),
    "update_pg_timeout_cpu": (_timeout_then_update, {}),
    "update_pg_timeout_stubbed": (_timeout_then_update, {"cuda_stub": True}),
    # 0.12/0.13: the deprecated split rank of the default embedding callables
    "default_embedding_split_middle": (lambda ps: ps.default_embedding_ranks([1, 3, 5, 7], split_rank=2), {}),
    "default_embedding_split_first": (lambda ps: ps.default_embedding_ranks([1, 3, 5, 7], split_rank=0), {}),
    "default_embedding_split_last": (lambda ps: ps.default_embedding_ranks([1, 3, 5, 7], 3), {}),
    "default_embedding_split_negative": (lambda ps: ps.default_embedding_ranks([1, 3, 5, 7], split_rank=-2), {}),
    "default_embedding_split_beyond": (lambda ps: ps.default_embedding_ranks([1, 3, 5, 7], split_rank=4), {}),
    "default_embedding_split_one_stage": (lambda ps: ps.default_embedding_ranks([5], split_rank=3), {}),
    "default_embedding_split_none": (lambda ps: ps.default_embedding_ranks([1, 3], split_rank=None), {}),
    "default_position_embedding_split_middle": (
        lambda ps: ps.default_position_embedding_ranks([1, 3, 5, 7], split_rank=2),
        {},
    ),
    "default_position_embedding_split_first": (
        lambda ps: ps.default_position_embedding_ranks([1, 3, 5, 7], split_rank=0),
        {},
    ),
    "default_position_embedding_split_beyond": (
        lambda ps: ps.default_position_embedding_ranks([1, 3], split_rank=2),
        {},
    ),
    "default_position_embedding_split_one_stage": (
        lambda ps: ps.default_position_embedding_ranks([5], split_rank=0),
        {},
    ),
    # 0.12: hierarchical groups by index arithmetic (group_size, levels that fit; no einops)
    "hierarchical_parallel_member": (
        lambda ps: ps.create_hierarchical_parallel_groups(1, [0, 1, 2, 3, 4, 5, 6, 7], 8, [2, 2, 2], None),
        {},
    ),
    "hierarchical_parallel_two_levels": (
        lambda ps: ps.create_hierarchical_parallel_groups(1, [7, 5, 3, 1], 4, [2, 2], None),
        {},
    ),
    "hierarchical_parallel_one_level": (
        lambda ps: ps.create_hierarchical_parallel_groups(1, [0, 1, 2, 3], 4, [4], None),
        {},
    ),
    "hierarchical_parallel_not_member": (
        lambda ps: ps.create_hierarchical_parallel_groups(1, [0, 2, 4, 6], 4, [2, 2], None),
        {},
    ),
    "hierarchical_parallel_sizes_not_multiplying": (
        lambda ps: ps.create_hierarchical_parallel_groups(1, [0, 1, 2, 3], 4, [2, 3], None),
        {},
    ),
    "hierarchical_parallel_size_beyond_group": (
        lambda ps: ps.create_hierarchical_parallel_groups(1, [0, 1, 2, 3], 4, [8], None),
        {},
    ),
    "hierarchical_parallel_group_size_below_ranks": (
        lambda ps: ps.create_hierarchical_parallel_groups(1, [0, 1, 2, 3, 4, 5, 6, 7], 4, [2, 2], None),
        {},
    ),
}
# Cases that need a parameter some releases' function lacks: case -> parameter.
HELPER_CASE_PARAMETERS: dict[str, str] = {
    case: "split_rank"
    for case in HELPER_CASES
    if case.startswith(("default_embedding_split", "default_position_embedding_split"))
}


def helper_function(case: str) -> str:
    """The public function a helper case exercises (``create_group`` for the timeout update)."""
    prefixes = {
        "masked_groups": "generate_masked_orthogonal_rank_groups",
        "default_embedding": "default_embedding_ranks",
        "default_position_embedding": "default_position_embedding_ranks",
        "overwrite_cfgs": "overwrite_nccl_comm_cfgs",
        "nccl_options": "get_nccl_options",
        "create_group": "create_group",
        "hierarchical": "create_hierarchical_groups",
        "hierarchical_parallel": "create_hierarchical_parallel_groups",
        "hybrid": "create_hybrid_dp_cp_groups",
        "update_pg_timeout": "update_pg_timeout",
    }
    return next(fn for prefix, fn in sorted(prefixes.items(), key=lambda kv: -len(kv[0])) if case.startswith(prefix))


def helper_cases() -> list[str]:
    """The cases whose function (and the parameter the case needs) the reference has."""
    functions = D.reference_functions()
    out = []
    for case in sorted(HELPER_CASES):
        fn = functions.get(helper_function(case))
        needs = HELPER_CASE_PARAMETERS.get(case)
        if fn is not None and (needs is None or needs in inspect.signature(fn).parameters):
            out.append(case)
    return out


def compare_helper(compat_ps: Any, case: str) -> list[str]:
    """Problems of a public helper of compat against the reference's (values, groups, global list)."""
    fn, options = HELPER_CASES[case]
    ref = with_world(mcore_ps, fn, **options)
    got = with_world(compat_ps, fn, **options)
    problems = []
    if case == "hierarchical_bad_sizes":
        # MCore's error comes from einops (EinopsError, a RuntimeError); compat does not use
        # einops, so it raises the builtin base type that EinopsError extends.
        if not (ref["result"][:2] == ("raises", "EinopsError") and "RuntimeError" in ref["result"][2]):
            problems.append(f"{case}: MCore was expected to raise EinopsError, got {ref['result']}")
        if got["result"][:2] != ("raises", "RuntimeError"):
            problems.append(f"{case}: compat should raise RuntimeError, got {got['result']}")
        ref, got = {k: v for k, v in ref.items() if k != "result"}, {k: v for k, v in got.items() if k != "result"}
    diffs = D.compare(ref, got)
    if diffs:
        problems.append(f"{case}: " + D.describe(diffs))
    return problems
