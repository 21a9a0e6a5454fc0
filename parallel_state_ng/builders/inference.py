"""Megatron 0.19's inference shards, each rank creating only its own groups.

:func:`build_inference_collection` returns on every rank what
``megatron.core.inference.shards.build_inference_pg_collection`` returns (the same fields, the
same ranks in the same order, ``None`` where Megatron's is ``None``), and
:func:`build_inference_collections_for_shards` what ``build_inference_pg_collections_for_shards``
returns; ``compat.install()`` serves them under Megatron's names. Megatron makes every group of
every shard on every rank (two grids plus a world-wide loop for the embedding groups); here the
window's layout is a pure :class:`~parallel_state_ng.layout.named_layout.Layout` and a rank makes
only the groups it belongs to (:class:`~parallel_state_ng.builders.grid.HyperCommGrid`, the
pipeline's agreement check, member-only creation or the split path). See docs/compat.md
("Inference shards").
"""

from __future__ import annotations

import importlib
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from parallel_state_ng.builders.grid import HyperCommGrid
from parallel_state_ng.groups.creation import destroy_groups
from parallel_state_ng.groups.factory import GroupFactory
from parallel_state_ng.groups.pipeline import agree
from parallel_state_ng.groups.registry import Lease
from parallel_state_ng.groups.split import creation_path as resolve_creation_path
from parallel_state_ng.layout.shard_spec import ShardSpec, parse_shard_specs
from parallel_state_ng.releases import current_release
from parallel_state_ng.releases import inference_shards as facts

__all__ = [
    "DestroyedGroup",
    "InferenceCollection",
    "InferenceShard",
    "InferenceSizeError",
    "build_inference_collection",
    "build_inference_collections_for_shards",
    "destroy_inference_collection",
    "SERVED_AS",
]


class InferenceSizeError(AssertionError, ValueError, ZeroDivisionError):
    """A size that cannot lay out an inference window (not an int, < 1, or not dividing it).

    Megatron asserts on the sizes (``AssertionError``), fails dividing by a size of 0
    (``ZeroDivisionError``); this error is both, and a ``ValueError``.
    """


@dataclass
class InferenceCollection:
    """The collection's fields, for when megatron-core's ``ProcessGroupCollection`` cannot be imported."""

    tp: Any = None
    cp: Any = None
    pp: Any = None
    ep: Any = None
    embd: Any = None
    pos_embd: Any = None
    dp: Any = None
    tp_cp: Any = None
    mp: Any = None
    expt_tp: Any = None
    expt_dp: Any = None
    tp_ep: Any = None
    tp_ep_pp: Any = None
    dp_cp: Any = None
    tp_dp_cp: Any = None


@dataclass
class InferenceShard:
    """One shard of :func:`build_inference_collections_for_shards` (without megatron-core 0.19).

    ``pg_collection`` is the shard's collection on its own ranks, ``None`` on every other rank.
    """

    spec: ShardSpec
    rank_offset: int
    world_size: int
    pg_collection: Any


def _megatron_module(name: str) -> Any:
    """Megatron's module ``name`` when the served release has the shards module, else ``None``."""
    if not facts.SERVED_FUNCTIONS.get(current_release().series):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _collection_class() -> type:
    """megatron-core's ``ProcessGroupCollection`` if importable, else :class:`InferenceCollection`."""
    module = sys.modules.get("megatron.core.process_groups_config")
    if module is None:
        try:
            module = importlib.import_module("megatron.core.process_groups_config")
        except ImportError:
            return InferenceCollection
    return getattr(module, "ProcessGroupCollection", InferenceCollection)


