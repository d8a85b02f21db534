"""`pivotrl-pipeline simulate CONFIG [--json OUT] [--plot OUT.png]`: every paradigm on one workload.

Prints per-paradigm tokens/s per device and per-iteration stage times, then - last - one JSON line with
`ratio_vs_colocated`, `ratio_vs_best_static`, `fraction_of_fluid_bound`, `fraction_of_critical_path_bound`
and `fraction_of_tighter_bound` (shiftable over each; the tighter bound is, per iteration, the larger
makespan of the fluid and the on-policy critical-path bound). With `workload.max_staleness` ≥ 1 it adds
`ratio_vs_best_static_same_staleness` (the static split with the same staleness: verl fully-async's design)
and `ratio_vs_colocated_onpolicy` (the paper's baseline); the tighter bound is then the fluid bound.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pivotrl.config import add_override_argument
from pivotrl.errors import UserError
from pivotrl.sim.config import load_sim_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="simulator YAML, e.g. configs/sim/paper-32gpu.yaml")
    parser.add_argument("--json", dest="json_out", metavar="OUT", help="write the full report here")
    parser.add_argument("--plot", metavar="OUT.png", help="allocation-over-time figure")
    add_override_argument(parser, "workload.iterations=1")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only the final JSON line")


def _fmt_stage(it: dict[str, float]) -> str:
    return (f"rollout {it['rollout_s']:7.1f}s | reward tail {it['reward_tail_s']:7.1f}s | "
            f"train tail {it['train_tail_s']:7.1f}s | barrier {it['barrier_s']:5.1f}s | "
            f"iteration {it['total_s']:7.1f}s")


def report_text(rep: dict[str, Any]) -> str:
    lines = [f"{rep['config']}: {rep['devices']} devices ({rep['gpu']}), decisions by {rep['controller']}"]
    tps = rep["tokens_per_s_per_device"]
    for name in ("colocated", "best_static", "shiftable", "fluid_bound", "critical_path_bound",
                 "tighter_bound"):
        extra = f"  split {rep['best_static_split']}" if name == "best_static" else ""
        lines.append(f"  {name:23s} {tps[name]:10.1f} tokens/s/device{extra}")
    search = rep["static_search"]
    lines.append(f"  static search: {search['method']}, {search['splits_simulated']} of "
                 f"{search['splits_total']} splits simulated")
    for name, run in rep["runs"].items():
        conserved = run["conservation"]["conserved"]
        lines.append(f"  {name}: {run['replica_shifts']} replica shifts, conserved={conserved}")
        for it in run["iterations"]:
            lines.append(f"    iter {int(it['iteration'])}: {_fmt_stage(it)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from pivotrl.names import check_output
    from pivotrl.sim.compare import compare
    from pivotrl.sim.plot import allocation_json, plot_allocation

    cfg = load_sim_config(args.config, args.overrides)
    inputs = [args.config]
    if isinstance(getattr(cfg, "profile", None), str):  # the cost profile it reads, next to the config
        inputs.append(Path(args.config).parent / cfg.profile)
    check_output(args.json_out, inputs, "--json")
    check_output(args.plot, [*inputs, args.json_out], "--plot")
    for path in (args.json_out, args.plot):
        if path and not Path(path).parent.exists():
            raise UserError(f"{path}: directory does not exist")
    rep = compare(cfg)
    results = rep.pop("_results")
    if not all(r.finished for r in results.values()):
        bad = [k for k, r in results.items() if not r.finished]
        raise UserError(f"{args.config}: max_sim_time_s: run(s) {bad} did not finish; raise it")
    if args.json_out:
        rep["allocation"] = {k: allocation_json(v) for k, v in results.items()}
        Path(args.json_out).write_text(json.dumps(rep, indent=1, default=str))
        rep.pop("allocation")
    if args.plot:
        plot_allocation({"colocated": results["colocated"],
                         f"best static {rep['best_static_split']}": results["best_static"],
                         "shiftable": results["shiftable"]}, args.plot,
                        title=f"{cfg.name}: device roles over time")
    if not args.quiet:
        print(report_text(rep))
    keys = ("ratio_vs_colocated", "ratio_vs_best_static", "fraction_of_fluid_bound",
            "fraction_of_critical_path_bound", "fraction_of_tighter_bound")
    if rep.get("max_staleness", 0) > 0:
        keys += ("ratio_vs_best_static_same_staleness", "ratio_vs_colocated_onpolicy")
    print(json.dumps({k: round(rep[k], 4) for k in keys}))
    sys.stdout.flush()
    return 0
