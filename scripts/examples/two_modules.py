"""Two modules with their own parallelism, wired by Megatron's own bridge, from our topology or by hand.

An encoder-like module feeds a language-like one through Megatron 0.19's ``BridgeCommunicator``
(``--layout separate``) or ``ColocatedBridgeCommunicator`` (``--layout colocated``); the run is done
twice in the same processes, grids from :func:`parallel_state_ng.build_topology` and from
Megatron's ``HyperCommGrid`` assembled by hand, and must be identical (exit code 1 if not).
Layouts, shims and results: docs/results/training.md (two modules wired by Megatron's communicators).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

HIDDEN, VOCAB, SEQ, BATCH = 8, 16, 4, 4  # BATCH: samples per encoder data-parallel rank and step
LAYOUTS = {
    "separate": {"world": 6, "encoder": (range(0, 2), 1), "language": (range(2, 6), 2)},
    "colocated": {"world": 4, "encoder": (range(0, 4), 1), "language": (range(0, 4), 2)},
}


# --------------------------------------------------------------------------- megatron pieces
def _load_megatron(path: str | None) -> dict[str, Any]:
    """Megatron's HyperCommGrid and both bridge communicators, loaded by file, so that
    ``megatron/core/__init__`` (which imports triton from 0.18 on) does not run.
    """
    from parallel_state_ng.testing.megatron_cpu import use_megatron_path

    use_megatron_path(path, env=None)
    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("megatron-core not found: pass --megatron-path DIR (an unzipped 0.19 wheel)")
    root = os.path.join(list(spec.submodule_search_locations)[0], "core")
    for name, where in (("megatron", os.path.dirname(root)), ("megatron.core", root)):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [where]
            sys.modules[name] = package
    out = {}
    for key, rel in (
        ("grid", "hyper_comm_grid.py"),
        ("bridge", "pipeline_parallel/bridge_communicator.py"),
        ("colocated", "models/mimo/comm/colocated_communicator.py"),
    ):
        file = os.path.join(root, rel)
        if not os.path.isfile(file):
            raise SystemExit(f"{file} is missing: this needs megatron-core 0.19 or later")
        name = "megatron.core.hyper_comm_grid" if key == "grid" else f"_psng_{key}"
        module_spec = importlib.util.spec_from_file_location(name, file)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
        out[key] = module
    return out


class _cpu_shims:
    """``backend='nccl'`` -> gloo for the communicators' groups; ``torch.cuda.current_device()`` -> CPU."""

    def __enter__(self) -> _cpu_shims:
        import torch
        import torch.distributed as dist

        self.saved = (dist.new_group, dist.new_subgroups_by_enumeration, torch.cuda.current_device)
        new_group, subgroups, _ = self.saved

        def gloo(kwargs: dict[str, Any]) -> dict[str, Any]:
            return {**kwargs, "backend": None} if kwargs.get("backend") == "nccl" else kwargs

        dist.new_group = lambda *a, **k: new_group(*a, **gloo(k))  # type: ignore[assignment]
        dist.new_subgroups_by_enumeration = lambda *a, **k: subgroups(*a, **gloo(k))  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        import torch
        import torch.distributed as dist

        dist.new_group, dist.new_subgroups_by_enumeration, torch.cuda.current_device = self.saved  # type: ignore[assignment]


# --------------------------------------------------------------------------- the two module setups
def _ours(layout: str) -> tuple[dict[str, Any], dict[str, Any], Any]:
    from parallel_state_ng import ModuleSpec, build_topology

    spec = LAYOUTS[layout]
    (enc_ranks, enc_tp), (lm_ranks, lm_tp) = spec["encoder"], spec["language"]
    topo = build_topology(
        [
            ModuleSpec("encoder", enc_ranks, tensor_model_parallel_size=enc_tp),
            ModuleSpec("language", lm_ranks, tensor_model_parallel_size=lm_tp, language=True),
        ]
    )
    groups = {
        name: {"tp": topo.groups(name).group("tp"), "dp": topo.groups(name).group("dp")}
        if name in topo.modules_of_rank
        else None
        for name in ("encoder", "language")
    }
    return topo.module_to_grid_map(), groups, topo.destroy