def _parallel_state() -> Any:
    """The ``parallel_state`` module that answers unset sizes, as Megatron's ``mpu`` would.

    Under ``compat.install()`` ``megatron.core.parallel_state`` is compat's; compat used without
    install is asked when it is initialized and Megatron's is not.
    """
    candidates = [sys.modules.get("megatron.core.parallel_state"), sys.modules.get("compat.parallel_state")]
    loaded = [module for module in candidates if module is not None]
    for module in loaded:
        if module.model_parallel_is_initialized():
            return module
    if loaded:
        return loaded[0]
    try:
        return importlib.import_module("megatron.core.parallel_state")
    except ImportError:
        raise ValueError(
            "a size is None and no parallel_state can supply it (megatron-core is not importable and "
            "compat.parallel_state is not initialized): pass tp_size, pp_size, cp_size, ep_size and expt_tp_size"
        ) from None


def _checked_sizes(world_size: Any, sizes: dict[str, Any]) -> dict[str, int]:
    """``sizes`` with ``dp_size`` and ``expt_dp_size``, once each is an int >= 1 and both grids tile the window."""
    for name, value in {"world_size": world_size, **sizes}.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise InferenceSizeError(f"{name} must be an int, got {name}={value!r}")
        if value < 1:
            raise InferenceSizeError(f"{name} must be >= 1, got {name}={value}")
    tp, cp, pp, ep, etp = (sizes[k] for k in ("tp_size", "cp_size", "pp_size", "ep_size", "expt_tp_size"))
    if world_size % (tp * cp * pp):
        raise InferenceSizeError(
            f"world_size ({world_size}) must be divisible by tp_size*cp_size*pp_size = {tp}*{cp}*{pp} = {tp * cp * pp}"
        )
    if world_size % (etp * ep * pp):
        raise InferenceSizeError(
            f"world_size ({world_size}) must be divisible by expt_tp_size*ep_size*pp_size = "
            f"{etp}*{ep}*{pp} = {etp * ep * pp}"
        )
    return {**sizes, "dp_size": world_size // (tp * cp * pp), "expt_dp_size": world_size // (etp * ep * pp)}


def build_inference_collection(
    world_size: int,
    tp_size: int | None = None,
    pp_size: int | None = None,
    cp_size: int | None = None,
    ep_size: int | None = None,
    expt_tp_size: int | None = None,
    use_tp_pp_dp_mapping: bool = False,
    rank_offset: int = 0,
    *,
    check_agreement: bool | None = None,
    creation_path: str | None = None,
    timeout: timedelta | None = None,
) -> Any:
    """This rank's groups of one inference model over ranks ``[rank_offset, rank_offset + world_size)``.

    Megatron's ``build_inference_pg_collection`` with the same arguments and result: a
    ``ProcessGroupCollection`` (megatron-core's, else :class:`InferenceCollection`) whose
    fields ``tp cp pp dp mp tp_cp dp_cp tp_dp_cp`` come from the dense grid (dims tp, cp, dp,
    pp; tp, cp, pp, dp with ``use_tp_pp_dp_mapping``), ``ep expt_tp expt_dp tp_ep tp_ep_pp``
    from the expert grid (expt_tp, ep, expt_dp, pp) and ``embd`` / ``pos_embd`` from the
    rank's pipeline (its first and last stage / its first stage; ``None`` on other stages).
    A size left ``None`` is the current ``parallel_state``'s (compat's under
    ``compat.install()``). A rank outside the window gets a collection whose fields are all
    ``None``; it makes no group (on the split path it joins every split without a colour).
    Atomic: when a creation fails, the groups this call made are destroyed before the error
    propagates.

    Unlike Megatron's, only the rank's own groups are created (at most 15 ``new_group`` calls,
    none outside the window), and no rank needs the others' calls except its groups' members.
    ``check_agreement`` (default: ``PSNG_AGREEMENT_CHECK``, on) first compares the arguments
    across the window's ranks; ``creation_path`` as for
    :class:`~parallel_state_ng.builders.grid.HyperCommGrid`.

    ``timeout`` (ours; Megatron's function has none): the timeout of every group of the
    collection. ``None`` (the default) is Megatron's behaviour, torch's default timeout. Pass
    the training layout's (``timedelta(minutes=distributed_timeout_minutes)``, 30 minutes
    unless set) so that, under ``PSNG_SHARE_GROUPS=process``, an inference group whose members
    equal a training group's reuses that group's communicator: the registry shares only groups
    of equal timeout, and ``None`` never equals an explicit one (see docs/compat.md, "Several
    layouts in one process"). Part of the agreement check.

    Raises:
        TypeError: ``timeout`` is not a ``datetime.timedelta`` or ``None``.
        InferenceSizeError: a size is not an int >= 1, or ``tp*cp*pp`` or ``expt_tp*ep*pp``
            does not divide ``world_size`` (an ``AssertionError`` as Megatron's).
        AssertionError: with ``use_tp_pp_dp_mapping``, the dense and expert grids have different
            pipelines (``tp*cp != expt_tp*ep`` with ``pp > 1``). Nothing is created.
        ValueError: ``rank_offset`` < 0; ``timeout`` is not positive. RuntimeError: the window
            does not fit in the world.
        ParallelConfigMismatchError: the window's ranks passed different arguments.
    """
    group_options = _timeout_options(timeout)
    sizes: dict[str, Any] = {"tp_size": tp_size, "cp_size": cp_size, "pp_size": pp_size, "ep_size": ep_size}
    sizes["expt_tp_size"] = expt_tp_size
    state = None
    for name, getter in facts.SIZE_DEFAULTS:
        if sizes[name] is None:
            state = state or _parallel_state()
            sizes[name] = getattr(state, getter)()
    derived = _checked_sizes(world_size, sizes)
    if isinstance(rank_offset, int) and not isinstance(rank_offset, bool):
        if rank_offset < 0:
            raise ValueError(f"rank_offset must be >= 0, got rank_offset={rank_offset}")
        if rank_offset + world_size > dist.get_world_size():
            raise RuntimeError(
                f"the window [rank_offset, rank_offset + world_size) = [{rank_offset}, {rank_offset + world_size}) "
                f"does not fit in the {dist.get_world_size()} ranks of the world"
            )
    mapping = bool(use_tp_pp_dp_mapping)
    tp, cp, pp, ep, etp = (derived[k] for k in ("tp_size", "cp_size", "pp_size", "ep_size", "expt_tp_size"))
    path = resolve_creation_path(creation_path)
    rank = dist.get_rank()
    dense_sizes = {"tp": tp, "cp": cp, "dp": derived["dp_size"], "pp": pp}
    expert_sizes = {"tp": etp, "ep": ep, "dp": derived["expt_dp_size"], "pp": pp}
    dims = facts.DENSE_DIMS[mapping]
    dense = HyperCommGrid([dense_sizes[d] for d in dims], list(dims), rank_offset, creation_path=path)
    dims = facts.EXPERT_DIMS[mapping]
    expert = HyperCommGrid([expert_sizes[d] for d in dims], list(dims), rank_offset, creation_path=path)
    if not dense.layout.same_groups("pp", expert.layout):
        raise AssertionError(
            f"the dense and expert grids have different pipelines (use_tp_pp_dp_mapping={use_tp_pp_dp_mapping}, "
            f"tp_size*cp_size = {tp * cp}, expt_tp_size*ep_size = {etp * ep}): the first is "
            f"{dense.layout.group_at(0, 'pp')} against {expert.layout.group_at(0, 'pp')}"
        )
    lease = Lease()  # the build's one hold on registry communicators (PSNG_SHARE_GROUPS=process)
    dense._hold_with(lease)
    expert._hold_with(lease)
    inside = dense.layout.contains(rank)
    if inside or path == "split":
        fields_compared = dict(sizes, world_size=world_size, use_tp_pp_dp_mapping=mapping, rank_offset=rank_offset)
        fields_compared["timeout"] = None if timeout is None else timeout.total_seconds()
        window = range(rank_offset, rank_offset + world_size)
        agree(fields_compared, name="build_inference_pg_collection", ranks=None if path == "split" else window,
              enabled=check_agreement, creation=path)  # fmt: skip
    if not inside and path == "member":
        return _collection_class()(**dict.fromkeys(facts.COLLECTION_FIELDS))
    embedding: dict[str, Any] = {}
    try:
        values = {name: dense.create_pg(list(d), **group_options) for name, d in facts.DENSE_FIELDS.items()}
        values.update({name: expert.create_pg(list(d), **group_options) for name, d in facts.EXPERT_FIELDS.items()})
        values.update(_embedding_groups(dense, rank, inside, path == "split", embedding, lease, group_options))
    except BaseException:  # atomic: a failed creation leaves no group of this build behind
        dense.destroy()  # gives the build's lease back
        expert.destroy()
        destroy_groups(embedding.values())
        raise
    collection = _collection_class()(**{name: values[name] for name in facts.COLLECTION_FIELDS})
    _remember_lease(collection, lease)
    return collection


def _timeout_options(timeout: Any) -> dict[str, Any]:
    """The group keyword arguments for ``timeout`` (none for ``None``: torch's default), once it is valid."""
    if timeout is None:
        return {}
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"timeout must be a datetime.timedelta or None, got timeout={timeout!r} ({type(timeout).__name__})"
        )
    if timeout <= timedelta(0):
        raise ValueError(f"timeout must be positive, got timeout={timeout!r}")
    return {"timeout": timeout}


