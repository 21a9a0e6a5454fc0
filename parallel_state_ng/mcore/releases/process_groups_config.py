"""Per-release facts about ``megatron.core.process_groups_config``: the collection of process
groups newer Megatron code takes instead of the global ``parallel_state``.

* :data:`COLLECTION_CLASS` — the class name per series (``ProcessGroupCollection`` from 0.15;
  0.14 has ``ModelCommProcessGroups`` / ``GradCommProcessGroups`` instead).
* :data:`COLLECTION_FIELDS` — its fields per series, in declaration order (20 in 0.15–0.17,
  22 in 0.18 with the all-gather groups, 27 in 0.19 with the GTP groups).
* :data:`COLLECTION_GETTERS` — the ``parallel_state`` call ``use_mpu_process_groups()`` makes
  for each field.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from parallel_state_ng.mcore.releases import SUPPORTED_SERIES, Release, parse_release

__all__ = ["COLLECTION_CLASS", "COLLECTION_FIELDS", "COLLECTION_GETTERS", "collection_fields"]

#: The process-group collection class of ``megatron.core.process_groups_config`` per series
#: (0.14 has ``ModelCommProcessGroups`` / ``GradCommProcessGroups`` instead).
COLLECTION_CLASS: dict[str, Optional[str]] = {
    "0.12": None, "0.13": None, "0.14": None, "0.15": "ProcessGroupCollection", "0.16": "ProcessGroupCollection",
    "0.17": "ProcessGroupCollection", "0.18": "ProcessGroupCollection", "0.19": "ProcessGroupCollection",
}
_FIELDS_015 = (
    "tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "hcp", "ep", "expt_tp", "tp_ep", "tp_ep_pp",
    "tp_dp_cp", "dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp", "inter_dist_opt", "intra_dist_opt",
)
_FIELDS_018 = _FIELDS_015[:15] + ("dp_cp_ag", "expt_dp", "expt_dp_ag") + _FIELDS_015[16:]
_FIELDS_019 = (
    "tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "hcp", "ep", "expt_tp", "tp_ep", "tp_ep_pp",
    "tp_ep_pp_with_egtp_remat", "tp_dp_cp", "dp", "dp_cp", "dp_cp_gtp_remat", "dp_cp_ag", "gtp_remat",
    "expt_gtp_remat", "expt_dp", "expt_dp_gtp_remat", "expt_dp_ag", "intra_dp_cp", "intra_expt_dp",
    "inter_dist_opt", "intra_dist_opt",
)
#: series -> the collection's fields, in declaration order.
COLLECTION_FIELDS: dict[str, tuple[str, ...]] = {
    "0.12": (), "0.13": (), "0.14": (), "0.15": _FIELDS_015, "0.16": _FIELDS_015, "0.17": _FIELDS_015,
    "0.18": _FIELDS_018, "0.19": _FIELDS_019,
}
_LENIENT = {"check_initialized": False}
#: field -> (parallel_state function, keyword arguments) that ``use_mpu_process_groups`` calls,
#: or ``None`` for a field it always leaves ``None``. Keywords a release lacks mean that
#: release's fixed behaviour (``with_gtp_remat=False`` before 0.19).
COLLECTION_GETTERS: dict[str, Optional[tuple[str, dict[str, Any]]]] = {
    "tp": ("get_tensor_model_parallel_group", _LENIENT),
    "pp": ("get_pipeline_model_parallel_group", _LENIENT),
    "mp": ("get_model_parallel_group", _LENIENT),
    "embd": ("get_embedding_group", _LENIENT),
    "pos_embd": ("get_position_embedding_group", _LENIENT),
    "cp": ("get_context_parallel_group", _LENIENT),
    "tp_cp": ("get_tensor_and_context_parallel_group", _LENIENT),
    "hcp": ("get_hierarchical_context_parallel_groups", _LENIENT),
    "ep": ("get_expert_model_parallel_group", _LENIENT),
    "expt_tp": ("get_expert_tensor_parallel_group", _LENIENT),
    "tp_ep": ("get_expert_tensor_and_model_parallel_group", _LENIENT),
    "tp_ep_pp": ("get_expert_tensor_model_pipeline_parallel_group", _LENIENT),
    "tp_ep_pp_with_egtp_remat": (
        "get_expert_tensor_model_pipeline_parallel_group", {**_LENIENT, "with_egtp_remat": True}
    ),
    "tp_dp_cp": ("get_tensor_and_data_parallel_group", {**_LENIENT, "with_context_parallel": True}),
    # the data-parallel getters have no lenient mode: uninitialized raises
    "dp": ("get_data_parallel_group", {"with_gtp_remat": False}),
    "dp_cp": ("get_data_parallel_group", {"with_context_parallel": True, "with_gtp_remat": False}),
    "dp_cp_gtp_remat": ("get_data_parallel_group", {"with_context_parallel": True, "with_gtp_remat": True}),
    "dp_cp_ag": None,
    "gtp_remat": ("get_gtp_weight_remat_group", _LENIENT),
    "expt_gtp_remat": ("get_expert_gtp_weight_remat_group", _LENIENT),
    "intra_dp_cp": (
        "get_data_parallel_group",
        {"with_context_parallel": True, "with_gtp_remat": False, "partial_data_parallel": True},
    ),
    "expt_dp": ("get_expert_data_parallel_group", {**_LENIENT, "with_gtp_remat": False}),
    "expt_dp_gtp_remat": ("get_expert_data_parallel_group", {**_LENIENT, "with_gtp_remat": True}),
    "expt_dp_ag": None,
    "intra_expt_dp": (
        "get_expert_data_parallel_group",
        {**_LENIENT, "with_gtp_remat": False, "partial_expert_data_parallel": True},
    ),
    "inter_dist_opt": ("get_inter_distributed_optimizer_instance_group", _LENIENT),
    "intra_dist_opt": ("get_intra_distributed_optimizer_instance_group", _LENIENT),
}



def collection_fields(release: Union[str, Release]) -> tuple[str, ...]:
    """The fields of ``release``'s ``ProcessGroupCollection`` (empty: the release has none).

    Raises:
        ValueError: ``release`` is not a supported series.
    """
    r = release if isinstance(release, Release) else parse_release(release)
    if r.series not in SUPPORTED_SERIES:
        raise ValueError(f"release {release!s} is not a supported series ({', '.join(SUPPORTED_SERIES)})")
    return COLLECTION_FIELDS[r.series]
