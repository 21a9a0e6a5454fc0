"""Multi-module topologies as pure data: which module runs on which ranks, with which parallelism.

:class:`ModuleSpec` states one module (MiMo's vision encoder, language model, ...), on disjoint
or colocated ranks; :func:`validate_topology` checks a whole topology before any process group
exists and returns each module's :class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout`.
See docs/engine.md ("Multi-module topologies in one call").
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from parallel_state_ng.layout.bounded_input import MAX_RANK
from parallel_state_ng.layout.megatron_layout import MegatronLayout
from parallel_state_ng.releases import Release, as_release

__all__ = ["ModuleSpec", "TopologySpecError", "ModulePlacement", "validate_topology", "BUILD_OPTIONS"]

#: Further ``build_megatron_groups`` arguments a module may set in :attr:`ModuleSpec.options`.
BUILD_OPTIONS = frozenset(
    {
        "hierarchical_context_parallel_sizes",
        "gtp_remat_size",
        "expert_gtp_remat_size",
        "num_distributed_optimizer_instances",
        "get_embedding_ranks",
        "get_position_embedding_ranks",
        "nccl_comm_cfgs",
        "high_priority_stream_groups",
        "pipeline_model_parallel_comm_backend",
        "distributed_timeout_minutes",
        "create_gloo_process_groups",
    }
)


class TopologySpecError(ValueError):
    """A topology that cannot be built; the message names the module(s) and the numbers."""


@dataclass(frozen=True)
class ModuleSpec:
    """One module of a topology.

    Args:
        name: the module's name (``"language"`` is Megatron MiMo's fixed key for the language model).
        ranks: its global ranks, a contiguous ``range`` (or ``(start, stop)``). Modules either
            have disjoint ranges or exactly the same range (colocated).
        tensor_model_parallel_size: as for ``initialize_model_parallel``, and so are
            ``pipeline_model_parallel_size``, ``context_parallel_size``,
            ``expert_model_parallel_size``, ``expert_tensor_parallel_size`` and ``order``; the
            data-parallel size is what the range leaves.
        language: this is the language module (exactly one per topology): only it gets embedding
            groups (``embd`` / ``pos_embd``; ``None`` in the other modules' collections), and it
            is the ``language_model_module_name`` of Megatron's multi-module collection.
        options: other ``build_megatron_groups`` arguments for this module (see :data:`BUILD_OPTIONS`).
    """

    name: str
    ranks: range | tuple[int, int]
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    order: str = "tp-cp-ep-dp-pp"
    language: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    def sizes(self) -> dict[str, Any]:
        """The module's parallel sizes and order as ``build_megatron_groups`` arguments."""
        return {
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "expert_tensor_parallel_size": self.expert_tensor_parallel_size,
            "order": self.order,
        }


@dataclass(frozen=True, eq=False)
class ModulePlacement:
    """A validated module: its spec, its ranks, its layout and the modules colocated with it.

    ``shape`` is the layout of the module's shape (its spec but for the name and first rank),
    built on the ranks of the first module of that shape; :attr:`layout` is it on this
    module's ranks (``MegatronLayout.shifted``, made on first use): a report of many equal
    modules reads one ``shape`` and shifts its groups. Given a layout on the module's own ranks
    as ``shape``, :attr:`layout` is that layout.
    """

    spec: ModuleSpec
    ranks: range
    shape: MegatronLayout
    colocated_with: tuple[str, ...]

    @property
    def name(self) -> str:
        """The module's name."""
        return self.spec.name

    @functools.cached_property
    def layout(self) -> MegatronLayout:
        """The module's layout, on its ranks."""
        return self.shape if self.shape.rank_offset == self.ranks.start else self.shape.shifted(self.ranks.start)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModulePlacement):
            return NotImplemented
        mine, theirs = (self.spec, self.ranks, self.colocated_with), (other.spec, other.ranks, other.colocated_with)
        return mine == theirs and self.layout == other.layout

    __hash__ = None  # type: ignore[assignment]  # as a dataclass with eq: placements are not hashed