# id(collection) -> (a weak reference to it, the lease its build holds)
_LEASES: dict[int, tuple[Any, Lease]] = {}


def _remember_lease(collection: Any, lease: Lease) -> None:
    """Keep ``lease`` for :func:`destroy_inference_collection` of ``collection`` (while it lives)."""
    if not len(lease):
        return
    key = id(collection)
    try:
        ref: Any = weakref.ref(collection, lambda _ref: _LEASES.pop(key, None))
    except TypeError:  # a collection class without weak references: held until destroyed
        ref = lambda: collection  # noqa: E731
    _LEASES[key] = (ref, lease)


def _lease_of(collection: Any) -> Lease | None:
    """The lease :func:`build_inference_collection` took for ``collection``, handed over once."""
    entry = _LEASES.get(id(collection))
    if entry is None or entry[0]() is not collection:
        return None
    del _LEASES[id(collection)]
    return entry[1]


def _embedding_groups(
    dense: HyperCommGrid,
    rank: int,
    inside: bool,
    split: bool,
    out: dict[str, Any],
    lease: Lease,
    group_options: dict[str, Any],
) -> dict[str, Any]:
    """``embd`` (first and last stage of the rank's pipeline) and ``pos_embd`` (its first stage), into ``out``."""
    pipeline = dense.layout.group_ranks(rank, "pp") if inside else None
    wanted = {
        "embd": None if pipeline is None else pipeline[:1] if len(pipeline) == 1 else [pipeline[0], pipeline[-1]],
        "pos_embd": None if pipeline is None else pipeline[:1],
    }
    # on the split path every rank of the world joins each kind's one split
    factory = GroupFactory(path="split" if split else "member", lease=lease)
    for name, ranks in wanted.items():
        member = ranks if ranks is not None and rank in ranks else None
        out[name], _ = factory.group(member, kind=name, **group_options)
    return out


