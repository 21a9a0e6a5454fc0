"""Per-release facts about ``megatron.core.process_groups_config``: the collection of process
groups newer Megatron code takes instead of the global ``parallel_state``.

* :data:`COLLECTION_CLASS` — the class name per series (``ProcessGroupCollection`` from 0.15;
  0.14 has ``ModelCommProcessGroups`` / ``GradCommProcessGroups`` instead).
* :data:`COLLECTION_FIELDS` — its fields per series, in declaration order (20 in 0.15–0.17,
  22 in 0.18 with the all-gather groups, 27 in 0.19 with the GTP groups).
* :data:`STRICT_FIELDS` — the fields ``use_mpu_process_groups()`` refuses to leave unset.
"""

from __future__ import annotations

from parallel_state_ng.releases import SUPPORTED_SERIES, Release, as_release

__all__ = ["COLLECTION_CLASS", "COLLECTION_FIELDS", "STRICT_FIELDS", "collection_fields"]

#: The process-group collection class of ``megatron.core.process_groups_config`` per series
#: (0.14 has ``ModelCommProcessGroups`` / ``GradCommProcessGroups`` instead).
COLLECTION_CLASS: dict[str, str | None] = {
    "0.12": None,
    "0.13": None,
    "0.14": None,
    "0.15": "ProcessGroupCollection",
    "0.16": "ProcessGroupCollection",
    "0.17": "ProcessGroupCollection",
    "0.18": "ProcessGroupCollection",
    "0.19": "ProcessGroupCollection",
}
_FIELDS_015 = (
    "tp",
    "pp",
    "mp",
    "embd",
    "pos_embd",
    "cp",
    "tp_cp",
    "hcp",
    "ep",
    "expt_tp",
    "tp_ep",
    "tp_ep_pp",
    "tp_dp_cp",
    "dp",
    "dp_cp",
    "expt_dp",
    "intra_dp_cp",
    "intra_expt_dp",
    "inter_dist_opt",
    "intra_dist_opt",
)
_FIELDS_018 = _FIELDS_015[:15] + ("dp_cp_ag", "expt_dp", "expt_dp_ag") + _FIELDS_015[16:]
_FIELDS_019 = (
    "tp",
    "pp",
    "mp",
    "embd",
    "pos_embd",
    "cp",
    "tp_cp",
    "hcp",
    "ep",
    "expt_tp",
    "tp_ep",
    "tp_ep_pp",
    "tp_ep_pp_with_egtp_remat",
    "tp_dp_cp",
    "dp",
    "dp_cp",
    "dp_cp_gtp_remat",
    "dp_cp_ag",
    "gtp_remat",
    "expt_gtp_remat",
    "expt_dp",
    "expt_dp_gtp_remat",
    "expt_dp_ag",
    "intra_dp_cp",
    "intra_expt_dp",
    "inter_dist_opt",
    "intra_dist_opt",
)
#: series -> the collection's fields, in declaration order.
COLLECTION_FIELDS: dict[str, tuple[str, ...]] = {
    "0.12": (),
    "0.13": (),
    "0.14": (),
    "0.15": _FIELDS_015,
    "0.16": _FIELDS_015,
    "0.17": _FIELDS_015,
    "0.18": _FIELDS_018,
    "0.19": _FIELDS_019,
}
#: Fields whose ``parallel_state`` getter has no lenient mode: ``use_mpu_process_groups()``
#: raises ``AssertionError`` while they are unset (before init). Every other field is ``None``
#: then. Which global fills each field is stated with the group kinds
#: (:data:`parallel_state_ng.layout.kinds.GROUP_KINDS`, ``Fill.collection``); a field no global
#: fills (the all-gather groups) is always ``None``, set by the caller.
STRICT_FIELDS: frozenset[str] = frozenset({"dp", "dp_cp", "dp_cp_gtp_remat", "intra_dp_cp"})


def collection_fields(release: str | Release) -> tuple[str, ...]:
    """The fields of ``release``'s ``ProcessGroupCollection`` (empty: the release has none).

    Raises:
        ValueError: ``release`` is not a supported series.
    """
    r = as_release(release)
    if r.series not in SUPPORTED_SERIES:
        raise ValueError(f"release {release!s} is not a supported series ({', '.join(SUPPORTED_SERIES)})")
    return COLLECTION_FIELDS[r.series]
