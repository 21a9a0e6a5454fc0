"""Child side of ``test_layout_releases.py``: one release's own init, recorded, vs MegatronLayout.

Runs inside a process bound to one megatron-core release
(:func:`tests.support.releases.wheels.run_in_release`): that release's
``initialize_model_parallel`` runs against a recording stand-in for ``torch.distributed``, and
every recorded group is compared with
:class:`~parallel_state_ng.layout.megatron_layout.MegatronLayout` of the same release
(:func:`check_release`).
"""

from __future__ import annotations

import inspect
import itertools
import random
from typing import Any

_CURRENT = [0]  # the rank the recorded init runs as
_INIT_GROUPS = [0]  # how many recorded groups initialize_model_parallel itself created
_GLOO_ALWAYS = [False]  # the release has no create_gloo_process_groups switch


class _Group:
    """A recorded process group: its ranks, description, timeout and backend."""

    __slots__ = ("ranks", "desc", "timeout", "backend")

    def __init__(self, ranks: list[int], desc: str | None, timeout: Any = None, backend: Any = None) -> None:
        self.ranks = ranks
        self.desc = desc
        self.timeout = timeout
        self.backend = backend

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        return self.ranks.index(_CURRENT[0]) if _CURRENT[0] in self.ranks else -1


def _install_fakes(ps: Any, world: int, created: list[_Group]) -> None:
    dist = ps.torch.distributed

    def create_group(
        ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False, group_desc=None
    ):
        group = _Group(list(ranks), group_desc, timeout, backend)
        created.append(group)
        return group

    ps.create_group = create_group
    dist.is_initialized = lambda: True
    dist.is_available = lambda: True
    dist.get_world_size = lambda group=None: world if group is None else group.size()
    dist.get_rank = lambda group=None: _CURRENT[0] if group is None else group.rank()


def _run_mcore(ps: Any, cfg: dict, rank: int) -> tuple[list[_Group], str | None, BaseException | None]:
    """Run the release's init (+ all-gather groups) as ``rank``; return groups, get_all_ranks(), error."""
    created: list[_Group] = []
    _install_fakes(ps, cfg["world_size"], created)
    _CURRENT[0] = rank
    params = inspect.signature(ps.initialize_model_parallel).parameters
    kwargs = {k: v for k, v in cfg.items() if k in params}
    _GLOO_ALWAYS[0] = "create_gloo_process_groups" not in params  # a release without the switch makes them
    if "create_gloo_process_groups" in params:
        kwargs["create_gloo_process_groups"] = False
    try:
        ps.initialize_model_parallel(**kwargs)
        _INIT_GROUPS[0] = len(created)  # the groups init made (the all-gather ones come after)
        if hasattr(ps, "create_all_gather_groups"):
            ps.create_all_gather_groups(for_expert_parallelism=True)
        all_ranks = ps.get_all_ranks()
    except Exception as exc:  # the release rejects the configuration
        return created, None, exc
    finally:
        ps.destroy_model_parallel()
    return created, all_ranks, None


def _layout(cfg: dict, series: str):
    from parallel_state_ng.layout.megatron_layout import SHAPE_ARGUMENTS, MegatronLayout

    keys = [
        "world_size",
        *SHAPE_ARGUMENTS,
        "rank_offset",
        "local_world_size",
        "encoder_tensor_model_parallel_size",
        "encoder_pipeline_model_parallel_size",
        "pipeline_model_parallel_split_rank",
    ]
    return MegatronLayout(release=series, **{k: cfg[k] for k in keys if k in cfg})