def build_inference_collections_for_shards(
    total_world_size: int,
    shards: str | Sequence[Any],
    use_tp_pp_dp_mapping: bool = False,
    *,
    check_agreement: bool | None = None,
    creation_path: str | None = None,
    timeout: timedelta | None = None,
) -> list[Any]:
    """One ``InferenceShard`` per shard of ``shards``, laid out one after the other from rank 0.

    Megatron's ``build_inference_pg_collections_for_shards`` with the same arguments and
    result: ``shards`` is what ``normalize_shard_specs`` takes (a spec string such as
    ``"tp=2,dp=1+tp=1,dp=2"``, a list of specs or of dicts), parsed by megatron-core 0.19's
    parser and returned as its ``InferenceShard`` objects when the release has them (else by
    :func:`~parallel_state_ng.layout.shard_spec.parse_shard_specs`, as :class:`InferenceShard`).
    Shard ``i`` holds ``tp*pp*dp`` ranks starting where shard ``i-1`` ends; its
    ``pg_collection`` is this rank's collection on the shard's ranks and ``None`` elsewhere.

    Only the rank's own shard is built (:func:`build_inference_collection`); on the split
    path every rank joins every shard's splits, as creation there needs. ``timeout`` (ours):
    every shard's groups' timeout, as for :func:`build_inference_collection` (``None``:
    torch's default, Megatron's behaviour).

    Raises:
        AssertionError, ValueError, TypeError: a bad spec (the parser's exception types), or
            sizes a shard cannot be laid out with (see :func:`build_inference_collection`);
            a ``timeout`` that is not a positive ``timedelta`` or ``None`` (checked first).
    """
    _timeout_options(timeout)
    shards_module = _megatron_module(facts.SHARDS_MODULE)
    if shards_module is not None:
        specs = importlib.import_module(facts.SPEC_MODULE).normalize_shard_specs(shards, total_world_size)
        shard_class: type = shards_module.InferenceShard
    else:
        specs, shard_class = parse_shard_specs(shards, total_world_size), InferenceShard
    path = resolve_creation_path(creation_path)
    rank = dist.get_rank()
    out, offset = [], 0
    for index, spec in enumerate(specs):
        size = spec.tp * spec.pp * spec.dp
        assert offset + size <= total_world_size, (
            f"shard {index} ({spec}) needs ranks [{offset}, {offset + size}) but total_world_size is {total_world_size}"
        )
        member = offset <= rank < offset + size
        collection = None
        if member or path == "split":
            built = build_inference_collection(
                size, spec.tp, spec.pp, spec.cp, spec.ep, spec.expt_tp, use_tp_pp_dp_mapping, offset,
                check_agreement=check_agreement, creation_path=path, timeout=timeout,
            )  # fmt: skip
            collection = built if member else None
        out.append(shard_class(spec=spec, rank_offset=offset, world_size=size, pg_collection=collection))
        offset += size
    return out


