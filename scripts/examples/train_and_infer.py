"""An RL-shaped job on CPU processes: train in one parallel layout, run inference in another.

``python -m scripts.examples train_and_infer --megatron-path DIR`` (megatron-core 0.19+, e.g. the
unzipped 0.19.2 wheel) starts a gloo world of tp x pp x dp CPU processes
(:func:`scripts.harness.worlds.run_on_world`, a ``GlooWorld``) and, in every rank
(:mod:`scripts.examples.gpt.colocated`):

1. trains the tiny GPT of ``scripts/examples/gpt/`` from ``build_megatron_groups`` (the collection
   path, no Megatron globals; default tp2 pp2 dp2) for ``--steps - 1`` steps;
2. builds the colocated inference layout (``--infer-tp``, pp 1, dp = world / infer-tp) with
   ``build_inference_collection`` (what ``build_inference_pg_collection`` serves);
3. moves the weights into a ``GPTModel`` over that collection and runs a forward pass on a fixed
   batch, whose logits must equal a one-rank model's within ``colocated.LOGITS_TOLERANCE``;
4. once the weights are gathered, puts to sleep the training groups the inference layout does not
   borrow from the registry (issue 51: ``parallel_state_ng.groups.sleep``; on gloo they are
   fenced, a collective on them refused), destroys the inference layout, wakes them;
5. takes the last training step, which must be bit-identical (loss, gradient norm, parameter
   digest) to the same run without the inference phase;
6. runs ``--cycles`` (default 50) sleep/wake cycles of the whole training layout and reports this
   process's file descriptors, sockets, threads and groups awake and asleep, at the first cycle
   and the last, and the mean sleep and wake times.

The run with the inference phase has the process-wide communicator registry on
(``set_group_sharing("process")``) and builds the inference layout with the training's timeout,
so the inference groups reuse the training layout's communicators; after the inference
layout's destroy the registry must hold exactly the training layout's groups, all alive. The
reference run has sharing off. It also prints the communicators per rank of both layouts,
measured under each sharing setting (off, ``1``, ``process``).
Bad options are reported before any process starts (exit code 2). See docs/results/training.md.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from typing import Any

from scripts.examples.gpt.config import TrainConfig, TrainOptionError, validate


def check_inference_layout(cfg: TrainConfig, infer_tp: Any) -> None:
    """Raise :class:`TrainOptionError` when a tp ``infer_tp`` pp 1 model cannot run on ``cfg``'s world."""
    errors = []
    if isinstance(infer_tp, bool) or not isinstance(infer_tp, int) or infer_tp < 1:
        raise TrainOptionError(f"--infer-tp must be an integer >= 1, got {infer_tp!r}")
    if cfg.world_size % infer_tp:
        errors.append(
            f"--infer-tp {infer_tp} does not divide the world of tp*pp*dp = {cfg.world_size} ranks "
            "(the inference layout is colocated: tp x pp 1 x dp on the same ranks)"
        )
    if cfg.heads % infer_tp:
        errors.append(f"--infer-tp {infer_tp} does not divide the model's --heads {cfg.heads}")
    if cfg.vocab % infer_tp:
        errors.append(f"--infer-tp {infer_tp} does not divide the model's --vocab {cfg.vocab}")
    if errors:
        raise TrainOptionError("invalid inference layout:\n  " + "\n  ".join(errors))


def _combined_digest(results: list[dict], key: str) -> str:
    return hashlib.sha256("".join(r[key]["digest"] for r in results).encode()).hexdigest()


def _sleep_summary(results: list[dict]) -> dict[str, Any]:
    """The sleep during inference and the cycles, over the ranks: growth, refusal, slowest times."""
    from parallel_state_ng.testing.resources import grown

    phases = [r["with_inference"]["inference"]["sleep"] for r in results]
    cycles = [r["with_inference"]["cycles"] for r in results]
    out: dict[str, Any] = {
        "phases": phases,
        "refused": all(p["refused"] for p in phases),
        "asleep holds no more": all(not grown(p["awake"], p["asleep"]) for p in phases),
        "woken holds no more": all(not grown(p["awake"], p["woken"]) for p in phases),
        "seconds": {k: max(p[f"{k} seconds"] for p in phases) for k in ("sleep", "wake")},
    }
    if cycles[0] is not None:
        out["cycles"] = cycles
        out["cycle growth"] = [
            {w: grown(c[w][0], c[w][-1]) for w in ("awake", "asleep")} for c in cycles
        ]  # fmt: skip
        out["no growth"] = not any(g["awake"] or g["asleep"] for g in out["cycle growth"])
        out["mean seconds"] = {k: max(c["mean seconds"][k] for c in cycles) for k in ("sleep", "wake")}
    return out


