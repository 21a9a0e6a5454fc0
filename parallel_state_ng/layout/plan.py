"""The group plan: the ordered creation steps of one rank's ``initialize_model_parallel``.

:data:`CREATION_ORDER` is MCore's creation order as rows of
:data:`~parallel_state_ng.layout.kinds.GROUP_KINDS` kinds; :func:`group_plan` turns it into one
rank's steps (its groups only, each with ranks, ``group_desc``, backend, NCCL key, timeout
rule; SHARP steps too). Pure: compat executes the steps, the tools count them. See
docs/architecture.md ("the group plan").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

from parallel_state_ng.layout.kinds import GROUP_KINDS, GroupKind, kind_exists
from parallel_state_ng.releases.facts import ReleaseFacts

__all__ = [
    "PlanOptions",
    "CreateGroup",
    "SetCollnet",
    "SplitOut",
    "SPLIT_BACKENDS",
    "SharpBarrier",
    "Step",
    "CREATION_ORDER",
    "group_plan",
    "creation_kinds",
    "format_plan",
]


@dataclass(frozen=True)
class PlanOptions:
    """The ``initialize_model_parallel`` options that change which groups are created, and how."""

    create_gloo_process_groups: bool = True
    create_all_gather_group: bool = False
    pipeline_model_parallel_comm_backend: str | None = None
    sharp_enabled_group: str | None = None
    hybrid_context_parallel: bool = False
    #: False: no embedding / position-embedding groups (a multi-module job's non-language modules).
    embedding_groups: bool = True


@dataclass(frozen=True)
class CreateGroup:
    """Create one process group.

    ``ranks`` are its members in MCore's order (the layout's list, not copied: at a million
    ranks a group's list is large). ``kind`` is its row of ``GROUP_KINDS``; ``key`` where the state keeps it (``"dp"``,
    ``"dp_gloo"`` for a gloo twin, ``"hcp1"`` for a hierarchical level); ``slot`` the level or
    hybrid size. ``nccl_key`` names the ``nccl_comm_cfgs`` entry of its options (``None``: none);
    ``timeout`` is ``"init"`` (the init's timeout) or ``"torch"`` (torch's default).
    """

    kind: str
    key: str
    ranks: list[int]
    desc: str
    backend: str | None = None
    nccl_key: str | None = None
    timeout: Literal["init", "torch"] = "init"
    slot: int | None = None


@dataclass(frozen=True)
class SetCollnet:
    """Set ``NCCL_COLLNET_ENABLE`` to ``value`` before SHARP's group is created."""

    value: str


@dataclass(frozen=True)
class SharpBarrier:
    """A barrier on the group kept under ``key`` so its communicator exists with SHARP on.

    ``legacy`` (0.12–0.13): no device synchronize, ``NCCL_COLLNET_ENABLE="0"`` afterwards;
    later releases synchronize and remove the variable.
    """

    key: str
    legacy: bool


@dataclass(frozen=True)
class SplitOut:
    """Join the split that creates the groups of one kind, without a colour (split path only).

    A rank in no group of the kind (or outside the layout) takes part in its split all the same,
    so that every rank of the world makes the same sequence of splits. The fields are those of
    the :class:`CreateGroup` the kind's members carry out at the same position.
    """

    kind: str
    key: str
    desc: str
    nccl_key: str | None = None
    timeout: Literal["init", "torch"] = "init"
    slot: int | None = None


Step = CreateGroup | SetCollnet | SharpBarrier | SplitOut

#: Backends whose groups are made by splitting the default group on a world that splits
#: (``None``: the default backend).
SPLIT_BACKENDS = (None, "nccl")


class PlannedLayout(Protocol):
    """What the plan reads of a layout: a :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout`.

    Stated here, not imported, because the layout lists its kinds from this module.
    """

    facts: ReleaseFacts
    num_distributed_optimizer_instances: int
    gtp_remat_size: int
    expert_gtp_remat_size: int

    @property
    def hierarchical_levels(self) -> int:
        """The number of hierarchical context-parallel levels."""

    def contains(self, rank: int) -> bool:
        """Whether ``rank`` is one of the layout's ranks."""

    def group(self, kind: str, rank: int) -> list[int] | None:
        """``rank``'s group of ``kind``, or ``None``."""

    def groups(self, kind: str, rank: int) -> list[list[int]]:
        """Every group of ``kind`` that ``rank`` is in."""

    def embedding_ranks(self, kind: str, pp_ranks: list[int]) -> list[int]:
        """The embedding ranks of ``kind`` in a pipeline."""

    def hybrid_group(self, rank: int, group_size: int) -> list[int] | None:
        """``rank``'s hybrid dp x cp group of ``group_size``, or ``None``."""

    def hybrid_group_sizes(self) -> list[int]:
        """The sizes of the hybrid dp x cp groups."""