class DestroyedGroup:
    """What a field of a destroyed inference collection holds: any use raises ``RuntimeError``.

    A gloo group keeps answering collectives after ``destroy_process_group`` (an NCCL one may
    crash or hang), so a collection used after :func:`destroy_inference_collection` would not
    fail by itself; this stand-in names the field and the cause instead. (A
    ``torch.distributed`` collective given it fails with torch's ``ValueError`` "Process group
    <the inference collection's 'dp' group, destroyed by destroy_inference_collection> is not
    initialized ...", raised while torch logs this error.)
    """

    __slots__ = ("field",)

    def __init__(self, field: str) -> None:
        self.field = field

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends probe dunders with getattr(..., default)
            raise AttributeError(name)
        raise RuntimeError(
            f"the inference collection's {self.field!r} group was destroyed by destroy_inference_collection "
            f"(asked for .{name}); build a new collection with build_inference_collection"
        )

    def __repr__(self) -> str:  # torch names the group by it when it refuses one it does not know
        return f"<the inference collection's {self.field!r} group, destroyed by destroy_inference_collection>"


def destroy_inference_collection(collection: Any) -> int:
    """Destroy the groups of a collection from :func:`build_inference_collection`; returns how many.

    Each field that held a group then holds a :class:`DestroyedGroup` (using it, e.g.
    ``.size()`` or in a collective, raises an error naming the field); destroying the
    collection again, or ``None``, destroys nothing and returns 0. Under
    ``PSNG_SHARE_GROUPS=process`` a group another live layout holds stays alive for that layout.
    """
    if collection is None:
        return 0
    fields = vars(collection)
    done = destroy_groups(fields.values(), lease=_lease_of(collection))
    for name, value in list(fields.items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(collection, name, DestroyedGroup(name))
    return done


#: Megatron's name -> the function here that ``compat.install()`` serves under it (for the
#: names :data:`parallel_state_ng.releases.inference_shards.SERVED_FUNCTIONS` lists).
SERVED_AS: dict[str, Any] = {
    "build_inference_pg_collection": build_inference_collection,
    "build_inference_pg_collections_for_shards": build_inference_collections_for_shards,
}
