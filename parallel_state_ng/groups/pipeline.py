"""The one build pipeline: agreement, layout, NCCL options, then this rank's groups.

compat's ``initialize_model_parallel``, :func:`~parallel_state_ng.build_megatron_groups` (and
through it :func:`~parallel_state_ng.build_topology` and a rebuild after a failure) all run
:func:`build_layout_groups`; what differs between them is a parameter: where the agreement
check stands, which ranks take part, what the caller validates. See docs/architecture.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist

from parallel_state_ng.groups.agreement import AgreementResult, agreement_check_settings, check_agreement
from parallel_state_ng.groups.megatron_groups import ModelParallelGroups, create_model_groups, nccl_options_from_config
from parallel_state_ng.groups.nccl_config import check_nccl_config
from parallel_state_ng.groups.nvlink_check import CHECK_FIELD, Groups, check_domains, raise_if_invalid, round_arguments
from parallel_state_ng.groups.sharing import group_sharing_mode
from parallel_state_ng.groups.split import creation_path
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.layout.named_layout import Layout
from parallel_state_ng.layout.nvlink_domains import GroupRows, kind_group_blocks
from parallel_state_ng.layout.plan import PlanOptions

__all__ = [
    "SHARING_FIELD",
    "CREATION_FIELD",
    "Prepared",
    "agree",
    "check_nvlink_domains",
    "nccl_config",
    "build_layout_groups",
]

#: The agreement field that carries this process's group-sharing setting (``off``, ``build`` or
#: ``process``): ranks that disagree on it would create different numbers of groups.
SHARING_FIELD = "group sharing (PSNG_SHARE_GROUPS)"
#: The agreement field that carries the creation path: a rank on the member path would leave
#: the others waiting in their splits.
CREATION_FIELD = "creation path (PSNG_CREATION_PATH)"


@dataclass(frozen=True)
class Prepared:
    """What a caller's validation produced: the layout and how its groups are to be made.

    ``nccl_comm_cfgs`` is the parsed NCCL communicator config (group name -> options) and
    ``high_priority_stream_groups`` the group names whose streams get high priority on top of it;
    ``nccl_config_source`` names where the config came from in errors (compat: the YAML's path).
    """

    layout: MegatronLayout
    timeout: timedelta
    options: PlanOptions
    nccl_comm_cfgs: Mapping[str, Mapping[str, Any]]
    high_priority_stream_groups: Sequence[str] = ()
    nccl_config_source: str = "nccl_comm_cfgs"


def agree(
    fields: Mapping[str, Any],
    *,
    name: str,
    ranks: range | None = None,
    enabled: bool | None = None,
    creation: str | None = None,
) -> AgreementResult | None:
    """The pipeline's agreement step: ``fields`` and the process-wide switches, equal on ``ranks``.

    The switches: group sharing, the creation path (``creation``, as
    :func:`~parallel_state_ng.groups.split.creation_path` resolves it) and the NVLink-domain
    check's settings; this rank's NVLink domain id rides on the same round
    (:mod:`~parallel_state_ng.groups.nvlink_check`; the result's ``summary`` is the domain map).
    ``ranks``: the participants (``None``: the whole world). ``enabled``: ``None`` follows
    :func:`~parallel_state_ng.groups.agreement.agreement_check_settings`. Returns ``None``
    without communicating when the check is off or ``torch.distributed`` is not initialized
    (the caller reports that itself).

    Raises:
        ParallelConfigMismatchError: on every participant, when the fields differ.
        ParallelConfigTimeoutError: a participant did not arrive in time.
    """
    on, timeout = agreement_check_settings()
    if not (on if enabled is None else enabled) or not (dist.is_available() and dist.is_initialized()):
        return None
    compared = dict(fields)
    compared[SHARING_FIELD] = group_sharing_mode()
    compared[CREATION_FIELD] = creation_path(creation)
    compared[CHECK_FIELD], rank_value, summarize = round_arguments()
    result = check_agreement(
        compared, name=name, timeout=timeout, group=ranks, rank_value=rank_value, summarize=summarize
    )
    raise_if_invalid(compared[CHECK_FIELD], name)  # the ranks agreed on it: all raise
    return result


def check_nvlink_domains(
    result: AgreementResult | None, layouts: Mapping[str, MegatronLayout | Layout], *, name: str, rank: int
) -> list[str]:
    """The NVLink-domain check of ``layouts`` (label -> layout; ``""`` for a single one) against
    the domain map the agreement round ``result`` brought. A Megatron layout is checked by its
    group kinds, a named :class:`~parallel_state_ng.layout.named_layout.Layout` (a grid) by its
    dims of those names; see
    :func:`~parallel_state_ng.groups.nvlink_check.check_domains` (findings, warning or error).
    The groups go as tensors of the layout math (no Python loop over groups or ranks), the
    derived kinds (not kept by default) as lists.
    Nothing is checked when no round ran or no rank stated a domain.
    """
    if result is None:
        return []

    def groups(layout: MegatronLayout | Layout, kinds: Sequence[str]) -> dict[str, Groups]:
        # groups of one rank never cross: not enumerated. Tensor blocks (checked in tensor ops)
        # where the layout math gives them; the derived kinds as lists (kind_group_blocks says which)
        if isinstance(layout, MegatronLayout):
            first = layout.rank_offset
            return {
                kind: kind_group_blocks(layout, kind) or layout.enumerate(kind)
                for kind in kinds
                if kind in layout.kinds() and len(layout.group(kind, first) or ()) > 1
            }
        named = [kind for kind in kinds if kind in layout.dim_names and layout.size_of(kind) > 1]
        return {kind: GroupRows.of(layout, [kind]) for kind in named}

    def groups_of(kinds: Sequence[str]) -> dict[str, dict[str, Groups]]:
        return {label: groups(layout, kinds) for label, layout in layouts.items()}

    return check_domains(result.summary, groups_of, name=name, rank=rank)


def nccl_config(
    nccl_comm_cfgs: Mapping[str, Mapping[str, Any]], high_priority_stream_groups: Sequence[str] = ()
) -> dict[str, dict[str, Any]]:
    """A copy of ``nccl_comm_cfgs`` with ``is_high_priority_stream`` set for each named group."""
    cfgs = {name: dict(value) for name, value in nccl_comm_cfgs.items()}
    for name in high_priority_stream_groups:
        cfgs.setdefault(name, {})["is_high_priority_stream"] = True
    return cfgs


def build_layout_groups(
    prepare: Callable[[], Prepared],
    *,
    name: str,
    agreement_fields: Mapping[str, Any],
    agree_on: Literal["world", "layout"],
    check_agreement: bool | None = None,
    rank: int | None = None,
    empty_outside: bool = False,
    creation: str | None = None,
) -> tuple[MegatronLayout, ModelParallelGroups | None]:
    """Run the pipeline for one Megatron layout; this rank's groups, or ``None`` outside the layout.

    Steps, in order: the agreement check over the whole world when ``agree_on="world"``;
    ``prepare()`` (the caller's validation, in the release's exception types, and its layout);
    a rank outside the layout stops here (with ``empty_outside`` it gets a
    :class:`ModelParallelGroups` holding no group, as compat's globals need); the agreement
    check over the layout's ranks when ``agree_on="layout"`` (``agreement_fields`` and the
    layout's ``release``); the NCCL options (values the installed NCCL refuses raise
    :class:`~parallel_state_ng.groups.nccl_config.NcclConfigError` before any group exists);
    the creation of this rank's groups (atomic: a failure leaves no group behind). ``name`` (the
    caller's function) appears in errors.

    ``creation`` chooses the creation path (:func:`~parallel_state_ng.groups.split.creation_path`:
    ``None`` reads ``$PSNG_CREATION_PATH``, then the world). On the split path every rank of
    the world takes part: the agreement check covers the world wherever ``agree_on`` puts it,
    and a rank outside the layout joins each split without a colour.
    """
    if agree_on not in ("world", "layout"):
        raise ValueError(f"agree_on must be 'world' or 'layout', got {agree_on!r}")
    path = creation_path(creation)
    agreed = None
    if agree_on == "world":
        agreed = agree(agreement_fields, name=name, enabled=check_agreement, creation=path)
    prepared = prepare()
    layout = prepared.layout
    # values the installed NCCL refuses: raised here, before any group exists
    check_nccl_config(
        prepared.nccl_comm_cfgs, source=prepared.nccl_config_source, legacy_defaults=layout.facts.nccl_config_defaults
    )
    if rank is None:
        rank = dist.get_rank()
    inside = layout.contains(rank)
    if not inside and not empty_outside and path == "member":
        return layout, None
    if agree_on == "layout" and (inside or path == "split"):
        agreed = agree(
            {**agreement_fields, "release": layout.release},
            name=name,
            ranks=None if path == "split" else range(layout.rank_offset, layout.rank_offset + layout.layout_world_size),
            enabled=check_agreement,
            creation=path,
        )
    check_nvlink_domains(agreed, {"": layout}, name=name, rank=rank)  # before any group exists
    cfgs = nccl_config(prepared.nccl_comm_cfgs, prepared.high_priority_stream_groups)
    groups = create_model_groups(
        layout,
        rank,
        timeout=prepared.timeout,
        nccl_options=functools.partial(
            nccl_options_from_config, nccl_comm_cfgs=cfgs, legacy_defaults=layout.facts.nccl_config_defaults
        ),
        options=prepared.options,
        name=name,
        path=path,
    )
    if not inside and not empty_outside:
        return layout, None  # the split path: it joined every split, and holds no group
    return layout, groups