def _megatron(layout: str, mods: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    import torch.distributed as dist

    spec, rank = LAYOUTS[layout], dist.get_rank()
    grids, groups = {}, {}
    for name in ("encoder", "language"):
        ranks, tp = spec[name]
        grid = mods["grid"].HyperCommGrid(
            [tp, 1, len(ranks) // tp, 1], ["tp", "cp", "dp", "pp"], rank_offset=ranks.start
        )
        made = {
            "-".join(d): grid.create_pg(list(d)) for d in (["tp"], ["cp"], ["dp"], ["pp"], ["cp", "dp"], ["tp", "pp"])
        }
        grids[name] = grid
        groups[name] = {"tp": made["tp"], "dp": made["dp"]} if rank in ranks else None

    def destroy() -> None:
        for grid in grids.values():
            grid.destroy()

    return grids, groups, destroy


# --------------------------------------------------------------------------- one run
class _ReduceGradOverTp:
    """Identity forward; the gradient is summed over the tensor-parallel group (a column-parallel input)."""

    @staticmethod
    def apply(x: Any, group: Any) -> Any:
        import torch
        import torch.distributed as dist

        class Fn(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, t: Any) -> Any:
                return t.view_as(t)

            @staticmethod
            def backward(ctx: Any, g: Any) -> Any:
                g = g.clone()
                dist.all_reduce(g, group=group)
                return g

        return Fn.apply(x)


def _digest(*tensors: Any) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _run(layout: str, grids: dict[str, Any], groups: dict[str, Any], mods: dict[str, Any], steps: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    enc_w = torch.randn(HIDDEN, HIDDEN) * 0.3
    lm_w_full = torch.randn(HIDDEN, VOCAB) * 0.3
    enc, lm = groups["encoder"], groups["language"]
    out: dict[str, Any] = {"losses": [], "received": [], "encoder": None, "language": None}
    if lm is not None:
        tp_rank, tp_size = dist.get_rank(lm["tp"]), dist.get_world_size(lm["tp"])
        lm_w = lm_w_full.chunk(tp_size, dim=1)[tp_rank].clone().requires_grad_()
    if enc is not None:
        enc_w = enc_w.clone().requires_grad_()
        enc_dp = dist.get_rank(enc["dp"])
    if layout == "separate":
        comm = mods["bridge"].BridgeCommunicator(grids["encoder"], grids["language"], comm_dtype=torch.float32)
    else:
        comm = mods["colocated"].ColocatedBridgeCommunicator(grids["encoder"], grids["language"], "encoder", "language")
    try:
        for step in range(steps):
            act = None
            if enc is not None:
                g = torch.Generator().manual_seed(1000 * step + enc_dp)
                x = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
                act = torch.tanh(x @ enc_w)
            if layout == "separate":
                if enc is not None:
                    comm.send_forward(act.detach())
                    act.backward(comm.recv_backward())
                else:
                    received = comm.recv_forward().detach().requires_grad_()
                    _lm_step(received, lm, lm_w, out)
                    comm.send_backward(received.grad)
            else:
                received = comm.communicate(act)
                _lm_step(received, lm, lm_w, out)
            if enc is not None:
                dist.all_reduce(enc_w.grad, group=enc["dp"])
                with torch.no_grad():
                    enc_w -= 0.1 * enc_w.grad / dist.get_world_size(enc["dp"])
                enc_w.grad = None
        if enc is not None:
            out["encoder"] = _digest(enc_w)
        if lm is not None:
            out["language"] = _digest(lm_w)
    finally:
        if layout == "separate":
            mods["bridge"].BridgeCommunicator.destroy_broadcast_pgs()
            mods["bridge"].BridgeCommunicator.destroy_bridge_pgs()
        else:
            comm.destroy()
    return out


def _lm_step(received: Any, lm: dict[str, Any], lm_w: Any, out: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    out["received"].append(_digest(received))
    logits = _ReduceGradOverTp.apply(received, lm["tp"]) @ lm_w
    local = logits.pow(2).mean()
    local.backward()
    loss = local.detach().clone()
    dist.all_reduce(loss, group=lm["tp"])
    dist.all_reduce(loss, group=lm["dp"])
    out["losses"].append(round(float(loss) / dist.get_world_size(lm["dp"]), 6))
    with torch.no_grad():
        dist.all_reduce(lm_w.grad, group=lm["dp"])
        lm_w -= 0.1 * lm_w.grad / dist.get_world_size(lm["dp"])
    lm_w.grad = None


def rank_main(layout: str, megatron_path: str | None, steps: int) -> dict[str, Any]:
    """One rank of the gloo world: both runs (ours, then Megatron's grids); their results."""
    mods = _load_megatron(megatron_path)
    result = {}
    with _cpu_shims():
        for how in ("ours", "megatron"):
            grids, groups, destroy = _ours(layout) if how == "ours" else _megatron(layout, mods)
            try:
                result[how] = _run(layout, grids, groups, mods, steps)
            finally:
                destroy()
    return result


def launch(layout: str, megatron_path: str | None, steps: int, timeout: float = 300) -> list[dict]:
    """Run both variants on a fresh gloo world of new processes (:mod:`scripts.harness.worlds`);
    results ordered by rank (a ``RuntimeError`` naming the ranks on failure).
    """
    from scripts.harness.worlds import run_on_world

    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # the caller's, else 1
    return run_on_world(LAYOUTS[layout]["world"], rank_main, layout, megatron_path, steps, timeout=timeout, env=threads)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, run both variants and print per-rank results; 0 when they are identical."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="separate")
    p.add_argument("--megatron-path", default=None, help="directory with megatron/ (an unzipped 0.19+ wheel)")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    results = launch(args.layout, args.megatron_path, args.steps)
    same = True
    for rank, result in enumerate(results):
        ours, theirs = result["ours"], result["megatron"]
        same = same and ours == theirs
        print(f"rank {rank}: ours {ours}")
        print(f"        megatron grids {'identical' if ours == theirs else theirs}")
    print("identical" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("examples", "two_modules")
