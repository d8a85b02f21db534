"""Deployment paradigms side by side on a real Dask LocalCluster: colocated, disaggregated, shiftable, and
shiftable with one iteration of staleness (`run.max_staleness: 1`, key `shiftable_async`).

    python -m benchmarks.paradigms --quick --json OUT.json

One workload (same config, same seeds: the same prompts, the same sampling keys) runs end to end —
rollout → GenRM judge → GRPO gradients → optimizer step → new version — under each paradigm on a fresh
2-device LocalCluster (one worker per core). Throughput is *tokens processed per second per device*:
rollout tokens generated + judge tokens generated + tokens trained on, over the wall time of the measured
iterations (`window_throughput`), after one warm-up iteration that every paradigm runs the same way
(worker start-up: imports, first model loads) and before one cool-down iteration (the run's last, with
nothing after it to overlap: `measured_iterations`); the median of the per-iteration figures is kept
beside it.

Disaggregated means static devices per role. Two devices cannot give each of three roles its own device,
so the valid static splits give each device a fixed *group* of roles, time-shared colocated-style inside
the group (the way a policy's rollout and training share GPUs while the GenRM is served apart): core's
`Grouped` policy, the same the simulator's static baseline uses. Every grouping is run and the best is
reported as `best_static`; each mode's JSON entry names the core policy that ran it (`policy`).

The box is shared (other processes load its cores), so the paradigms run *interleaved*: `--repeats`
rounds, each running every configuration once (in a rotated order), and each figure is the median over the
rounds of that round's throughput. The best static split is chosen on those medians. Each device's
wall time is broken down (engine steps per role, gradient flushes, shifting, idle) from the scheduler's
accounting, and the load average is recorded, so a reader can tell where a paradigm loses time.

Printed last: `ratio_vs_colocated` and `ratio_vs_best_static` (on-policy shiftable ÷ each) and
`ratio_async_vs_colocated` (shiftable with staleness 1 ÷ on-policy colocated, the paper's baseline). With
staleness an iteration's seconds are the time since the previous one completed, so its tokens/s is the
throughput the run sees.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pivotrl.config import add_override_argument
from pivotrl.runtime.metrics import PHASES, shift_phase

GROUPINGS: dict[str, list[list[str]]] = {
    "rollout+train|reward": [["rollout", "train"], ["reward"]],
    "rollout+reward|train": [["rollout", "reward"], ["train"]],
    "rollout|reward+train": [["rollout"], ["reward", "train"]],
}


def workload(quick: bool, storage: Path, model_size: str) -> Any:
    """The one workload every paradigm runs. The planner's look-ahead and cooldown are scaled to this
    workload's stages (each lasts ~1 s on the debug model): a 10 s horizon would plan past the iteration."""
    from pivotrl.config import PipelineConfig
    from pivotrl.engines.checkpoints import ensure_model

    policy = ensure_model(storage, f"bench-policy-{model_size}", model_size, seed=11)
    judge = ensure_model(storage, f"bench-judge-{model_size}", model_size, seed=12)
    data = {
        "run": {
            "name": "paradigms",
            "seed": 0,
            "iterations": WARMUP + measured_iterations(quick) + COOLDOWN,
            "storage_root": str(storage),
        },
        "models": {
            "policy": {"name": "policy", "path": str(policy)},
            "genrm": {"name": "genrm", "path": str(judge)},
        },
        "task": {
            "name": "sort",
            # 32 x 4 = 128 samples: more than one engine batch (max_batch 32), as in any real RL iteration
            # (see docs/decisions.md#the-paradigms-benchmark-iteration-exceeds-one-engine-batch).
            "prompts_per_iteration": 32 if quick else 64,
            "group_size": 4,
            "eval_prompts": 0,
        },
        # untrained models stop when they happen to sample <eos>: geometric, long-tailed lengths
        "rollout": {
            "sampling": {"temperature": 1.0, "max_new_tokens": 96},
            "engine": {"max_batch": 32, "kv_budget_tokens": 16384},
        },
        "reward": {
            "sampling": {"temperature": 1.0, "max_new_tokens": 96},
            "engine": {"max_batch": 32, "kv_budget_tokens": 16384},
        },
        "train": {"micro_batch": 8, "lr": 1e-5},
        "cluster": {"workers": 2, "dashboard_address": None},
        "scheduler": {"horizon_s": 3.0, "cooldown_s": 0.3, "hysteresis": 0.0, "tick_s": 0.1},
    }
    return PipelineConfig.model_validate(data)