def _check_plan(lay: Any, cfg: dict, rank: int, init_groups: list[_Group], gloo: bool, tag: str, out: list[str]) -> int:
    """The group plan of ``rank`` vs the release's own creation sequence, as seen by ``rank``.

    Every group the release created during init that holds ``rank`` must be a step of
    ``group_plan``, in the same order, with the same ranks, ``group_desc`` and timeout rule
    (the init's timeout, or torch's default). Returns the number of steps compared.
    """
    from parallel_state_ng.layout.plan import CreateGroup, PlanOptions, group_plan

    options = PlanOptions(
        create_gloo_process_groups=gloo,
        create_all_gather_group=bool(cfg.get("create_all_gather_group")),
        hybrid_context_parallel=bool(cfg.get("hybrid_context_parallel")),
    )
    release = [(g.desc, g.ranks, "torch" if g.timeout is None else "init") for g in init_groups if rank in g.ranks]
    ours = [(s.desc, list(s.ranks), s.timeout) for s in group_plan(lay, rank, options) if isinstance(s, CreateGroup)]
    if ours != release:
        first = next((i for i, (a, b) in enumerate(zip(ours, release)) if a != b), min(len(ours), len(release)))
        out.append(
            f"{tag}: rank {rank} plan step {first}: ours {ours[first : first + 2]}, release {release[first : first + 2]}"
        )
    return len(release)


def _desc_to_kind(desc: str) -> str | None:
    from parallel_state_ng.layout.kinds import GROUP_KINDS

    prefix = "HIERARCHICAL_CONTEXT_PARALLEL_GROUP_L"
    if desc.startswith(prefix):
        return f"hcp{desc[len(prefix) :]}"
    for name, kind in GROUP_KINDS.items():
        if kind.desc == desc:
            return name
    return None


def _check_generator(ps: Any, lay: Any, series: str, out: list[str]) -> int:
    """Every token subset of the release's own RankGenerator vs the layouts; returns checks made."""
    gtp = hasattr(ps, "_inject_gtp_remat_axis")
    checks = 0
    views = [("dense", lay.decoder), ("expert", lay.expert)]
    if lay.encoder_block is not None:  # 0.12-0.13: the encoder's own generator
        views.append(("encoder", lay.encoder_block.encoder))
    for view, layout in views:
        sizes = dict(zip(layout.dim_names, layout.shape))
        order = "-".join(layout.dim_names)
        kwargs = dict(
            tp=sizes["tp"],
            ep=sizes["ep"],
            dp=sizes["dp"],
            pp=sizes["pp"],
            cp=sizes["cp"],
            order=order,
            rank_offset=layout.rank_offset,
        )
        if gtp:
            kwargs["gtp_remat"] = sizes["gtp_remat"]
        gen = ps.RankGenerator(**kwargs)
        names = list(layout.dim_names)
        for k in range(1, len(names) + 1):
            for dims in itertools.combinations(names, k):
                checks += 1
                if gen.get_ranks("-".join(dims)) != layout.rank_enum(dims):
                    out.append(f"{series} {view} get_ranks({'-'.join(dims)!r}) differs for {layout}")
        if gtp:
            checks += 1
            if gen.get_gtp_ranks(sizes["gtp_remat"]) != layout.rank_enum("gtp_remat"):
                out.append(f"{series} {view} get_gtp_ranks differs for {layout}")
    return checks