def _as_range(name: str, ranks: Any) -> range:
    if isinstance(ranks, range):
        if ranks.step != 1:
            raise TopologySpecError(f"module {name!r}: ranks must be contiguous (step 1), got {ranks}")
        out = ranks
    elif isinstance(ranks, Sequence) and not isinstance(ranks, (str, bytes)) and len(ranks) == 2:
        start, stop = ranks
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, stop)):
            raise TopologySpecError(f"module {name!r}: ranks (start, stop) must be ints, got {tuple(ranks)!r}")
        out = range(start, stop)
    else:
        raise TopologySpecError(
            f"module {name!r}: ranks must be a range or a (start, stop) pair of ints, got {ranks!r}"
        )
    if out.stop > MAX_RANK:
        raise TopologySpecError(f"module {name!r}: ranks end at {out.stop}, over the limit of {MAX_RANK} (2**62)")
    if out.start < 0 or out.stop <= out.start:
        raise TopologySpecError(
            f"module {name!r}: ranks {out.start}..{out.stop - 1} must be a non-empty range from >= 0"
        )
    return out


def _span(r: range) -> str:
    return f"{r.start}..{r.stop - 1}"


def _check_module(spec: Any, index: int) -> None:
    if not isinstance(spec, ModuleSpec):
        raise TopologySpecError(f"modules[{index}] must be a ModuleSpec, got {type(spec).__name__}: {spec!r}")
    if not isinstance(spec.name, str) or not spec.name.isidentifier():
        raise TopologySpecError(f"modules[{index}]: name must be an identifier-like str, got {spec.name!r}")
    if not isinstance(spec.language, bool):
        raise TopologySpecError(f"module {spec.name!r}: language must be a bool, got {spec.language!r}")
    if not isinstance(spec.options, Mapping):
        raise TopologySpecError(f"module {spec.name!r}: options must be a mapping, got {spec.options!r}")
    if not spec.options.keys() <= BUILD_OPTIONS:
        unknown = sorted(set(spec.options) - BUILD_OPTIONS)
        raise TopologySpecError(
            f"module {spec.name!r}: unknown option(s) {unknown}; allowed: {sorted(BUILD_OPTIONS)} "
            f"(sizes and order are ModuleSpec fields)"
        )
    for key, value in spec.sizes().items():
        if key == "order":
            if not isinstance(value, str):
                raise TopologySpecError(f"module {spec.name!r}: order must be a str, got {value!r}")
            continue
        if value is None and key == "expert_tensor_parallel_size":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise TopologySpecError(f"module {spec.name!r}: {key} must be an int >= 1, got {value!r}")