@dataclass(frozen=True)
class _Context:
    layout: PlannedLayout
    options: PlanOptions
    every_split: bool = False

    @property
    def multi(self) -> bool:
        return self.layout.num_distributed_optimizer_instances > 1

    @property
    def gtp(self) -> bool:
        return self.layout.gtp_remat_size > 1

    @property
    def egtp(self) -> bool:
        return self.layout.expert_gtp_remat_size > 1

    def exists(self, kind: str) -> bool:
        return kind_exists(kind, self.layout.facts)


Condition = Callable[[_Context], bool]
_Action = Literal["group", "dense_twin", "expert_twin", "pipelines", "levels", "hybrid", "collnet", "barrier"]


@dataclass(frozen=True)
class _Row:
    """One row of the creation order: ``action`` on ``kind`` when ``when`` holds."""

    action: _Action
    kind: str
    when: Condition | None = None
    ranks_of: str | None = None  # create with the ranks of another kind (0.16-0.17 dp_cp_ag)


def _always(_c: _Context) -> bool:
    return True


def _dp_first(c: _Context) -> bool:
    return c.layout.facts.dp_before_dp_cp


def _dp_after(c: _Context) -> bool:
    return not c.layout.facts.dp_before_dp_cp


def _multi(c: _Context) -> bool:
    return c.multi


def _sharp_dp(c: _Context) -> bool:
    return c.options.sharp_enabled_group == "dp"


def _sharp_replica(c: _Context) -> bool:
    return c.options.sharp_enabled_group == "dp_replica" and c.multi and c.exists("inter_ep_dp")


#: MCore's creation order (one release's order is this list with the rows its kinds or
#: configuration rule out left out).
CREATION_ORDER: tuple[_Row, ...] = (
    _Row("group", "gtp_remat"),
    _Row("group", "dp", _dp_first),
    _Row("dense_twin", "dp", _dp_first),
    _Row("collnet", "dp_cp", lambda c: _sharp_dp(c) and not c.layout.facts.sharp_collnet_zero),
    _Row("group", "dp_cp"),  # first with SHARP: it must be the first communicator
    _Row("group", "dp_cp_ag", lambda c: c.options.create_all_gather_group, ranks_of="dp_cp"),
    _Row("dense_twin", "dp_cp"),
    _Row("group", "intra_dp_cp", _multi),
    _Row("dense_twin", "intra_dp_cp", _multi),
    _Row("group", "inter_dp_cp", _multi),
    _Row("barrier", "dp_cp", _sharp_dp),
    _Row("hybrid", "hybrid_dp_cp", lambda c: c.options.hybrid_context_parallel),
    _Row("group", "dp", _dp_after),
    _Row("dense_twin", "dp", _dp_after),
    _Row("group", "gtp_remat_dp", lambda c: c.gtp),
    _Row("group", "gtp_remat_dp_cp", lambda c: c.gtp),
    _Row("group", "cp"),
    _Row("levels", "hcp"),
    _Row("group", "mp"),
    _Row("group", "tp"),
    _Row("pipelines", "pp"),  # each pipeline of the rank, then its embd / pos_embd groups
    _Row("group", "tp_dp_cp"),
    _Row("group", "tp_dp"),
    _Row("group", "tp_cp"),
    _Row("group", "expt_gtp_remat"),
    _Row("group", "ep"),
    _Row("group", "ep_tp"),
    _Row("group", "tp_ep_mp"),
    _Row("group", "tp_ep_pp"),
    _Row("group", "tp_ep_gtp_remat_pp"),
    _Row("group", "ep_dp"),
    _Row("expert_twin", "ep_dp"),
    _Row("collnet", "inter_ep_dp", _sharp_replica),
    _Row("group", "intra_ep_dp", _multi),
    _Row("expert_twin", "intra_ep_dp", _multi),
    _Row("group", "inter_ep_dp", _multi),
    _Row("expert_twin", "inter_ep_dp", _multi),
    _Row("barrier", "inter_ep_dp", _sharp_replica),
    _Row("group", "ep_gtp_remat_dp", lambda c: c.egtp),
    _Row("group", "intra_dist_opt_instance"),
)