WARMUP = 1  # iterations run but not measured: worker start-up (imports, first loads) is not throughput
COOLDOWN = 1  # the last iteration, run but not measured: nothing follows it, so with staleness no next
# iteration's rollouts run in its tail as they ran in every measured one's
STALENESS_RUN = 1  # the largest `run.max_staleness` a paradigm here runs with


def window_rows(iterations: list[Any], lead: int = 0) -> list[Any]:
    """The measured iterations of one run: past the warm-up, before the cool-down; with the `lead`
    iterations before them (a completion-to-completion timing needs the one before the first)."""
    return iterations[WARMUP - lead: len(iterations) - COOLDOWN]


def measured_iterations(quick: bool) -> int:
    """Iterations measured after the warm-up: 6 (quick; fewer and one iteration's ±10 % swing on a shared
    box shows) or 8, each a whole number of staleness periods. With staleness k, short and long iterations
    alternate with a period of k + 1, and a window must close at the phase it opened at: it opens just
    after the warm-up, a long iteration (the next one's rollouts already done, their tokens before the
    window), so it closes after a long one too, with the next iteration's rollouts in flight again (hence
    the cool-down). Measured at k = 1, 5 iterations to the run's end: every round's window 1-3 % below both
    of its whole-period 4-iteration windows; 6 to the run's end, the last two lost the alternation
    (docs/decisions.md, "the window is whole staleness periods")."""
    n = 6 if quick else 8
    assert n % (STALENESS_RUN + 1) == 0
    return n


def rotated(configs: list[Any], round_: int) -> list[Any]:
    """The configurations in round `round_`'s order: each round starts one later, so none holds a fixed
    slot (the box's load drifts over a benchmark's minutes)."""
    k = round_ % len(configs)
    return configs[k:] + configs[:k]


def window_throughput(tokens: list[float], per_device: list[float]) -> float:
    """Tokens per second per device over the measured iterations as one window: their tokens over their
    device-seconds (each iteration's device-seconds are its tokens over its tokens/s/device). Not the median
    of the per-iteration figures: with staleness, iterations alternate between short ones, whose rollouts
    ran during the one before, and long ones (1.0 s with 13k tokens, then 2.0 s with 32k, on this
    workload), and the median of an odd count of them picks one kind."""
    timed = [(t, r) for t, r in zip(tokens, per_device, strict=True) if r > 0]
    device_s = sum(t / r for t, r in timed)
    return sum(t for t, _ in timed) / device_s if device_s > 0 else 0.0


def summarise(res: Any) -> dict[str, Any]:
    rows = window_rows(res.iterations)
    per_dev = [r["tokens_per_s_per_device"] for r in rows]
    tokens = [r["tokens_rollout"] + r["tokens_reward"] + r["tokens_train"] for r in rows]
    n_measured = sum(int(r["shifts"]) for r in rows)  # shifts done during the measured iterations
    end = len(res.shifts) - sum(int(r["shifts"]) for r in res.iterations[len(res.iterations) - COOLDOWN:])
    shifts = res.shifts[end - n_measured : end] if n_measured else []
    phases = {}
    for ph in PHASES:
        vals = [shift_phase(e, ph) for e in shifts]
        phases[ph] = statistics.mean(vals) if vals else 0.0
    device_time: dict[str, dict[str, float]] = {}  # per device: mean seconds per measured iteration
    for r in rows:
        for dev, d in r.get("device_time", {}).items():
            acc = device_time.setdefault(dev, {})
            for k, v in d.items():
                acc[k] = acc.get(k, 0.0) + v / len(rows)
    return {
        "tokens_per_s_per_device": window_throughput(tokens, per_dev),
        "tokens_per_s_per_device_iteration_median": statistics.median(per_dev),
        "tokens_per_s_per_device_each": per_dev,
        "iteration_seconds": [r["seconds"] for r in rows],
        "tokens_each": tokens,
        "shifts": len(shifts),
        "mean_shift_s": phases,
        "allocation": {
            k: statistics.mean(r[f"alloc_{k}"] for r in rows)
            for k in ("rollout", "reward", "train", "shifting", "idle")
        },
        "device_time": {d: {k: round(v, 3) for k, v in t.items()} for d, t in device_time.items()},
        "stage_done_s": {
            k[len("stage_") : -len("_done_s")]: statistics.median(r[k] for r in rows if k in r)
            for k in rows[0]
            if k.startswith("stage_") and k.endswith("_done_s")
        },
        "wall_s": res.wall_s,
    }


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's interleaved repeats → its figures (medians over the repeats)."""
    per_run = [r["tokens_per_s_per_device"] for r in runs]
    out = {
        "policy": runs[0]["policy"],  # core's policy that decided (name, and its groups for a static run)
        "tokens_per_s_per_device": statistics.median(per_run),
        "tokens_per_s_per_device_repeats": per_run,
        "tokens_per_s_per_device_each": [x for r in runs for x in r["tokens_per_s_per_device_each"]],
        "iteration_seconds": [x for r in runs for x in r["iteration_seconds"]],
        "tokens_each": [x for r in runs for x in r["tokens_each"]],
        "shifts": sum(r["shifts"] for r in runs),
        "shifts_per_iteration": sum(r["shifts"] for r in runs)
        / max(1, sum(len(r["iteration_seconds"]) for r in runs)),
        "wall_s": sum(r["wall_s"] for r in runs),
    }
    n_shift = [r["shifts"] for r in runs]
    out["mean_shift_s"] = {
        ph: (sum(r["mean_shift_s"][ph] * n for r, n in zip(runs, n_shift)) / sum(n_shift))
        if sum(n_shift)
        else 0.0
        for ph in runs[0]["mean_shift_s"]
    }
    for key in ("allocation", "stage_done_s"):
        out[key] = {k: statistics.median(r[key][k] for r in runs) for k in runs[0][key]}
    devs = sorted({d for r in runs for d in r["device_time"]})
    out["device_time"] = {
        d: {
            k: round(statistics.median(r["device_time"][d][k] for r in runs if d in r["device_time"]), 3)
            for k in next(r["device_time"][d] for r in runs if d in r["device_time"])
        }
        for d in devs
    }
    return out


