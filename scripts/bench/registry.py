"""Communicators per rank for a training and an inference layout in one process, registry on and off.

One rank of a fake-backend world (65,536 ranks by default) builds the training layout (tp 8 ×
pp 4 with ``build_megatron_groups``) and then an inference layout (tp 8 × pp 1), once as a
second ``build_megatron_groups`` and once as Megatron 0.19's inference collection
(:func:`parallel_state_ng.builders.inference.build_inference_collection`), under each sharing
setting: ``off`` (Megatron-Core's behaviour), ``1`` (within each build) and ``process`` (the
communicator registry). Prints the communicators the rank creates (``new_group`` calls) and
checks that destroying the inference layout leaves every training group alive. A benchmark,
not a test: figures and command in docs/results/performance.md (Several layouts in one process).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel_state_ng import build_megatron_groups
from parallel_state_ng.builders.inference import build_inference_collection, destroy_inference_collection
from parallel_state_ng.groups import registry, sharing

MODES = ("off", "build", "process")


def _fake_world(rank: int, world: int) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()  # and with it every group of the previous run
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


class _Counter:
    """Counts ``torch.distributed.new_group`` calls: one per communicator the rank creates."""

    def __enter__(self) -> _Counter:
        self.calls = 0
        self._original = dist.new_group

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return self._original(*args, **kwargs)

        dist.new_group = counting  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        dist.new_group = self._original  # type: ignore[assignment]


def _inference_builders(world: int, tp: int, pp: int) -> dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]]:
    """How the inference layout is built and destroyed, by name."""
    return {
        "build_megatron_groups": (
            lambda: build_megatron_groups(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
            lambda built: built.destroy(),
        ),
        "inference collection": (
            lambda: build_inference_collection(world, tp, pp, 1, 1, tp),
            destroy_inference_collection,
        ),
        # the training layout's timeout (build_megatron_groups' default 30 minutes): shareable
        "inference collection, timeout=30 min": (
            lambda: build_inference_collection(world, tp, pp, 1, 1, tp, timeout=timedelta(minutes=30)),
            destroy_inference_collection,
        ),
    }


def measure(rank: int, world: int, train: tuple[int, int], infer: tuple[int, int]) -> list[dict[str, Any]]:
    """One row per (inference builder, sharing mode): communicators created on ``rank``."""
    rows = []
    for name, (build, destroy) in _inference_builders(world, *infer).items():
        for mode in MODES:
            _fake_world(rank, world)
            previous = sharing.set_group_sharing(mode)
            try:
                with _Counter() as training:
                    trained = build_megatron_groups(
                        tensor_model_parallel_size=train[0], pipeline_model_parallel_size=train[1]
                    )
                with _Counter() as inference:
                    inferred = build()
                destroy(inferred)  # the training layout's groups must survive it
                alive = all(g in dist.distributed_c10d._world.pg_map for g in trained.state.created)
                trained.destroy()
                rows.append(
                    {
                        "inference": name,
                        "mode": mode,
                        "training": training.calls,
                        "inference_new": inference.calls,
                        "total": training.calls + inference.calls,
                        "training_alive": alive,
                        "registry_empty": not registry.entries(),
                    }
                )
            finally:
                sharing.set_group_sharing(previous)
    return rows


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, measure ranks 0 and the last, print the table; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=65536, help="simulated world size (a multiple of 32)")
    p.add_argument("--train", default="8,4", help="training tp,pp (default 8,4)")
    p.add_argument("--infer", default="8,1", help="inference tp,pp (default 8,1)")
    args = p.parse_args(argv)
    train = tuple(int(x) for x in args.train.split(","))
    infer = tuple(int(x) for x in args.infer.split(","))
    if len(train) != 2 or len(infer) != 2:
        p.error(f"--train and --infer take tp,pp; got --train {args.train!r} --infer {args.infer!r}")
    print(
        f"world {args.world}: training tp={train[0]} pp={train[1]}, then inference tp={infer[0]} pp={infer[1]}; "
        "communicators created on the rank (new_group calls)"
    )
    header = f"{'rank':>6}  {'inference built by':<36} {'PSNG_SHARE_GROUPS':<17} {'training':>8} {'inference':>9}"
    print(f"{header} {'total':>6}")
    ok = True
    for rank in (0, args.world - 1):
        for row in measure(rank, args.world, train, infer):  # type: ignore[arg-type]
            setting = {"off": "0 (off)", "build": "1", "process": "process"}[row["mode"]]
            print(
                f"{rank:>6}  {row['inference']:<36} {setting:<17} {row['training']:>8} "
                f"{row['inference_new']:>9} {row['total']:>6}"
            )
            ok = ok and row["training_alive"] and row["registry_empty"]
    print(f"destroying the inference layout left every training group alive, registry empty after both: {ok}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("bench", "registry")