def _group_step(kind: GroupKind, c: _Context, ranks: list[int], **overrides: object) -> CreateGroup:
    fields: dict[str, object] = {
        "kind": kind.name,
        "key": kind.name,
        "ranks": ranks,
        "desc": kind.desc,
        "nccl_key": kind.nccl_key,
        "timeout": kind.timeout_rule(c.layout.facts),
    }
    fields.update(overrides)
    return CreateGroup(**fields)  # type: ignore[arg-type]


def _twin_step(kind: GroupKind, ranks: list[int]) -> CreateGroup:
    assert kind.gloo_desc is not None, f"kind {kind.name!r} has no gloo twin"
    return CreateGroup(
        kind=kind.name,
        key=f"{kind.name}_gloo",
        ranks=ranks,
        desc=kind.gloo_desc,
        backend="gloo",
        nccl_key=kind.nccl_key if kind.gloo_nccl_options else None,
        timeout=kind.gloo_timeout,
    )


def _out_step(kind: GroupKind, c: _Context, **overrides: object) -> SplitOut:
    fields: dict[str, object] = {
        "kind": kind.name,
        "key": kind.name,
        "desc": kind.desc,
        "nccl_key": kind.nccl_key,
        "timeout": kind.timeout_rule(c.layout.facts),
    }
    fields.update(overrides)
    return SplitOut(**fields)  # type: ignore[arg-type]


def _one(kind: GroupKind, c: _Context, ranks: list[int] | None, **overrides: object) -> Iterator[Step]:
    """The step of a group of ``kind`` over ``ranks``; with ``every_split``, a :class:`SplitOut` for none."""
    if ranks is not None:
        yield _group_step(kind, c, ranks, **overrides)
    elif c.every_split and overrides.get("backend") in SPLIT_BACKENDS:
        overrides.pop("backend", None)
        yield _out_step(kind, c, **overrides)


def _row_steps(row: _Row, c: _Context, rank: int | None, made: dict[str, list[int]]) -> Iterator[Step]:
    """The steps of one row for ``rank`` (``None``: a rank outside the layout, split path only)."""
    lay, kind = c.layout, GROUP_KINDS[row.kind]
    if row.action == "collnet":
        if rank is not None:
            yield SetCollnet("1")
    elif row.action == "barrier":
        if rank is not None:
            yield SharpBarrier(row.kind, legacy=lay.facts.sharp_collnet_zero)
    elif row.action == "group":
        ranks = None if rank is None else made.get(row.ranks_of) if row.ranks_of else lay.group(row.kind, rank)
        if ranks is not None:  # None: this rank is in no group of the kind
            made[row.kind] = ranks
        yield from _one(kind, c, ranks)
    elif row.action in ("dense_twin", "expert_twin"):
        gloo = c.options.create_gloo_process_groups and not (lay.facts.gtp_remat_axis and c.gtp)
        if row.action == "expert_twin":
            gloo = gloo and not (lay.facts.gtp_remat_axis and c.egtp)
        if gloo and row.kind in made:
            yield _twin_step(kind, made[row.kind])
    elif row.action == "levels":
        for level in range(lay.hierarchical_levels):
            # 0.12: sizes that do not cover the cp group leave ranks out
            ranks = None if rank is None else lay.group(f"hcp{level}", rank)
            yield from _one(kind, c, ranks, key=f"hcp{level}", desc=kind.desc.format(level=level), slot=level)
    elif row.action == "hybrid":
        for size in lay.hybrid_group_sizes():
            ranks = None if rank is None else lay.hybrid_group(rank, size)
            yield from _one(kind, c, ranks, key=f"hybrid_dp_cp_{size}", desc=kind.desc.format(size=size), slot=size)
    elif row.action == "pipelines":
        yield from _pipeline_steps(kind, c, rank)


