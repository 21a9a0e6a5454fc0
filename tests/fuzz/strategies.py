"""Generators of the fuzz harness: valid, mutated and hostile values per input format.

Each strategy draws from three families: *valid* (what the tools write: snapshots of small
layouts, specs of contiguous modules), *mutated* (a valid document with one node replaced by a
hostile JSON value, or its text cut short) and *hostile* (deep nesting, huge numbers, NaN,
binary junk, duplicate keys). Budget: :data:`FUZZ`, from ``$PSNG_FUZZ_EXAMPLES`` (docs/testing.md).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.snapshot import dumps_snapshot, snapshot_of

#: Examples per fuzz test: small in CI (derandomized: the same cases every run), more on request.
EXAMPLES = int(os.environ.get("PSNG_FUZZ_EXAMPLES", "0") or 0)


def fuzz_settings(ci_examples: int) -> settings:
    """Hypothesis settings of a fuzz test: ``ci_examples`` derandomized cases, or ``$PSNG_FUZZ_EXAMPLES`` random ones."""
    return settings(
        max_examples=EXAMPLES or ci_examples,
        deadline=None,
        derandomize=not EXAMPLES,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


# --------------------------------------------------------------------------- numbers and values
#: Numbers that size work or memory when a loader trusts them.
HOSTILE_INTS = [0, -1, 1, 2, 3, 7, 2**31, 2**32 + 1, 10**12, 2**62, 2**62 + 1, 2**63, 2**64, -(2**63), 10**30]
hostile_ints = st.one_of(st.sampled_from(HOSTILE_INTS), st.integers(-(2**70), 2**70))
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    hostile_ints,
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def deep(depth: int, opener: str = "[") -> str:
    """JSON nested ``depth`` levels deep."""
    closer = "]" if opener == "[" else "}"
    inner = opener if opener == "[" else '{"a":'
    return inner * depth + ("0" if opener == "{" else "") + closer * depth


hostile_texts = st.one_of(
    st.text(max_size=200),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    st.integers(30, 300_000).map(deep),
    st.integers(30, 50_000).map(lambda n: deep(n, "{")),
    st.sampled_from(
        [
            "",
            "NaN",
            "[Infinity]",
            "1" * 5000,
            '{"a": 1, "a": 2}',
            '"' + "\\" * 1001,
            "[" * 10 + '"' + "]" * 10,
            "\ufeff{}",
            "null",
        ]
    ),
)


# --------------------------------------------------------------------------- snapshots
SNAPSHOT_CONFIGS = [
    {"world_size": 8, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "release": "0.16"},
    {"world_size": 16, "tensor_model_parallel_size": 2, "context_parallel_size": 2, "expert_model_parallel_size": 2,
     "release": "0.19"},
    {"world_size": 4, "release": "0.14"},
]  # fmt: skip


def _valid_snapshots() -> list[dict[str, Any]]:
    return [snapshot_of(MegatronLayout(**config)) for config in SNAPSHOT_CONFIGS]


VALID_SNAPSHOTS = _valid_snapshots()


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node[:3]):
            out += _paths(value, (*prefix, index))
    return out


@st.composite
def mutated_documents(draw: st.DrawFn, documents: list[Any]) -> Any:
    """A valid document with one node (anywhere) replaced by a hostile value, or removed."""
    doc = copy.deepcopy(draw(st.sampled_from(documents)))
    path = draw(st.sampled_from(_paths(doc)[1:]))
    node = doc
    for key in path[:-1]:
        node = node[key]
    if isinstance(node, dict) and draw(st.booleans()) and draw(st.booleans()):
        del node[path[-1]]
    else:
        node[path[-1]] = draw(json_values)
    return doc


def snapshot_texts() -> st.SearchStrategy[str]:
    """Snapshot files: valid, mutated (a node, or the text cut short) and hostile."""
    valid = st.sampled_from(VALID_SNAPSHOTS).map(dumps_snapshot)
    return st.one_of(
        valid,
        mutated_documents(VALID_SNAPSHOTS).map(json.dumps),
        st.tuples(valid, st.floats(0, 1)).map(lambda tf: tf[0][: int(len(tf[0]) * tf[1])]),
        hostile_texts,
    )


# --------------------------------------------------------------------------- topology specs
@st.composite
def valid_specs(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Contiguous modules, one of them the language module."""
    count = draw(st.integers(1, 4))
    modules, start = [], 0
    for i in range(count):
        tp = draw(st.sampled_from([1, 2]))
        size = tp * draw(st.integers(1, 4))
        module: dict[str, Any] = {"name": f"m{i}", "ranks": [start, start + size], "tp": tp}
        modules.append(module)
        start += size
    modules[draw(st.integers(0, count - 1))]["language"] = True
    return modules


def spec_texts() -> st.SearchStrategy[str]:
    """Topology spec files: valid, mutated and hostile."""
    valid = valid_specs()
    hostile_modules = st.lists(
        st.fixed_dictionaries(
            {
                "name": st.one_of(st.text(max_size=6), json_values),
                "ranks": st.one_of(st.lists(hostile_ints, max_size=3), json_values),
            },
            optional={k: json_values for k in ("tp", "pp", "cp", "ep", "etp", "order", "language", "options")},
        ),
        max_size=4,
    )
    return st.one_of(
        valid.map(json.dumps),
        st.lists(valid, min_size=1, max_size=1).flatmap(lambda v: mutated_documents(v)).map(json.dumps),
        hostile_modules.map(json.dumps),
        hostile_texts,
    )


# --------------------------------------------------------------------------- environment
env_values = st.one_of(
    st.sampled_from(["", " ", "0", "1", "on", "off", "process", "auto", "member", "split", "warn", "error", "nan",
                     "inf", "-inf", "1e999", "-1", "0.5", "30", "tp,pp", "tp,,xx", "0.19", "0.11", "99.0", "x" * 5000]),
    st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=40),
)  # fmt: skip
