"""Deployment paradigms side by side on a real Dask LocalCluster: colocated, disaggregated, shiftable.

    python -m benchmarks.paradigms --quick --json OUT.json

One workload (same config, same seeds: the same prompts, the same sampling keys) runs end to end —
rollout → GenRM judge → GRPO gradients → optimizer step → new version — under each paradigm on a fresh
2-device LocalCluster (one worker per core). Throughput is *tokens processed per second per device*:
rollout tokens generated + judge tokens generated + tokens trained on, over each iteration's wall time;
the figure per paradigm is the median over the measured iterations, after one warm-up iteration that
every paradigm runs the same way (worker start-up: imports, first model loads).

Disaggregated means static devices per role. Two devices cannot give each of three roles its own device,
so the valid static splits give each device a fixed *group* of roles, time-shared colocated-style inside
the group (the way a policy's rollout and training share GPUs while the GenRM is served apart); every
grouping is run and the best is reported as `best_static`.

Printed last: `ratio_vs_colocated` and `ratio_vs_best_static` (shiftable ÷ each).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pivotrl.config import add_override_argument

GROUPINGS: dict[str, list[list[str]]] = {
    "rollout+train|reward": [["rollout", "train"], ["reward"]],
    "rollout+reward|train": [["rollout", "reward"], ["train"]],
    "rollout|reward+train": [["rollout"], ["reward", "train"]],
}


def workload(quick: bool, storage: Path, model_size: str) -> Any:
    """The one workload every paradigm runs. The planner's look-ahead and cooldown are scaled to this
    workload's stages (each lasts ~1 s on the debug model): a 10 s horizon would plan past the iteration."""
    from pivotrl.config import PipelineConfig
    from pivotrl.engines.models import ensure_model

    policy = ensure_model(storage, f"bench-policy-{model_size}", model_size, seed=11)
    judge = ensure_model(storage, f"bench-judge-{model_size}", model_size, seed=12)
    data = {
        "run": {
            "name": "paradigms",
            "seed": 0,
            "iterations": WARMUP + (4 if quick else 8),
            "storage_root": str(storage),
        },
        "models": {
            "policy": {"name": "policy", "path": str(policy)},
            "genrm": {"name": "genrm", "path": str(judge)},
        },
        "task": {
            "name": "sort",
            "prompts_per_iteration": 8 if quick else 16,
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


def summarise(res: Any) -> dict[str, Any]:
    rows = res.iterations[WARMUP:]
    per_dev = [r["tokens_per_s_per_device"] for r in rows]
    shifts = res.shifts
    phases = {}
    for ph in ("abort", "offload", "fetch", "load", "total"):
        vals = [e["timings"].get(ph, 0.0) for e in shifts]
        phases[ph] = statistics.mean(vals) if vals else 0.0
    return {
        "tokens_per_s_per_device": statistics.median(per_dev),
        "tokens_per_s_per_device_each": per_dev,
        "iteration_seconds": [r["seconds"] for r in rows],
        "tokens_each": [r["tokens_rollout"] + r["tokens_reward"] + r["tokens_train"] for r in rows],
        "shifts": len(shifts),
        "mean_shift_s": phases,
        "allocation": {
            k: statistics.mean(r[f"alloc_{k}"] for r in rows)
            for k in ("rollout", "reward", "train", "shifting", "idle")
        },
        "wall_s": res.wall_s,
    }


def run_mode(cfg: Any, mode: str, control: Any = None) -> dict[str, Any]:
    from pivotrl.runtime.driver import run_pipeline

    res = run_pipeline(
        cfg,
        mode=mode,
        workers=2,
        log=lambda m: None,
        progress=False,
        evaluate_policy=False,
        save_final=False,
        control=control,
    )
    return summarise(res)


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
    ap.add_argument("--modes", default="colocated,disaggregated,shiftable", help=argparse.SUPPRESS)
    add_override_argument(ap, "scheduler.cooldown_s=3")  # applied to every paradigm
    ap.add_argument("--storage", type=Path, default=Path("storage/bench"))
    args = ap.parse_args(argv)
    for name in ("distributed", "distributed.worker", "distributed.scheduler", "distributed.nanny"):
        logging.getLogger(name).setLevel(logging.ERROR)

    import torch

    torch.set_num_threads(1)
    from pivotrl.config import PipelineConfig
    from pivotrl.runtime.control import StaticGroupsControl

    size = args.model_size or ("debug" if args.quick else "small")
    args.model_size = size
    modes = args.modes.split(",")
    cfg = workload(args.quick, args.storage, size)
    if args.overrides:
        from pivotrl.config import apply_overrides

        cfg = PipelineConfig.model_validate(apply_overrides(cfg.model_dump(), args.overrides))
    t0 = time.monotonic()
    out: dict[str, Any] = {
        "workload": {
            "model_size": args.model_size,
            "devices": 2,
            "iterations": cfg.run.iterations,
            "samples_per_iteration": cfg.task.prompts_per_iteration * cfg.task.group_size,
        },
        "modes": {},
    }
    if "colocated" in modes:
        out["modes"]["colocated"] = run_mode(cfg, "colocated")
        print(
            f"colocated {out['modes']['colocated']['tokens_per_s_per_device']:8.1f} tok/s/device", flush=True
        )
    best = None
    if "disaggregated" in modes:
        static: dict[str, Any] = {}
        for name, groups in GROUPINGS.items():
            static[name] = run_mode(cfg, "disaggregated", control=StaticGroupsControl(groups))
            print(
                f"static {name:<22} {static[name]['tokens_per_s_per_device']:8.1f} tok/s/device", flush=True
            )
        best = max(static, key=lambda k: static[k]["tokens_per_s_per_device"])
        out["modes"]["disaggregated"] = {**static[best], "split": best, "all_splits": static}
    if "shiftable" in modes:
        out["modes"]["shiftable"] = run_mode(cfg, "shiftable")
        print(
            f"shiftable {out['modes']['shiftable']['tokens_per_s_per_device']:8.1f} tok/s/device", flush=True
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
    out["tokens_per_s_per_device"] = {m: r["tokens_per_s_per_device"] for m, r in out["modes"].items()}
    out["best_static_split"] = best
    out["ratio_vs_colocated"] = sh / out["modes"]["colocated"]["tokens_per_s_per_device"]
    out["ratio_vs_best_static"] = sh / out["modes"]["disaggregated"]["tokens_per_s_per_device"]
    out["wall_s"] = time.monotonic() - t0
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    print(f"ratio_vs_colocated   {out['ratio_vs_colocated']:.3f}")
    print(f"ratio_vs_best_static {out['ratio_vs_best_static']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