def _pipeline_steps(kind: GroupKind, c: _Context, rank: int | None) -> Iterator[Step]:
    """Each pipeline of ``rank``, then its embedding and position-embedding groups."""
    lay = c.layout
    backend = c.options.pipeline_model_parallel_comm_backend
    nccl_key = None if backend == "ucc" else kind.nccl_key
    pipelines = [] if rank is None else lay.groups("pp", rank)
    if c.every_split and rank is not None and len(pipelines) != 1:
        raise ValueError(
            f"rank {rank} is in {len(pipelines)} pipelines (a 0.12/0.13 encoder layout): the split path makes "
            f"one split per group kind; create these groups on the member path (PSNG_CREATION_PATH=member) "
            f"with a default group that has no bound device"
        )
    embedding = ("embd", "pos_embd") if c.options.embedding_groups else ()
    if not pipelines:  # outside the layout
        yield from _one(kind, c, None, backend=backend, nccl_key=nccl_key)
        for name in embedding:
            yield from _one(GROUP_KINDS[name], c, None)
    for pipeline in pipelines:
        yield _group_step(kind, c, pipeline, backend=backend, nccl_key=nccl_key)
        for name in embedding:
            members = lay.embedding_ranks(name, pipeline)
            yield from _one(GROUP_KINDS[name], c, members if rank in members else None)


def group_plan(
    layout: PlannedLayout, rank: int, options: PlanOptions | None = None, *, every_split: bool = False
) -> list[Step]:
    """``rank``'s creation steps for ``layout`` (the layout's release) and ``options``, in order.

    Only the groups ``rank`` belongs to are listed, each computed in closed form; a rank
    outside the layout's ranks gets no step. With ``every_split`` (the split path) every rank of
    the world, outside the layout too, also gets a :class:`SplitOut` wherever it is in no group
    of a kind made by splitting, so that all ranks list the same sequence of splits.

    Raises:
        ValueError: ``every_split`` on a 0.12/0.13 layout whose encoder puts a rank in several
            pipelines.
    """
    inside = layout.contains(rank)
    if not inside and not every_split:
        return []
    c = _Context(layout, options or PlanOptions(), every_split)
    made: dict[str, list[int]] = {}
    steps: list[Step] = []
    for row in _release_rows(layout.facts):
        if (row.when or _always)(c):
            steps.extend(_row_steps(row, c, rank if inside else None, made))
    return steps


@functools.cache
def _release_rows(facts: ReleaseFacts) -> tuple[_Row, ...]:
    """The rows of :data:`CREATION_ORDER` whose kind the release of ``facts`` builds (per release: cached)."""
    return tuple(row for row in CREATION_ORDER if kind_exists(row.kind, facts))


def creation_kinds(layout: PlannedLayout) -> list[str]:
    """Every kind ``initialize_model_parallel`` builds for ``layout`` (default options), in order.

    Hierarchical levels are listed as ``hcp0``, ``hcp1``, ...; a pipeline is followed by its
    embedding kinds. Gloo twins, hybrid and all-gather groups (on request only) are not listed.
    """
    c = _Context(layout, PlanOptions(create_gloo_process_groups=False))
    out: list[str] = []
    for row in CREATION_ORDER:
        if not (kind_exists(row.kind, layout.facts) and (row.when or _always)(c)):
            continue
        if row.action == "group":
            out.append(row.kind)
        elif row.action == "levels":
            out += [f"hcp{level}" for level in range(layout.hierarchical_levels)]
        elif row.action == "pipelines":
            out += ["pp", "embd", "pos_embd"]
    return out


def format_plan(steps: list[Step]) -> list[str]:
    """One text line per step (for the tools and for reading a plan)."""
    lines = []
    for i, step in enumerate(steps, 1):
        if isinstance(step, CreateGroup):
            extra = f" backend={step.backend}" if step.backend else ""
            extra += f" nccl_key={step.nccl_key}" if step.nccl_key else ""
            lines.append(f"{i:>3}  {step.key:<24} {step.desc:<56} {list(step.ranks)} timeout={step.timeout}{extra}")
        elif isinstance(step, SetCollnet):
            lines.append(f"{i:>3}  NCCL_COLLNET_ENABLE={step.value}")
        elif isinstance(step, SplitOut):
            lines.append(f"{i:>3}  {step.key:<24} {step.desc:<56} (split without a colour) timeout={step.timeout}")
        else:
            lines.append(f"{i:>3}  SHARP barrier on {step.key}" + (" (legacy)" if step.legacy else ""))
    return lines