def validate_topology(
    modules: Sequence[ModuleSpec], world_size: int, release: str | Release | None = None
) -> list[ModulePlacement]:
    """Check a topology and place its modules; raises :class:`TopologySpecError` before any group exists.

    Checked: at least one module, unique names, ranges inside ``[0, world_size)``, ranges either
    disjoint or identical (colocated), no rank left out, exactly one language module, sizes
    that divide each module's range (tp × cp × pp, and etp × ep × pp for experts) and every
    layout rule of ``initialize_model_parallel`` for the release.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= MAX_RANK:
        raise TopologySpecError(f"world_size must be an int from 1 to {MAX_RANK} (2**62), got {world_size!r}")
    if isinstance(modules, (str, bytes, Mapping)) or not isinstance(modules, Sequence) or not modules:
        raise TopologySpecError(f"modules must be a non-empty list of ModuleSpec, got {modules!r}")
    for i, spec in enumerate(modules):
        _check_module(spec, i)
    seen: set[str] = set()
    repeated_names: set[str] = set()
    for spec in modules:
        (repeated_names if spec.name in seen else seen).add(spec.name)
    repeated = sorted(repeated_names)
    if repeated:
        raise TopologySpecError(f"module names must be unique; repeated: {repeated}")
    language = [spec.name for spec in modules if spec.language]
    if len(language) != 1:
        raise TopologySpecError(
            f"a topology needs exactly one language module (language=True), got {len(language)}: {language}"
        )
    ranges = {spec.name: _as_range(spec.name, spec.ranks) for spec in modules}
    for name, r in ranges.items():
        if r.stop > world_size:
            raise TopologySpecError(f"module {name!r}: ranks {_span(r)} exceed the world of {world_size} ranks")
    ordered = sorted(ranges.items(), key=lambda item: (item[1].start, item[1].stop))
    for (a, ra), (b, rb) in zip(ordered, ordered[1:], strict=False):
        if ra != rb and rb.start < ra.stop:
            raise TopologySpecError(
                f"modules {a!r} (ranks {_span(ra)}) and {b!r} (ranks {_span(rb)}) overlap without being "
                f"colocated: give them disjoint ranges or the same range"
            )
    covered, gaps = 0, []
    for _, r in ordered:
        if r.start > covered:
            gaps.append(range(covered, r.start))
        covered = max(covered, r.stop)
    if covered < world_size:
        gaps.append(range(covered, world_size))
    if gaps:
        raise TopologySpecError(
            f"ranks {', '.join(_span(g) for g in gaps)} of the world of {world_size} belong to no module: "
            f"every rank must run a module"
        )
    series = as_release(release).series
    by_range: dict[range, list[str]] = {}
    for name, r in ranges.items():  # colocated modules: one pass, not a scan per module
        by_range.setdefault(r, []).append(name)
    placements = []
    shapes: dict[tuple, MegatronLayout] = {}  # one layout per module shape
    for spec in modules:
        r = ranges[spec.name]
        placements.append(
            ModulePlacement(
                spec,
                r,
                _shape_layout(spec, r, world_size, series, shapes),
                tuple(n for n in by_range[r] if n != spec.name),
            )
        )
    return placements


def _shape_key(spec: ModuleSpec, ranks: range, extra: Mapping[str, Any]) -> tuple | None:
    """What a module's layout depends on besides its first rank; ``None``: not comparable.

    Option values are compared only when they are plain data (ints, strs, lists of ints); a
    module with a callable option gets a layout of its own.
    """
    values = []
    for key in sorted(extra):
        value = extra[key]
        if isinstance(value, (list, tuple)) and all(type(v) is int for v in value):
            value = (type(value).__name__, *value)
        elif value is not None and type(value) not in (int, str, bool):
            return None
        values.append((key, value))
    return (len(ranks), tuple(spec.sizes().items()), tuple(values))


def _shape_layout(
    spec: ModuleSpec, ranks: range, world_size: int, series: str, shapes: dict[tuple, MegatronLayout]
) -> MegatronLayout:
    """The layout of the module's shape: built for the first module of a shape, shared after.

    Every check it makes but the offset's depends on the shape alone, and the offset is checked
    here for every module (its range lies in the world; a release without rank offsets fails
    at the first module on part of the world).
    """
    tp, cp, pp = spec.tensor_model_parallel_size, spec.context_parallel_size, spec.pipeline_model_parallel_size
    if len(ranks) % (tp * cp * pp):
        raise TopologySpecError(
            f"module {spec.name!r}: its {len(ranks)} ranks ({_span(ranks)}) are not divisible by "
            f"tensor ({tp}) x context ({cp}) x pipeline ({pp}) parallel = {tp * cp * pp}"
        )
    etp = spec.expert_tensor_parallel_size or tp
    if len(ranks) % (etp * spec.expert_model_parallel_size * pp):
        raise TopologySpecError(
            f"module {spec.name!r}: its {len(ranks)} ranks are not divisible by expert tensor ({etp}) x "
            f"expert ({spec.expert_model_parallel_size}) x pipeline ({pp}) parallel = "
            f"{etp * spec.expert_model_parallel_size * pp}"
        )
    whole = ranks.start == 0 and ranks.stop == world_size
    place: dict[str, Any] = {} if whole else {"rank_offset": ranks.start, "local_world_size": len(ranks)}
    extra = {k: v for k, v in spec.options.items() if k in _LAYOUT_OPTIONS}
    key = None if whole else _shape_key(spec, ranks, extra)
    try:
        if key in shapes:
            return shapes[key]
        layout = MegatronLayout(world_size=world_size, release=series, **place, **spec.sizes(), **extra)
        if key is not None:
            shapes[key] = layout
        return layout
    except TypeError as err:
        if "rank_offset" in str(err):
            raise TopologySpecError(
                f"module {spec.name!r} on ranks {_span(ranks)} of {world_size}: megatron-core {series} cannot place "
                f"a module on part of the world (rank offsets came in 0.17)"
            ) from None
        raise TopologySpecError(f"module {spec.name!r}: {err}") from err
    except (ValueError, AssertionError, RuntimeError, KeyError) as err:
        raise TopologySpecError(f"module {spec.name!r} on ranks {_span(ranks)}: {err}") from err


_LAYOUT_OPTIONS = frozenset(
    {
        "hierarchical_context_parallel_sizes",
        "gtp_remat_size",
        "expert_gtp_remat_size",
        "num_distributed_optimizer_instances",
        "get_embedding_ranks",
        "get_position_embedding_ranks",
    }
)
