"""`pivotrl-pipeline plan CONFIG`: a what-if table over paradigms and static splits for one workload.

Answers "which paradigm and which split fits my job?" before any GPU hour is spent: every row is a full
simulation of the user's workload with decisions made by `pivotrl.core`.
"""

from __future__ import annotations

import argparse

from pivotrl.config import add_override_argument
from pivotrl.sim.config import load_sim_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="simulator YAML describing your workload and cluster")
    parser.add_argument("--top", type=int, default=8, help="static splits to list (best first)")
    add_override_argument(parser, "cluster.devices=64")


def run(args: argparse.Namespace) -> int:
    from pivotrl.sim.compare import best_static, simulate
    from pivotrl.sim.fluid import fluid_bound

    cfg = load_sim_config(args.config, args.overrides)
    fluid = fluid_bound(cfg)["tokens_per_s_per_device"]
    rows = []
    for mode in ("colocated", "shiftable"):
        r = simulate(cfg, mode, record=False)
        rows.append((mode, "-", r))
    static, search = best_static(cfg)
    rows.append(("disaggregated", _split(static.split), static))
    best = max(r.tokens_per_s_per_device for _, _, r in rows)
    print(f"{cfg.name}: {cfg.cluster.devices} devices ({cfg.cost.gpu}), {cfg.workload.prompts_per_iteration}x"
          f"{cfg.workload.group_size} sequences/iteration, {cfg.workload.iterations} iteration(s)")
    print(f"{'paradigm':15s} {'split r/w/t':>12s} {'tok/s/dev':>10s} {'vs best':>8s} {'of fluid':>9s} "
          f"{'iter s':>8s} {'shifts':>7s}")
    for mode, split, r in sorted(rows, key=lambda x: -x[2].tokens_per_s_per_device):
        t = r.tokens_per_s_per_device
        it = sum(i["total_s"] for i in r.iterations) / max(len(r.iterations), 1)
        print(f"{mode:15s} {split:>12s} {t:10.1f} {t / best:8.2f} {t / fluid:9.2f} {it:8.1f} "
              f"{len(r.shifts):7d}")
    each = "" if cfg.search.iterations is None else f", {cfg.search.iterations} iteration(s) each"
    print(f"\nstatic splits ({search['method']}; {search['splits_simulated']} of {search['splits_total']} "
          f"simulated{each}):")
    for row in search["ranking"][: args.top]:
        t = row["tokens_per_s_per_device"]
        print(f"  {_split(row['split']):>12s} {t:10.1f} {t / best:8.2f}")
    print(f"\nfluid bound: {fluid:.1f} tokens/s/device (every device busy at peak, no tails, no shift cost)")
    return 0


def _split(split: dict[str, int] | None) -> str:
    if not split:
        return "-"
    if not {"rollout", "reward", "train"} <= set(split):   # a grouping (fewer devices than roles)
        return " | ".join(f"{k}:{v}" for k, v in split.items())
    return f"{split['rollout']}/{split['reward']}/{split['train']}"
