"""Checks of :mod:`parallel_state_ng.builders.megatron_setup` against one megatron-core release.

:func:`source_facts` reads the release's sources with ``ast`` (no import: 0.19 needs triton to
import its schedules) and returns what :mod:`parallel_state_ng.releases.new_code_path` states
about it. :func:`run` (in a process bound to the release, fake backend) compares the schedule,
the communicator's neighbours and ``ensure_global_memory_buffer`` with MCore's own.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any


def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    out: dict[str, ast.FunctionDef] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out[f"{node.name}.{item.name}"] = item
    return out


def _params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.args + fn.args.kwonlyargs if a.arg != "self"]


def source_facts(root: str, module_globals: list[str]) -> dict[str, Any]:
    """What the release at ``root`` (its ``megatron/core``) says about the facts the data states.

    ``module_globals`` are the release's parallel_state state globals; for each function the
    globals its body names and the plain names it calls are listed (a grid-free function may
    name only buffers/trackers).
    """
    core = Path(root)
    schedules = _functions(core / "pipeline_parallel" / "schedules.py")
    p2p = _functions(core / "pipeline_parallel" / "p2p_communication.py")
    state = _functions(core / "parallel_state.py")
    names_used = {}
    for name, fn in state.items():
        used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in module_globals}
        calls = {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        names_used[name] = {"globals": sorted(used), "calls": sorted(calls)}
    return {
        "get_forward_backward_func": _params(schedules["get_forward_backward_func"]),
        "schedule_params": {
            name: _params(fn) for name, fn in schedules.items() if name.startswith("forward_backward_")
        },
        "p2p_init": _params(p2p["P2PCommunicator.__init__"]) if "P2PCommunicator.__init__" in p2p else None,
        "globals_used": names_used,
    }


def run() -> dict[str, Any]:
    """Schedule and buffer checks on the fake backend; returns the cases and any mismatch.

    ``megatron_schedule(build_megatron_groups(...), config)`` against the schedule MCore's own
    ``get_forward_backward_func()`` picks after ``initialize_model_parallel`` with the same
    sizes, the communicator's neighbours against ``P2PCommunicator`` over MCore's pipeline
    group, and ``ensure_global_memory_buffer`` against MCore's own buffer.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from parallel_state_ng import build_megatron_groups, ensure_global_memory_buffer, megatron_schedule
    from parallel_state_ng.testing.worlds import init_simulated_rank

    problems: list[str] = []
    cases = 0
    for world, pp, vp, rank in [(4, 1, None, 3), (8, 2, None, 5), (8, 2, 2, 6), (8, 4, 2, 7), (8, 4, None, 2)]:
        init_simulated_rank(rank, world, replace=True)
        mps.initialize_model_parallel(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
            create_gloo_process_groups=False,
        )
        extra = {"pipeline_dtype": torch.float32} if pp > 1 else {}
        config = ModelParallelConfig(
            tensor_model_parallel_size=2,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp,
            **extra,
        )
        reference = schedules.get_forward_backward_func()
        ref_p2p = P2PCommunicator(pp_group=mps.get_pipeline_model_parallel_group(), config=config)
        mps.destroy_model_parallel()
        groups = build_megatron_groups(tensor_model_parallel_size=2, pipeline_model_parallel_size=pp)
        ours = megatron_schedule(groups, config)
        what = f"world {world} pp {pp} vp {vp} rank {rank}"
        if ours.forward_backward_func is not reference:
            problems.append(f"{what}: {ours.forward_backward_func.__name__} != {reference.__name__}")
        comm = ours.kwargs.get("p2p_communicator")
        if comm is not None and (comm.next_rank, comm.prev_rank) != (ref_p2p.next_rank, ref_p2p.prev_rank):
            got, want = (comm.next_rank, comm.prev_rank), (ref_p2p.next_rank, ref_p2p.prev_rank)
            problems.append(f"{what}: pipeline neighbours {got} != MCore's {want}")
        if dist.get_process_group_ranks(ours.kwargs["pg_collection"].pp) != groups.ranks("pp"):
            problems.append(f"{what}: pg_collection.pp is not the module's pp group")
        groups.destroy()
        cases += 1
    init_simulated_rank(0, 2, replace=True)
    if mps._GLOBAL_MEMORY_BUFFER is not None:
        problems.append("MCore's global memory buffer survived destroy_model_parallel")
    buffer = ensure_global_memory_buffer()
    if buffer is not mps.get_global_memory_buffer() or ensure_global_memory_buffer() is not buffer:
        problems.append("ensure_global_memory_buffer is not MCore's buffer, or not idempotent")
    mps.destroy_global_memory_buffer()
    dist.destroy_process_group()
    return {"cases": cases, "problems": problems}