def check_release(series: str, configs: list[dict], seed: int) -> dict:
    """Compare the release's init with MegatronLayout on ``configs``; return counts and mismatches.

    For each configuration the release's ``initialize_model_parallel`` runs against the recording
    stand-in (``create_group`` records ranks and ``group_desc``; the getters read the recorded
    groups), followed by ``create_all_gather_groups`` where the release has it. Every recorded
    group, kind by kind, is compared with the layout: the creation order of the kinds, each
    kind's full enumeration, the per-rank closed form for sampled ranks (ranks outside a
    ``rank_offset`` block included), hybrid dp×cp groups, ``get_all_ranks()``, and the exception
    type where the release rejects the configuration. The release's own ``RankGenerator`` is
    also compared token by token (every token subset, ``get_gtp_ranks``) with the dense and
    expert layouts for small worlds.
    """
    import sys

    # 0.19's destroy_model_parallel tries (and tolerates failing) to import the MoE
    # all-to-all module, which pulls in most of megatron.core (seconds): make it fail at once.
    sys.modules.setdefault("megatron.core.transformer.moe.fused_a2a", None)
    import megatron.core.parallel_state as ps

    rng = random.Random(seed)
    mismatches: list[str] = []
    stats = {"configs": 0, "rejected": 0, "kinds": 0, "groups": 0, "rank_checks": 0, "generator_checks": 0}
    for cfg in configs:
        offset = cfg.get("rank_offset", 0)
        local = cfg.get("local_world_size") or cfg["world_size"]
        current = rng.randrange(offset, offset + local)
        created, all_ranks, error = _run_mcore(ps, cfg, current)
        tag = f"{series} {cfg}"
        try:
            lay = _layout(cfg, series)
        except Exception as exc:
            # einops' EinopsError (MCore's hierarchical split of a group of the wrong size) is a
            # RuntimeError subclass; the layout raises RuntimeError (docs/differences.md).
            einops = error is not None and type(error).__name__ == "EinopsError" and isinstance(exc, RuntimeError)
            if error is None or not (isinstance(exc, type(error)) or einops):
                mismatches.append(f"{tag}: MegatronLayout raised {exc!r}, the release {error!r}")
            else:
                stats["rejected"] += 1
                stats.setdefault("rejected_as", {}).setdefault(type(error).__name__, 0)
                stats["rejected_as"][type(error).__name__] += 1
            continue
        if error is not None:
            mismatches.append(f"{tag}: the release raised {error!r}, MegatronLayout accepted")
            continue
        stats["configs"] += 1
        by_kind: dict[str, list[list[int]]] = {}
        hybrid: dict[int, list[list[int]]] = {}
        order: list[str] = []
        for group in created:
            if group.desc.startswith("HYBRID_DP_CP_GROUP_"):
                hybrid.setdefault(int(group.desc.rsplit("_", 1)[1]), []).append(group.ranks)
                continue
            kind = _desc_to_kind(group.desc)
            if kind is None:
                mismatches.append(f"{tag}: no kind for group_desc {group.desc!r}")
                continue
            if kind not in by_kind and kind not in ("dp_cp_ag", "ep_dp_ag"):
                order.append(kind)
            by_kind.setdefault(kind, []).append(group.ranks)
        if order != lay.kinds():
            mismatches.append(f"{tag}: kinds {lay.kinds()} != the release's creation order {order}")
        token_kinds = lay.token_kinds | {"dp_cp_ag", "ep_dp_ag"}
        for kind, groups in by_kind.items():
            stats["kinds"] += 1
            stats["groups"] += len(groups)
            ours = lay.enumerate(kind)
            same = ours == groups if kind in token_kinds else sorted(ours) == sorted(groups)
            if not same:
                mismatches.append(f"{tag}: {kind} enumeration differs: ours {ours[:3]}..., release {groups[:3]}...")
        if sorted(hybrid) != (lay.hybrid_group_sizes() if cfg.get("hybrid_context_parallel") else []):
            mismatches.append(f"{tag}: hybrid sizes {sorted(hybrid)} != {lay.hybrid_group_sizes()}")
        samples = {offset, offset + local - 1, current, *(rng.randrange(offset, offset + local) for _ in range(3))}
        if offset:
            samples.add(offset - 1)
        if offset + local < cfg["world_size"]:
            samples.add(offset + local)
        for rank in sorted(samples):
            for kind, groups in by_kind.items():
                stats["rank_checks"] += 1
                # every group of the kind the rank is in (several: 0.12/0.13 encoder pipelines)
                expected = [g for g in groups if rank in g]
                got = lay.groups(kind, rank)
                if got != expected:
                    mismatches.append(f"{tag}: rank {rank} {kind}: ours {got}, release {expected}")
            for size, groups in hybrid.items():
                if lay.contains(rank):
                    stats["rank_checks"] += 1
                    expected = next(g for g in groups if rank in g)
                    if lay.hybrid_group(rank, size) != expected:
                        mismatches.append(
                            f"{tag}: rank {rank} hybrid {size}: {lay.hybrid_group(rank, size)} vs {expected}"
                        )
        stats["plan_steps"] = stats.get("plan_steps", 0) + _check_plan(
            lay, cfg, current, created[: _INIT_GROUPS[0]], _GLOO_ALWAYS[0], tag, mismatches
        )
        stats["rank_checks"] += 1
        if lay.all_ranks(current) != all_ranks:
            mismatches.append(f"{tag}: rank {current} get_all_ranks {all_ranks!r}, ours {lay.all_ranks(current)!r}")
        if local <= 256:
            stats["generator_checks"] += _check_generator(ps, lay, series, mismatches)
    return {"stats": stats, "mismatches": mismatches[:40], "mismatch_count": len(mismatches)}


