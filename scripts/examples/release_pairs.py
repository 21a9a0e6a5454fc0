"""Which group kinds change between megatron-core releases, for a few 8-rank configurations.

For each configuration of :data:`CONFIGS` and each pair of releases, runs
``python -m parallel_state_ng layout ... --diff --release A --against B --format json`` (in this
process) and prints a table: one row per release step (adjacent releases; ``--all-pairs``: every
pair), one column per configuration, each cell the kinds that appear (``+``), vanish (``-``) or
change (``~``, with what changes: groups, timeout, desc, gloo) and the change of communicators per
rank. ``tests/releases/test_layout_diff_releases.py`` checks every pair's claim against the two
releases' own ``initialize_model_parallel``. The table: docs/tools.md (release pairs).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
from collections.abc import Sequence
from typing import Any

from parallel_state_ng.__main__ import main as cli_main
from parallel_state_ng.releases import SUPPORTED_SERIES

#: Configuration name -> ``initialize_model_parallel`` arguments (MCore's names), 8 ranks each.
CONFIGS: dict[str, dict[str, Any]] = {
    "dense tp2 pp2 dp2": {"world_size": 8, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    "MoE tp2 pp2 ep2 etp1": {
        "world_size": 8,
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "expert_model_parallel_size": 2,
        "expert_tensor_parallel_size": 1,
    },
    "tp2 cp2 hcp 1,2": {
        "world_size": 8,
        "tensor_model_parallel_size": 2,
        "context_parallel_size": 2,
        "hierarchical_context_parallel_sizes": [1, 2],
    },
    "tp2 dp4, 2 optimizer instances": {
        "world_size": 8,
        "tensor_model_parallel_size": 2,
        "num_distributed_optimizer_instances": 2,
    },
    "tp2 pp2, order tp-cp-ep-pp-dp": {
        "world_size": 8,
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "order": "tp-cp-ep-pp-dp",
    },
}

# MCore's argument -> the layout command's option.
_OPTIONS = {
    "world_size": "--world-size",
    "tensor_model_parallel_size": "--tp",
    "pipeline_model_parallel_size": "--pp",
    "context_parallel_size": "--cp",
    "expert_model_parallel_size": "--ep",
    "expert_tensor_parallel_size": "--etp",
    "order": "--order",
    "num_distributed_optimizer_instances": "--num-dist-opt-instances",
    "hierarchical_context_parallel_sizes": "--hcp-sizes",
}


def cli_options(config: dict[str, Any]) -> list[str]:
    """The layout command's options for ``config``."""
    out: list[str] = []
    for name, value in config.items():
        out += [_OPTIONS[name], ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    return out


def claimed_diff(config: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """What ``layout --diff --release OLD --against NEW --format json`` says for ``config``."""
    argv = ["layout", *cli_options(config), "--diff", "--release", old, "--against", new, "--format", "json"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(argv)
    if code not in (0, 1):
        raise RuntimeError(f"{' '.join(argv)} exited {code}")
    return json.loads(out.getvalue())


def cell(diff: dict[str, Any]) -> str:
    """A table cell: the kinds that appear / vanish / change, and the communicators per rank."""
    parts = []
    for kind, change in diff["kinds"].items():
        if change["status"] == "added":
            parts.append(f"+{kind}")
        elif change["status"] == "removed":
            parts.append(f"-{kind}")
        else:
            what = [w for w in ("groups_removed", "timeout", "desc", "gloo") if w in change]
            parts.append(f"~{kind}({','.join('groups' if w == 'groups_removed' else w for w in what)})")
    comms = diff["communicators"]
    if comms["ranks_changed"]:
        parts.append(f"comms {_span(comms['old'])}->{_span(comms['new'])}")
    return " ".join(parts) or "="


def _span(counts: dict[str, int]) -> str:
    return str(counts["min"]) if counts["min"] == counts["max"] else f"{counts['min']}-{counts['max']}"


def pairs(all_pairs: bool) -> list[tuple[str, str]]:
    """The release pairs of the table: adjacent ones, or every pair."""
    if all_pairs:
        return list(itertools.combinations(SUPPORTED_SERIES, 2))
    return list(itertools.pairwise(SUPPORTED_SERIES))


def table(all_pairs: bool = False) -> list[str]:
    """The table's lines (markdown)."""
    lines = [
        "| releases | " + " | ".join(CONFIGS) + " |",
        "|---|" + "---|" * len(CONFIGS),
    ]
    for old, new in pairs(all_pairs):
        cells = [cell(claimed_diff(config, old, new)) for config in CONFIGS.values()]
        lines.append(f"| {old} -> {new} | " + " | ".join(cells) + " |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Print the release-pair table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-pairs", action="store_true", help="every pair of releases, not only adjacent ones")
    args = parser.parse_args(argv)
    print("\n".join(table(args.all_pairs)))
    return 0


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("examples", "release_pairs")