def summarize(results: list[dict]) -> dict[str, Any]:
    """What the ranks' results show: losses, grad norms, digests, logits diff, communicators, sleep."""
    losses = {k: next(r[k]["losses"] for r in results if r[k]["losses"]) for k in ("reference", "with_inference")}
    inference = [r["with_inference"]["inference"] for r in results]
    return {
        "losses": losses,
        "grad_norms": {k: results[0][k]["grad_norms"] for k in ("reference", "with_inference")},
        "digests": {k: _combined_digest(results, k) for k in ("reference", "with_inference")},
        "identical": all(
            r["reference"][f] == r["with_inference"][f] for r in results for f in ("losses", "grad_norms", "digest")
        ),
        "max abs diff": max(i["max abs diff"] for i in inference),
        "inference": inference,
        "registry after destroy": all(
            i["after destroy"]["exactly training"] and i["after destroy"]["holders"] == [1] for i in inference
        )
        and all(r["communicators"]["process-wide registry"]["after destroy"]["exactly training"] for r in results),
        "communicators": [r["communicators"] for r in results],
        "globals initialized": any(r["globals initialized"] for r in results),
        "sleep": _sleep_summary(results),
    }


def render(cfg: TrainConfig, infer_tp: int, summary: dict[str, Any], tolerance: float) -> list[str]:
    """The report's lines (``tolerance``: the logits' allowed max abs diff)."""
    ref, rl = summary["losses"]["reference"], summary["losses"]["with_inference"]
    norms_ref, norms_rl = summary["grad_norms"]["reference"], summary["grad_norms"]["with_inference"]
    first = cfg.steps - 1
    lines = []
    for step in range(cfg.steps):
        if step == first:
            lines.append(f"inference: tp{infer_tp} pp1 dp{cfg.world_size // infer_tp} on the same ranks")
            for entry in summary["inference"][::infer_tp]:
                lines.append(
                    f"  dp replica {entry['dp rank']} (ranks {entry['inference ranks']['tp']}): logits "
                    f"{entry['logits shape']}, max abs diff vs the one-rank model {entry['max abs diff']:.3g}"
                )
            lines.append(
                f"  max abs logits diff (all ranks): {summary['max abs diff']:.3g} (tolerance {tolerance:g}); "
                "inference groups destroyed"
            )
        lines.append(
            f"step {step + 1}: loss {rl[step]:.6f}  grad norm {norms_rl[step]:.6f}   "
            f"(without inference: loss {ref[step]:.6f}  grad norm {norms_ref[step]:.6f})"
        )
    lines.append(f"parameter digest, with inference:    {summary['digests']['with_inference']}")
    lines.append(f"parameter digest, without inference: {summary['digests']['reference']}")
    lines.append(f"step {cfg.steps} bit-identical with and without the inference phase: {summary['identical']}")
    lines.append("")
    after = summary["inference"][0]["after destroy"]
    lines.append(
        f"registry on (the run with inference): after the inference layout's destroy it holds exactly the "
        f"training layout's groups, all alive: {summary['registry after destroy']} "
        f"(rank 0: {after['registry holds']} of {after['training groups']})"
    )
    lines.append("")
    lines.append("communicators per rank, measured (process groups created, the world group not counted):")
    lines.append("          sharing off (0)            per build (1)              process-wide registry (process)")
    lines.append("  rank    training inference both    training inference both    training inference both  shared")
    for rank, counts in enumerate(summary["communicators"]):
        cells = []
        for label in ("off", "per build (1)", "process-wide registry"):
            c = counts[label]
            cells.append(f"{c['training']:>8} {c['inference']:>9} {c['both']:>4}")
        registry = counts["process-wide registry"]
        shared = f"{registry['inference shared']}/{registry['inference distinct']}"
        lines.append(f"  {rank:>4}    " + "    ".join(cells) + f"  {shared:>6}")
    lines.append(
        "  inference: groups the inference build added; shared: the inference collection's distinct groups "
        "that are training groups (registry)"
    )
    lines.append("")
    lines.extend(render_sleep(summary["sleep"]))
    return lines


def _counts(c: dict[str, int]) -> str:
    from parallel_state_ng.testing.resources import RESOURCE_KEYS

    return " ".join(f"{c[k]:>4}" for k in RESOURCE_KEYS)