def _gloo_kinds() -> dict[str, str]:
    """A gloo twin's ``group_desc`` -> its kind."""
    from parallel_state_ng.layout.kinds import GROUP_KINDS

    return {kind.gloo_desc: name for name, kind in GROUP_KINDS.items() if kind.gloo_desc}


def record_layouts(series: str, configs: list[dict]) -> list[dict]:
    """The release's own ``initialize_model_parallel`` (default options) per configuration, recorded.

    For each configuration, init runs once as rank 0 against the recording stand-in (MCore asks
    every rank to create every group, so one rank records them all) with its defaults: gloo twins
    on, no all-gather or hybrid groups. Returns, per configuration, ``{"kinds": {kind: {"desc",
    "timeout", "gloo", "groups"}}}`` in the release's creation order (``timeout``: ``"init"`` when
    the release passed a timeout, else ``"torch"``; ``gloo``: the twin's desc and timeout, or
    ``None``), or ``{"error": ...}`` where the release rejects the configuration, and
    ``{"problems": [...]}`` for groups no kind explains.
    """
    import sys

    sys.modules.setdefault("megatron.core.transformer.moe.fused_a2a", None)
    import megatron.core.parallel_state as ps

    twins = _gloo_kinds()
    out = []
    for cfg in configs:
        created: list[_Group] = []
        _install_fakes(ps, cfg["world_size"], created)
        _CURRENT[0] = 0
        params = inspect.signature(ps.initialize_model_parallel).parameters
        try:
            ps.initialize_model_parallel(**{k: v for k, v in cfg.items() if k in params})
        except Exception as exc:  # the release rejects the configuration
            out.append({"error": f"{type(exc).__name__}: {exc}"})
            continue
        finally:
            ps.destroy_model_parallel()
        kinds: dict[str, dict] = {}
        gloo: dict[str, list[_Group]] = {}
        problems = []
        for group in created:
            rule = "torch" if group.timeout is None else "init"
            if group.desc in twins:
                gloo.setdefault(twins[group.desc], []).append(group)
                continue
            kind = _desc_to_kind(group.desc or "")
            if kind is None:
                problems.append(f"no kind for group_desc {group.desc!r}")
                continue
            entry = kinds.setdefault(kind, {"desc": group.desc, "timeout": rule, "gloo": None, "groups": []})
            if entry["timeout"] != rule:
                problems.append(f"{kind}: groups with timeouts {entry['timeout']} and {rule}")
            entry["groups"].append(group.ranks)
        for kind, groups in gloo.items():
            rules = {"torch" if g.timeout is None else "init" for g in groups}
            if kind not in kinds or len(rules) != 1 or [g.ranks for g in groups] != kinds[kind]["groups"]:
                problems.append(f"{kind}: gloo twins {[g.ranks for g in groups]} with timeouts {rules}")
                continue
            kinds[kind]["gloo"] = {"desc": groups[0].desc, "timeout": rules.pop()}
        out.append({"kinds": kinds, "problems": problems})
    return out
