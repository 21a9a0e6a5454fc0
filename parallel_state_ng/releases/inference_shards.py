"""Per-release facts for Megatron's inference shards (``megatron.core.inference.shards``, 0.19).

Read from 0.19.2's ``inference/shards.py`` and ``inference/shards_spec.py`` (compared with the
release's own functions by ``tests/releases/test_inference_releases.py``): which names
``compat.install()`` serves from :mod:`parallel_state_ng.builders.inference`, where an unset
size comes from, the two grids' dim orders, the dims behind each collection field and the shard
spec's keys. See docs/compat.md ("Inference shards").
"""

from __future__ import annotations

from parallel_state_ng.releases import SUPPORTED_SERIES

__all__ = [
    "SHARDS_MODULE",
    "SPEC_MODULE",
    "SERVED_FUNCTIONS",
    "SIZE_DEFAULTS",
    "DENSE_DIMS",
    "EXPERT_DIMS",
    "DENSE_FIELDS",
    "EXPERT_FIELDS",
    "EMBEDDING_FIELDS",
    "COLLECTION_FIELDS",
    "SPEC_SIZE_KEYS",
    "SPEC_ROLES",
]

SHARDS_MODULE = "megatron.core.inference.shards"
SPEC_MODULE = "megatron.core.inference.shards_spec"

_SHARD_FUNCTIONS = ("build_inference_pg_collection", "build_inference_pg_collections_for_shards")

#: series -> the functions of :data:`SHARDS_MODULE` that ``compat.install()`` redirects to the
#: engine (empty: the release has no such module).
SERVED_FUNCTIONS: dict[str, tuple[str, ...]] = {
    series: (_SHARD_FUNCTIONS if series == "0.19" else ()) for series in SUPPORTED_SERIES
}

#: (size parameter, ``parallel_state`` getter that answers it when the parameter is ``None``),
#: in the order Megatron asks.
SIZE_DEFAULTS: tuple[tuple[str, str], ...] = (
    ("tp_size", "get_tensor_model_parallel_world_size"),
    ("cp_size", "get_context_parallel_world_size"),
    ("pp_size", "get_pipeline_model_parallel_world_size"),
    ("ep_size", "get_expert_model_parallel_world_size"),
    ("expt_tp_size", "get_expert_tensor_parallel_world_size"),
)

#: ``use_tp_pp_dp_mapping`` -> the dense grid's dims, fastest first (sizes tp, cp, dp, pp).
DENSE_DIMS: dict[bool, tuple[str, ...]] = {False: ("tp", "cp", "dp", "pp"), True: ("tp", "cp", "pp", "dp")}
#: ``use_tp_pp_dp_mapping`` -> the expert grid's dims (sizes expt_tp, ep, expt_dp, pp).
EXPERT_DIMS: dict[bool, tuple[str, ...]] = {False: ("tp", "ep", "dp", "pp"), True: ("tp", "ep", "pp", "dp")}

#: Collection field -> the dense grid's dims its group spans, in Megatron's creation order.
DENSE_FIELDS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "pp": ("pp",),
    "dp": ("dp",),
    "mp": ("tp", "pp"),
    "tp_cp": ("tp", "cp"),
    "dp_cp": ("cp", "dp"),
    "tp_dp_cp": ("tp", "cp", "dp"),
}
#: Collection field -> the expert grid's dims, in creation order (after the dense fields).
EXPERT_FIELDS: dict[str, tuple[str, ...]] = {
    "ep": ("ep",),
    "expt_tp": ("tp",),
    "expt_dp": ("dp",),
    "tp_ep": ("tp", "ep"),
    "tp_ep_pp": ("tp", "ep", "pp"),
}
#: The fields made last, from each pipeline: the first and last stage, and the first stage.
EMBEDDING_FIELDS: tuple[str, str] = ("embd", "pos_embd")

#: The collection's fields Megatron's function sets (every other field stays unset).
COLLECTION_FIELDS: tuple[str, ...] = (
    "tp",
    "cp",
    "pp",
    "ep",
    "embd",
    "pos_embd",
    "dp",
    "tp_cp",
    "mp",
    "expt_tp",
    "expt_dp",
    "tp_ep",
    "tp_ep_pp",
    "dp_cp",
    "tp_dp_cp",
)

#: The integer keys of one shard's spec (``key=value`` in a spec string, or a dict key).
SPEC_SIZE_KEYS: tuple[str, ...] = ("tp", "pp", "ep", "expt_tp", "dp", "cp")
#: The values ``role=`` may take.
SPEC_ROLES: tuple[str, ...] = ("prefill", "decode")