def run_config(cfg: Any, mode: str, groups: list[list[str]] | None = None, max_staleness: int = 0) -> Any:
    """One run under `mode` (its `RunResult`); a static grouping is core's `Grouped` policy, chosen by the
    config exactly as a user's `scheduler.static_groups` is; `max_staleness` is `run.max_staleness`."""
    from pivotrl.run import run_pipeline

    cfg = cfg.model_copy(deep=True)
    cfg.run.max_staleness = max_staleness
    if groups is not None:
        cfg.scheduler.static_groups = groups
    return run_pipeline(
        cfg,
        mode=mode,
        workers=2,
        log=lambda m: None,
        progress=False,
        evaluate_policy=False,
        save_final=False,
    )


def run_mode(
    cfg: Any, mode: str, groups: list[list[str]] | None = None, max_staleness: int = 0
) -> dict[str, Any]:
    """`run_config`, summarised; the result names the policy that decided."""
    res = run_config(cfg, mode, groups, max_staleness)
    return {**summarise(res), "policy": res.policy}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, smaller iterations")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument(
        "--model-size",
        default=None,
        choices=["debug", "small"],
        help="default: debug with --quick (the 2-core box is shared), small otherwise",
    )
    ap.add_argument("--modes", default="colocated,disaggregated,shiftable,async", help=argparse.SUPPRESS)
    add_override_argument(ap, "scheduler.cooldown_s=3")  # applied to every paradigm
    ap.add_argument("--storage", type=Path, default=Path("storage/bench"))
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds over every configuration")
    args = ap.parse_args(argv)
    for name in ("distributed", "distributed.worker", "distributed.scheduler", "distributed.nanny"):
        logging.getLogger(name).setLevel(logging.ERROR)

    import torch

    torch.set_num_threads(1)
    from pivotrl.config import PipelineConfig

    size = args.model_size or ("debug" if args.quick else "small")
    args.model_size = size
    modes = args.modes.split(",")
    cfg = workload(args.quick, args.storage, size)
    if args.overrides:
        from pivotrl.config import apply_overrides

        cfg = PipelineConfig.model_validate(apply_overrides(cfg.model_dump(), args.overrides))
    t0 = time.monotonic()
    configs: list[tuple[str, str, Any, int]] = []  # (name, mode, groups of a static split, staleness)
    if "colocated" in modes:
        configs.append(("colocated", "colocated", None, 0))
    if "disaggregated" in modes:
        configs += [(f"static {name}", "disaggregated", groups, 0) for name, groups in GROUPINGS.items()]
    if "shiftable" in modes:
        configs.append(("shiftable", "shiftable", None, 0))
    if "async" in modes:  # shiftable with one iteration of staleness (run.max_staleness: 1)
        configs.append(("shiftable_async", "shiftable", None, STALENESS_RUN))
    load = [os.getloadavg()[0]] if hasattr(os, "getloadavg") else []
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in configs}
    for rep in range(args.repeats):
        for name, mode, groups, staleness in rotated(configs, rep):
            r = run_mode(cfg, mode, groups, staleness)
            runs[name].append(r)
            if load:
                load.append(os.getloadavg()[0])
            dt = " ".join(
                f"{d}[{' '.join(f'{k[:2]} {v:.2f}' for k, v in t.items() if k not in ('wall',) and v)}]"
                for d, t in r["device_time"].items()
            )
            print(
                f"repeat {rep + 1}/{args.repeats} {name:<30} {r['tokens_per_s_per_device']:8.1f} tok/s/device"
                f"  it {statistics.median(r['iteration_seconds']):.2f}s  shifts {r['shifts']:3d}  s/it: {dt}",
                flush=True,
            )
    out: dict[str, Any] = {
        "workload": {
            "model_size": args.model_size,
            "devices": 2,
            "iterations": cfg.run.iterations,
            "measured_iterations": cfg.run.iterations - WARMUP - COOLDOWN,
            "repeats": args.repeats,
            "samples_per_iteration": cfg.task.prompts_per_iteration * cfg.task.group_size,
        },
        "load_average_1m": {"min": min(load), "median": statistics.median(load), "max": max(load)}
        if load
        else None,
        "modes": {},
    }
    if "colocated" in runs:
        out["modes"]["colocated"] = combine(runs["colocated"])
    best = None
    if "disaggregated" in modes:
        static = {name: combine(runs[f"static {name}"]) for name in GROUPINGS}
        best = max(static, key=lambda k: static[k]["tokens_per_s_per_device"])
        out["modes"]["disaggregated"] = {**static[best], "split": best, "all_splits": static}
    if "shiftable" in runs:
        out["modes"]["shiftable"] = combine(runs["shiftable"])
    if "shiftable_async" in runs:
        out["modes"]["shiftable_async"] = combine(runs["shiftable_async"])
    print()
    for mode, r in out["modes"].items():
        print(
            f"{mode:<14} {r['tokens_per_s_per_device']:8.1f} tok/s/device (median of {args.repeats})"
            + (f"  split {r['split']}" if "split" in r else "")
        )
    if len(out["modes"]) < 3:
        print(json.dumps(out, indent=1))
        return 0

    for mode, r in out["modes"].items():
        ph = r["mean_shift_s"]
        print(
            f"{mode:<14} shifts {r['shifts']:3d}  mean shift: abort {ph['abort']:.3f}s offload "
            f"{ph['offload']:.3f}s fetch {ph['fetch']:.3f}s load {ph['load']:.3f}s total {ph['total']:.3f}s"
        )
    sh = out["modes"]["shiftable"]["tokens_per_s_per_device"]
    out["ratio_vs_best_static_repeats"] = [
        a / b
        for a, b in zip(
            out["modes"]["shiftable"]["tokens_per_s_per_device_repeats"],
            out["modes"]["disaggregated"]["tokens_per_s_per_device_repeats"],
        )
    ]
    # Paired view (information, not the headline): every paradigm runs the same iterations (same prompts and
    # sampling keys, so the same tokens); the ratio of one repeat's iteration i under shiftable and under
    # colocated cancels the iteration-to-iteration swing of the work itself.
    paired = [
        s / c
        for rs, rc in zip(runs["shiftable"], runs["colocated"])
        for s, c in zip(rs["tokens_per_s_per_device_each"], rc["tokens_per_s_per_device_each"])
    ]
    out["paired_ratio_vs_colocated"] = {
        "median": statistics.median(paired),
        "each": paired,
        "shiftable_faster": sum(r > 1 for r in paired),
        "n": len(paired),
    }
    out["tokens_per_s_per_device"] = {m: r["tokens_per_s_per_device"] for m, r in out["modes"].items()}
    out["best_static_split"] = best
    out["ratio_vs_colocated"] = sh / out["modes"]["colocated"]["tokens_per_s_per_device"]
    out["ratio_vs_best_static"] = sh / out["modes"]["disaggregated"]["tokens_per_s_per_device"]
    if "shiftable_async" in out["modes"]:  # against on-policy colocated, the paper's baseline
        asy = out["modes"]["shiftable_async"]["tokens_per_s_per_device"]
        out["ratio_async_vs_colocated"] = asy / out["modes"]["colocated"]["tokens_per_s_per_device"]
        out["ratio_async_vs_shiftable"] = asy / sh
    out["wall_s"] = time.monotonic() - t0
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    pr = out["paired_ratio_vs_colocated"]
    print(
        f"paired per-iteration shiftable/colocated: median {pr['median']:.3f}, "
        f"shiftable faster in {pr['shiftable_faster']}/{pr['n']} iterations"
    )
    print(f"ratio_vs_colocated   {out['ratio_vs_colocated']:.3f}")
    print(f"ratio_vs_best_static {out['ratio_vs_best_static']:.3f}")
    if "ratio_async_vs_colocated" in out:
        print(f"ratio_async_vs_colocated {out['ratio_async_vs_colocated']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