def render_sleep(sleep: dict[str, Any]) -> list[str]:
    """The report's lines on sleep and wake (issue 51): during inference, then the cycles."""
    from parallel_state_ng.testing.resources import RESOURCE_KEYS

    first = sleep["phases"][0]
    header = " ".join(f"{k[:4]:>4}" for k in RESOURCE_KEYS)
    lines = [
        f"sleep during inference: rank 0: {first['slept groups']} of {first['training groups']} training groups "
        f"asleep ({first['mechanisms']}), {first['lent awake']} lent to the inference layout stayed awake; "
        f"a collective on a sleeping group refused at once (all ranks): {sleep['refused']}; slowest sleep "
        f"{sleep['seconds']['sleep']:.4f} s, wake {sleep['seconds']['wake']:.4f} s",
        "this process's resources (fds, sockets, Python threads, native threads, torch's groups, the engine's "
        "live groups):",
        f"  rank    awake: {header}    asleep: {header}    woken: {header}",
    ]
    for rank, p in enumerate(sleep["phases"]):
        lines.append(f"  {rank:>4}           {_counts(p['awake'])}            {_counts(p['asleep'])}           "
                     f"{_counts(p['woken'])}")  # fmt: skip
    lines.append(
        f"  asleep holds no more than awake: {sleep['asleep holds no more']}; woken no more than awake: "
        f"{sleep['woken holds no more']} (gloo is fenced: nothing is freed either)"
    )
    if "cycles" not in sleep:
        return lines
    n = sleep["cycles"][0]["cycles"]
    lines += [
        "",
        f"{n} sleep/wake cycles of the whole training layout (after a warm-up cycle): growth from the first "
        f"cycle to the last, awake and asleep, on every rank: {'none' if sleep['no growth'] else 'SOME'}; mean "
        f"sleep {sleep['mean seconds']['sleep']:.4f} s, wake {sleep['mean seconds']['wake']:.4f} s (slowest rank, "
        "each with its agreement round)",
        f"  rank    awake, first: {header}    asleep, first: {header}    asleep, last: {header}    "
        f"awake, last: {header}",
    ]
    for rank, c in enumerate(sleep["cycles"]):
        lines.append(f"  {rank:>4}                  {_counts(c['awake'][0])}                   "
                     f"{_counts(c['asleep'][0])}                  {_counts(c['asleep'][-1])}                 "
                     f"{_counts(c['awake'][-1])}")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the job on a fresh gloo world, print the report; 0 when every check holds."""
    parser = argparse.ArgumentParser(
        prog="python -m scripts.examples train_and_infer", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--megatron-path", default=os.environ.get("PSNG_MEGATRON_PATH"),
                        help="directory holding megatron-core 0.19+ (default: $PSNG_MEGATRON_PATH)")  # fmt: skip
    parser.add_argument("--tp", type=int, default=2, help="training tensor-parallel size (default 2)")
    parser.add_argument("--pp", type=int, default=2, help="training pipeline-parallel size (default 2)")
    parser.add_argument("--dp", type=int, default=2, help="training data-parallel size (default 2)")
    parser.add_argument("--infer-tp", type=int, default=4, help="inference tensor-parallel size, pp 1 (default 4)")
    parser.add_argument("--steps", type=int, default=3, help="training steps; inference before the last (default 3)")
    cycles = "sleep/wake cycles of the training layout at the end, counted for leaks (default 50)"
    parser.add_argument("--cycles", type=int, default=50, help=cycles)
    args = parser.parse_args(argv)
    cfg = TrainConfig(tp=args.tp, pp=args.pp, dp=args.dp, steps=args.steps, megatron_path=args.megatron_path)
    try:
        validate(cfg)
        check_inference_layout(cfg, args.infer_tp)
        if args.cycles < 0:
            raise TrainOptionError(f"--cycles must be >= 0, got {args.cycles}")
        if args.steps < 2:
            raise TrainOptionError(f"--steps must be >= 2 (inference runs before the last step), got {args.steps}")
    except TrainOptionError as error:
        parser.error(str(error))

    from scripts.examples.gpt import colocated
    from scripts.harness.worlds import QUIET, run_on_world

    print(
        f"GPT {cfg.num_layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, vocab {cfg.vocab}, seq {cfg.seq}; "
        f"{cfg.world_size} CPU processes (gloo); training tp{cfg.tp} pp{cfg.pp} dp{cfg.dp} from build_megatron_groups"
    )
    t0 = time.perf_counter()
    results = run_on_world(
        cfg.world_size, colocated.train_and_infer_rank, cfg, args.infer_tp, args.cycles, timeout=900, env=QUIET
    )
    summary = summarize(results)
    print("\n".join(render(cfg, args.infer_tp, summary, colocated.LOGITS_TOLERANCE)))
    seconds = max(r["seconds"]["with inference"] for r in results)
    print(f"wall time: {time.perf_counter() - t0:.1f} s (slowest rank's run with inference: {seconds:.1f} s)")
    ok = (
        summary["identical"]
        and summary["registry after destroy"]
        and summary["max abs diff"] <= colocated.LOGITS_TOLERANCE
        and not summary["globals initialized"]
        and summary["sleep"]["refused"]
        and summary["sleep"].get("no growth", True)
    )
    return 0 if ok else 1


if __name__ == "__main__":
    from scripts.harness.registry import moved

    moved("examples", "train_and_infer")
