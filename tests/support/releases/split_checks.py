"""The split path's protocol against one megatron-core release (run in a process bound to it).

:func:`run` plays every rank of each configuration the release takes (:data:`CONFIGS`, filtered
by the parameters of the ``initialize_model_parallel`` compat serves) through compat's
``initialize_model_parallel`` (and ``create_all_gather_groups`` where the release has it) on the
split and the member path (:mod:`tests.support.worlds.split_recorder`) and returns the totals.
"""

from __future__ import annotations

import inspect
import time
import traceback
from typing import Any

# (world, initialize_model_parallel kwargs, all-gather groups after init where the release has
# create_all_gather_groups). A configuration runs where compat's initialize_model_parallel takes
# every kwarg: 0.12/0.13 encoder blocks (one pipeline per rank), 0.16/0.17 create_all_gather_group,
# 0.17+ rank_offset/local_world_size, 0.19 gtp_remat_size.
_TP2_PP2 = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}
CONFIGS: list[tuple[int, dict[str, Any], bool]] = [
    (8, dict(_TP2_PP2), True),
    (16, {**_TP2_PP2, "context_parallel_size": 2}, False),
    (16, {"tensor_model_parallel_size": 2, "context_parallel_size": 2, "expert_model_parallel_size": 2}, True),
    (16, {"context_parallel_size": 4, "hierarchical_context_parallel_sizes": [2, 2]}, False),
    (16, {"tensor_model_parallel_size": 2, "num_distributed_optimizer_instances": 2, "order": "tp-cp-ep-pp-dp"}, True),
    (32, {"pipeline_model_parallel_size": 4, "expert_model_parallel_size": 4, "expert_tensor_parallel_size": 2}, True),
    (16, {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 4, "expert_tensor_parallel_size": 1}, True),
    (24, {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 3, "order": "tp-pp-dp"}, False),
    (12, {"tensor_model_parallel_size": 2, "context_parallel_size": 2, "order": "cp-tp-ep-dp-pp"}, False),
    (
        64,
        {
            **_TP2_PP2,
            "virtual_pipeline_model_parallel_size": 2,
            "context_parallel_size": 2,
            "expert_model_parallel_size": 2,
            "expert_tensor_parallel_size": 1,
        },
        True,
    ),
    (
        32,
        {
            "tensor_model_parallel_size": 2,
            "context_parallel_size": 4,
            "hierarchical_context_parallel_sizes": [2, 2],
            "num_distributed_optimizer_instances": 2,
        },
        False,
    ),
    (16, {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2, "create_all_gather_group": True}, False),
    (
        64,
        {"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 4},
        True,
    ),
    (
        48,
        {**_TP2_PP2, "context_parallel_size": 2, "num_distributed_optimizer_instances": 3, "order": "tp-ep-cp-dp-pp"},
        False,
    ),
    # 0.17+: a sub-world. With create_all_gather_groups (0.18+) a rank outside it raises, as MCore's
    # does, after joining the splits the ranks inside make. MCore lays the all-gather groups out
    # from rank 0: with an offset that is not a multiple of their size they hold ranks outside the
    # sub-world, which never create them (a hang in MCore too), so offset 5 runs without them.
    (16, {"local_world_size": 8, "rank_offset": 8, "tensor_model_parallel_size": 2}, True),
    (16, {"local_world_size": 8, "rank_offset": 5, **_TP2_PP2}, False),
    (12, {"local_world_size": 4, "rank_offset": 6, "tensor_model_parallel_size": 2, "context_parallel_size": 2}, False),
    (32, {"local_world_size": 16, "rank_offset": 8, "expert_model_parallel_size": 2}, False),
    # 0.19: GTP
    (8, {"gtp_remat_size": 2}, False),
    (16, {"gtp_remat_size": 2, "expert_gtp_remat_size": 2, "expert_model_parallel_size": 2}, True),
    (
        32,
        {
            "tensor_model_parallel_size": 2,
            "gtp_remat_size": 2,
            "context_parallel_size": 2,
            "expert_model_parallel_size": 4,
            "expert_tensor_parallel_size": 1,
            "expert_gtp_remat_size": 2,
        },
        False,
    ),
    (
        16,
        {"gtp_remat_size": 4, "expert_gtp_remat_size": 2, "expert_model_parallel_size": 2, "order": "tp-cp-ep-pp-dp"},
        False,
    ),
    # 0.12/0.13: an encoder block whose tp equals the decoder's (each rank in one pipeline)
    (12, {**_TP2_PP2, "encoder_tensor_model_parallel_size": 2, "encoder_pipeline_model_parallel_size": 1}, False),
    (
        6,
        {
            "pipeline_model_parallel_size": 2,
            "encoder_tensor_model_parallel_size": 1,
            "encoder_pipeline_model_parallel_size": 1,
        },
        False,
    ),
    (16, {**_TP2_PP2, "encoder_tensor_model_parallel_size": 2, "encoder_pipeline_model_parallel_size": 2}, False),
    (8, {"tensor_model_parallel_size": 2, "encoder_pipeline_model_parallel_size": 1}, False),
]


def _ranks(group: Any) -> list[int] | None:
    import torch.distributed as dist

    return None if group is None else dist.get_process_group_ranks(group)


def _build(ps: Any, kwargs: dict[str, Any], all_gather: bool):
    """One rank's build: compat's init (then the all-gather groups); its groups, or the error."""

    def build() -> Any:
        try:
            ps.initialize_model_parallel(create_gloo_process_groups=False, **kwargs)
        except Exception as exc:  # both paths must refuse alike
            return f"{type(exc).__name__}: {exc}"
        try:
            out = {kind: list(ranks) for kind, ranks in ps.get_state().ranks.items()}
            if all_gather:
                try:
                    dp_cp_ag, ep_dp_ag = ps.create_all_gather_groups(for_expert_parallelism=True)
                    out["all_gather"] = [_ranks(dp_cp_ag), _ranks(ep_dp_ag)]
                except (RuntimeError, ValueError) as exc:  # as MCore: not initialized; GTP beyond the world
                    out["all_gather"] = f"{type(exc).__name__}: {exc}"
            return out
        finally:
            ps.destroy_model_parallel()

    return build


def run(part: int = 0, parts: int = 1) -> dict[str, Any]:
    """Every rank of every configuration the release takes, on both paths; the totals and problems.

    ``part`` of ``parts``: every ``parts``-th configuration of :data:`CONFIGS` from the
    ``part``-th (tests/support/rotation.py rotates the part by the day).

    Returns ``configs``, ``ranks`` (ranks played, each on both paths), ``splits`` (split calls
    recorded over all ranks), ``mismatches`` (configurations whose protocol check failed, plus
    ranks whose groups differ between the paths), ``problems`` (one line each), ``seconds``.
    """
    import compat.parallel_state as ps
    from tests.support.worlds.split_recorder import check_protocol, compare_paths, play_world

    start = time.perf_counter()
    params = set(inspect.signature(ps.initialize_model_parallel).parameters)
    has_all_gather = hasattr(ps, "create_all_gather_groups")
    totals = {"release": str(ps.MEGATRON_VERSION), "configs": 0, "ranks": 0, "splits": 0, "mismatches": 0}
    problems: list[str] = []
    for world, kwargs, all_gather in CONFIGS[part::parts]:
        if not set(kwargs) <= params:
            continue
        what = f"world {world} {kwargs}" + (" + create_all_gather_groups" if all_gather and has_all_gather else "")
        calls, results = play_world(world, _build(ps, kwargs, all_gather and has_all_gather))
        totals["configs"] += 1
        totals["ranks"] += world
        totals["splits"] += sum(len(c) for c in calls.values())
        refused = [r for r in range(world) if isinstance(results[r]["split"], str)]
        if refused:
            problems.append(
                f"{what}: refused on {len(refused)} ranks, rank {refused[0]}: {results[refused[0]]['split']}"
            )
        try:
            check_protocol(calls, world)
        except AssertionError:
            totals["mismatches"] += 1
            problems.append(f"{what}: {traceback.format_exc(limit=0).strip()[-600:]}")
        differ = compare_paths(results)
        totals["mismatches"] += len(differ)
        problems += [f"{what}: {line[:600]}" for line in differ[:3]]
    totals["seconds"] = round(time.perf_counter() - start, 2)
    return {**totals, "problems": problems}
