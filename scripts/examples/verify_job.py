"""A job's start-up check: are the process groups it holds the ones Megatron-Core builds?

``python -m scripts.examples verify_job`` starts a gloo world of CPU processes
(:func:`scripts.harness.worlds.open_world`, a ``GlooWorld``) and checks two sources of groups with
:func:`parallel_state_ng.verify_groups` against the stated configuration:

1. compat's groups after ``initialize_model_parallel`` (``compat.verify_groups``): they match.
2. A ``ProcessGroupCollection`` assembled the way hand-written bridges assemble one: it leaves
   the context-parallel group unset and takes the whole world for the model-parallel group.
   Every rank learns that the check failed; rank 0 prints the report.

Options: ``--world-size`` (default 4), ``--tp`` (default 2), ``--pp`` (default 1). The world
size must be a multiple of tp x pp. See docs/guides/regression-testing.md.
"""

from __future__ import annotations

import argparse
from typing import Any


def check_rank(config: dict[str, int]) -> dict[str, Any]:
    """One rank: compat's groups, then a hand-assembled collection, each checked against ``config``."""
    import torch.distributed as dist

    import compat
    from compat import parallel_state as ps
    from parallel_state_ng import verify_groups

    ps.initialize_model_parallel(**config)
    try:
        served = compat.verify_groups(**config)
        by_hand = {
            "tp": ps.get_tensor_model_parallel_group(),
            "pp": ps.get_pipeline_model_parallel_group(),
            "dp": ps.get_data_parallel_group(),
            "cp": None,  # the bridge had no context-parallel group to copy
            "mp": dist.group.WORLD,  # and fell back to the world for the model-parallel one
        }
        bridged = verify_groups(by_hand, fields=list(by_hand), **config)  # the fields it set
    finally:
        ps.destroy_model_parallel()
    return {
        "served_ok": served.ok,
        "bridged_ok": bridged.ok,
        "traps": sorted(bridged.traps()),
        "report": bridged.render() if dist.get_rank() == 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the check on a fresh gloo world; print what every rank learnt and rank 0's report."""
    parser = argparse.ArgumentParser(prog="python -m scripts.examples verify_job", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4, help="number of CPU processes (default 4)")
    parser.add_argument("--tp", type=int, default=2, help="tensor_model_parallel_size (default 2)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size (default 1)")
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.tp < 1 or args.pp < 1 or args.world_size % (args.tp * args.pp):
        parser.error(f"--world-size {args.world_size} must be a positive multiple of --tp {args.tp} x --pp {args.pp}")
    config = {"tensor_model_parallel_size": args.tp, "pipeline_model_parallel_size": args.pp}

    from scripts.harness.worlds import open_world

    with open_world(args.world_size) as world:
        results = world.run(check_rank, config, timeout=300)
    print(f"compat's groups match MCore's layout on every rank: {all(r['served_ok'] for r in results)}")
    print(f"the hand-assembled collection matches on no rank: {not any(r['bridged_ok'] for r in results)}")
    print(f"traps found (rank 0): {', '.join(results[0]['traps'])}")
    print(results[0]["report"])
    return 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("examples", "verify_job")
