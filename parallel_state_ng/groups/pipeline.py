"""The one build pipeline, as explicit steps: agree, prepare, check options, build, publish.

compat's ``initialize_model_parallel`` and :func:`~parallel_state_ng.build_megatron_groups`
(and through it :func:`~parallel_state_ng.build_topology` and a rebuild after a failure) call
the steps in one direction, each passing the previous step's result to the next:

1. :func:`agree`: the arguments and the process-wide switches, equal on every participant
   (over the world before prepare, or over :func:`layout_participants` after it);
2. prepare: the caller's own pure function of its typed arguments (compat:
   :class:`~parallel_state_ng.layout.init_args.InitArgs`) that validates in the release's
   exception types and returns a :class:`Prepared` (the layout and how its groups are made);
3. :func:`check_options`: NCCL values the installed NCCL refuses;
4. :func:`build`: the NVLink-domain check, then this rank's groups from the group plan
   through the build's :class:`~parallel_state_ng.groups.factory.GroupFactory`;
5. publish: the caller's (compat's module globals, a :class:`MegatronGroups` object).

No step calls back up into its caller. See docs/architecture.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from parallel_state_ng.groups.agreement import AgreementResult, agreement_check_settings, check_agreement
from parallel_state_ng.groups.megatron_groups import ModelParallelGroups, create_model_groups, nccl_options_from_config
from parallel_state_ng.groups.nccl_config import check_nccl_config
from parallel_state_ng.groups.nvlink_check import CHECK_FIELD, Groups, check_domains, raise_if_invalid, round_arguments
from parallel_state_ng.groups.sharing import group_sharing_mode
from parallel_state_ng.groups.split import CreationPath, creation_path
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
    "layout_participants",
    "check_options",
    "build",
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

    def with_nccl_config(self, nccl_comm_cfgs: Mapping[str, Mapping[str, Any]], source: str) -> Prepared:
        """A copy whose NCCL communicator config is ``nccl_comm_cfgs``, read from ``source``."""
        return replace(self, nccl_comm_cfgs=nccl_comm_cfgs, nccl_config_source=source)


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
    compared[CREATION_FIELD] = creation_path(creation)
    compared[SHARING_FIELD] = group_sharing_mode(compared[CREATION_FIELD])
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


def layout_participants(layout: MegatronLayout, path: str) -> range | None:
    """The ranks a layout-level agreement covers: the layout's own, or the world (``None``) on the split path."""
    return None if path == "split" else range(layout.rank_offset, layout.rank_offset + layout.layout_world_size)


def check_options(prepared: Prepared) -> None:
    """The step between prepare and build: NCCL values the installed NCCL refuses raise here.

    Raises :class:`~parallel_state_ng.groups.nccl_config.NcclConfigError` before any group exists.
    """
    check_nccl_config(
        prepared.nccl_comm_cfgs,
        source=prepared.nccl_config_source,
        legacy_defaults=prepared.layout.facts.nccl_config_defaults,
    )


def build(
    prepared: Prepared,
    *,
    name: str,
    path: CreationPath,
    agreed: AgreementResult | None,
    rank: int | None = None,
    empty_outside: bool = False,
) -> ModelParallelGroups | None:
    """The pipeline's build step: this rank's groups for ``prepared``, or ``None`` outside its layout.

    The caller ran the steps before it, in order: :func:`agree` (over the world, or over
    :func:`layout_participants` once the layout is known), its own prepare (validation in the
    release's exception types, the layout and the group options) and :func:`check_options`.
    Here: the NVLink-domain check of the layout against the map ``agreed`` brought, then the
    creation of this rank's groups (atomic: a failure leaves no group behind). A rank outside
    the layout gets ``None``, or with ``empty_outside`` a
    :class:`~parallel_state_ng.groups.megatron_groups.ModelParallelGroups` holding no group (as
    compat's globals need); on the split path it still joins every split. ``name`` (the caller's
    function) appears in errors.
    """
    layout = prepared.layout
    if rank is None:
        rank = dist.get_rank()
    inside = layout.contains(rank)
    if not inside and not empty_outside and path == "member":
        return None
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
        return None  # the split path: it joined every split, and holds no group
    return groups
