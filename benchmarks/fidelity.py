"""Simulator fidelity: the paradigms workload on the real 2-worker CPU cluster, then the same workload in the
simulator from a profile measured in those very runs, tokens/s per device side by side.

    python -m benchmarks.fidelity --quick --json OUT.json

Every configuration of `benchmarks.paradigms` runs for real (colocated, each static grouping, shiftable
on-policy and with `run.max_staleness: 1`), in `--repeats` interleaved rounds (default 5; rotated order, as
`benchmarks.paradigms` does). On this shared 2-core box one run of a configuration moves by ±15 % from the
next, so each run is compared with a simulation from its *own* profile (`paired_errors`): the step lines
and prefill rates (least squares through every step of the run's measured window: the controller's
`step_totals`, `window_line`), its train rate, shift, barrier and sync times (on-policy, the control
plane's part of the barrier too), with no second slowdown for the control plane (the run's costs were
measured beside it). The rest is read off all the runs: the
sequences' lengths (every sample's prompt, response, judge prompt and critique), the train rate's
data-parallel efficiency (one train replica in the static groupings against two at once in colocated),
the shift costs where a run has no shifts, and the control plane's part of the barrier with staleness
(where the next iteration starts before it). No constant is typed in. Both sides are measured the
same way: the mean over measured iterations of the time from one iteration's completion to the next's (a
window: with staleness, short and long iterations alternate), and tokens/s per device is the real run's
mean tokens per iteration over it. A configuration's `error` is the median over its rounds of sim / real −
1, and `max_abs_error` the largest |error| over the paradigms; printed last.

Beside it, `error_pooled_profile` / `max_abs_error_pooled_profile`: one profile pooled over every run of
every configuration (with `control_cores`, the cores' worth of CPU the driver and scheduler take beside
the devices), one simulation per configuration against the median run: that also asks the simulator to
predict a run at a speed the host had at other minutes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.paradigms import (
    COOLDOWN,
    GROUPINGS,
    STALENESS_RUN,
    WARMUP,
    rotated,
    run_config,
    window_rows,
    workload,
)
from pivotrl.runtime.metrics import shift_phase
from pivotrl.sim.costs import shared_core_slowdown

ROLES = ("rollout", "reward", "train")


def measured(res: Any) -> dict[str, Any]:
    rows = window_rows(res.iterations)
    # completion to completion, as the simulator's side: an iteration's own `seconds` start after the
    # driver's bookkeeping of the one before, which is part of the barrier between them
    secs = [float(b["elapsed_s"]) - float(a["elapsed_s"])
            for a, b in itertools.pairwise(window_rows(res.iterations, lead=1))]
    tokens = [r["tokens_rollout"] + r["tokens_reward"] + r["tokens_train"] for r in rows]
    dev = {k: statistics.mean(sum(d.get(k, 0.0) for d in r["device_time"].values()) for r in rows)
           for k in ("rollout", "reward", "train", "flush", "shifting", "sync", "idle")}
    return {"iteration_s": statistics.median(secs), "iteration_s_each": secs, "device_s_per_iteration": dev,
            "apply_s": statistics.median(float(r.get("train_apply_s", 0.0)) for r in rows),
            "tokens_per_iteration": statistics.mean(tokens),
            "tokens_per_s_per_device": sum(tokens) / sum(secs) / res.devices}


def control_s(runs: list[Any]) -> float:
    """The barrier's control-plane part: each on-policy iteration's `barrier_before_s` (the previous one's
    last train item to this one's first request, on the scheduler's clock) less the driver's optimizer step
    inside it (the previous iteration's `train_apply_s`), the median over the runs' measured iterations."""
    gaps = [float(r["barrier_before_s"]) - float(prev.get("train_apply_s", 0.0))
            for res in runs for prev, r in itertools.pairwise(res.iterations[WARMUP - 1:])
            if "barrier_before_s" in r]
    return max(0.0, statistics.median(gaps)) if gaps else 0.0


def control_cores(runs: list[Any]) -> float:
    """Cores' worth of control-plane work the devices' cores share (the simulator's `cost.control_cores`):
    over the runs' measured iterations, the driver process's CPU seconds (driver and scheduler; a row's
    `driver_cpu_s` runs from the previous completion) less the optimizer step the barrier already prices
    (`train_apply_s`), over the seconds from completion to completion; 0 without any."""
    cpu = secs = 0.0
    for res in runs:
        for a, b in itertools.pairwise(window_rows(res.iterations, lead=1)):
            if "driver_cpu_s" in b:
                cpu += float(b["driver_cpu_s"]) - float(b.get("train_apply_s", 0.0))
                secs += float(b["elapsed_s"]) - float(a["elapsed_s"])
    return max(0.0, cpu / secs) if secs > 0 else 0.0


def combined(results: list[Any]) -> dict[str, Any]:
    """One configuration's rounds: each run `measured`, the figures the median over the runs."""
    each = [measured(res) for res in results]
    tps = [m["tokens_per_s_per_device"] for m in each]
    mid = sorted(range(len(each)), key=lambda i: tps[i])[(len(each) - 1) // 2]
    return {**each[mid], "tokens_per_s_per_device": statistics.median(tps),
            "tokens_per_s_per_device_rounds": tps,
            "tokens_per_iteration": statistics.mean(m["tokens_per_iteration"] for m in each)}


def profile(cfg: Any, by_config: dict[str, list[Any]], onpolicy: list[str],
            own: tuple[str, Any] | None = None) -> dict[str, Any]:
    """A simulator config (plain data) of the workload, every cost read off the runs (the barrier's
    control-plane part off the on-policy ones: with staleness the next iteration starts before it).

    `own` = (configuration, one of its runs): the costs that follow the host's speed while that run ran
    (the step lines, prefill rates, the train rate, shift, barrier and sync times) are read off that run
    alone where it measured them, the rest off all the runs, and `control_cores` is 0: those costs were
    measured beside the control plane, so they carry its share of the cores already. Why: on this shared
    2-core box one configuration's runs move by ±15 % between rounds, so a profile pooled over every run
    predicts none of them to better than that; a run's own profile asks whether the simulator's model of
    the schedule is right at the speeds the run met (`paired_errors`)."""
    runs = [res for results in by_config.values() for res in results]
    rows = measured_rows(runs)
    mine = [own[1]] if own is not None else runs
    own_rows = measured_rows(mine)
    lens: dict[str, list[int]] = {k: [] for k in ("prompt", "response", "judge_prompt", "judge")}
    for r in rows:
        for k in lens:
            lens[k] += r["lengths"][k]
    template = statistics.median(j - p - x for j, p, x in zip(lens["judge_prompt"], lens["prompt"],
                                                              lens["response"], strict=True))
    fits = {role: {k: statistics.median(r["step_fits"][role][k] for r in own_rows) for k in ("a_s", "b_s")}
            for role in ("rollout", "reward")}
    # core's prefill rate per role (the time of steps that admitted prompts beyond the decode line)
    def prefill_rates(rs: list[dict[str, Any]], role: str) -> list[float]:
        return [r["step_fits"][role]["prefill_tokens_per_s"] for r in rs
                if r["step_fits"][role].get("prefill_tokens_per_s")]

    # the run's own samples of a cost where it has any, else every run's (here and below)
    prefill = {role: prefill_rates(own_rows, role) or prefill_rates(rows, role)
               for role in ("rollout", "reward")}
    for role in ("rollout", "reward"):  # the line through every step of the window, where rows carry them
        line = window_line(mine, role)
        if line is not None:
            fits[role] = {"a_s": line[0], "b_s": line[1]}
            prefill[role] = [line[2]] if line[2] is not None else prefill[role]
    # train's rate with one replica (the static groupings train on one device) and with two at once
    # (colocated moves both devices to train together): their ratio is the data-parallel efficiency of one
    # doubling; shiftable, which mixes both, is left to check it
    one = train_rate([res for name, results in by_config.items() if name.startswith("static ")
                      for res in results]) or train_rate(runs)
    two = train_rate(by_config.get("colocated", []))
    # with both devices busy the shared cores already slow each (`control_cores`): the loss is what is left
    n_dev = 2
    cores = control_cores(runs)
    dp = min(1.0, two / one * shared_core_slowdown(n_dev, n_dev, cores)) if one and two else 1.0
    if own is not None:
        # this run's train speed against its configuration's runs together (the same replica counts)
        theirs, its = train_rate(by_config[own[0]]), train_rate(mine)
        one = one * its / theirs if theirs > 0 and its > 0 else one
        # every cost above was measured beside the control plane, at this run's own share of the cores:
        # the simulator slowing the busy devices again would count that share twice
        cores = 0.0
    shifted = mine if any(res.shifts for res in mine) else runs
    shifts: dict[str, list[float]] = {role: [] for role in ROLES}
    for res in shifted:
        for e in res.shifts:
            shifts[e["role"]].append(shift_phase(e, "total"))
    all_shifts = [x for v in shifts.values() for x in v]
    over = shift_overhead(shifted, all_shifts)
    def steps(rs: list[dict[str, Any]]) -> list[float]:
        return [float(r["train_apply_s"]) / max(1.0, float(r.get("train_steps", 1.0))) for r in rs
                if "train_apply_s" in r]

    # a rollout device picking up a new version fetches and loads it, as the load phase of a shift does
    def syncs(rs: list[Any]) -> list[float]:
        return [shift_phase(e, "fetch") + shift_phase(e, "load") for res in rs for e in res.shifts
                if e["role"] == "rollout"]

    barrier = steps(own_rows) or steps(rows)
    sync = syncs(mine) or syncs(runs)
    gaps_from = [res for name in onpolicy for res in by_config[name]]
    if own is not None and own[0] in onpolicy:
        gaps_from = mine
    gen = {"rollout": cfg.rollout, "reward": cfg.reward}

    def gen_cost(role: str) -> dict[str, Any]:
        e = gen[role].engine
        return {"devices_per_replica": 1, "max_batch": e.max_batch, "kv_tokens": e.kv_budget_tokens,
                "decode": {"a_s": fits[role]["a_s"], "b_s": fits[role]["b_s"], "c_s": 0.0},
                "prefill_tokens_per_s": statistics.median(prefill[role]) if prefill[role] else 1e9,
                "weights_gb": 0.0, "init_s": _median(shifts[role], all_shifts) + over}

    def empirical(xs: list[int], cap: int) -> dict[str, Any]:
        return {"dist": "empirical", "samples": [max(1, int(x)) for x in xs], "min": 1, "max": max(cap, *xs)}

    sc = cfg.scheduler
    return {
        "name": "fidelity-measured",
        "seed": 0,
        "cluster": {"devices": n_dev},
        "workload": {
            "prompts_per_iteration": cfg.task.prompts_per_iteration,
            "group_size": cfg.task.group_size,
            "iterations": cfg.run.iterations - WARMUP + 1,
            "prompt_len": empirical(lens["prompt"], 1),
            "response_len": empirical(lens["response"], cfg.rollout.sampling.max_new_tokens),
            "critique_len": empirical(lens["judge"], cfg.reward.sampling.max_new_tokens),
            "judge_template_tokens": max(0, int(template)),
        },
        "cost": {
            "gpu": "cpu-core (measured)",
            "rollout": gen_cost("rollout"),
            "reward": gen_cost("reward"),
            "train": {"devices_per_replica": 1, "micro_batch_seqs": cfg.train.micro_batch,
                      "tokens_per_s_per_device": one, "dp_efficiency_per_doubling": dp, "weights_gb": 0.0,
                      "init_s": _median(shifts["train"], all_shifts) + over},
            "gps": {"fetch_tier": "host", "tiers": {"host": {"bandwidth_gb_s": 10.0}}},
            # the devices are the host's cores, which the driver and scheduler share with them
            "control_cores": cores,
            # the measured barrier is the whole owner's step: the simulator models the same owner
            "iteration": {"optimizer_step_s": statistics.median(barrier) if barrier else 0.0,
                          "weight_sync_s": statistics.median(sync) if sync else 0.0,
                          "control_s": control_s(gaps_from),
                          "optimizer_owner": cfg.train.optimizer_owner},
        },
        "scheduler": {"tick_s": sc.tick_s, "horizon_s": sc.horizon_s, "hysteresis": sc.hysteresis,
                      "cooldown_s": sc.cooldown_s, "progress_s": 0.1, "dispatch_batch_s": 0.005},
    }


def window_line(runs: list[Any], role: str) -> tuple[float, float, float | None] | None:
    """`role`'s step line (a, b) and prefill rate through every step of `runs`' measured windows
    (`fit_totals`), from the controller's cumulative `step_totals` in the rows: the last measured row's
    less the row before the window. None where the rows do not carry them or show no slope.

    Why not core's own fit (`step_fits`): it is recency-weighted over the last ~20 steps, and a row takes
    it at the iteration's end, from the role's tail: a fit of a few rows, not of the batches the role ran
    (docs/decisions.md, "Fidelity pairs each run with its own profile")."""
    from pivotrl.core.throughput import fit_totals

    decode, prefill = [0.0] * 5, [0.0] * 4
    for res in runs:
        rows = window_rows(res.iterations, lead=1)
        if len(rows) < 2 or "step_totals" not in rows[0] or role not in rows[-1].get("step_totals", {}):
            return None
        last = rows[-1]["step_totals"][role]
        first = rows[0]["step_totals"].get(role) or {k: [0.0] * len(v) for k, v in last.items()}
        for acc, key in ((decode, "decode"), (prefill, "prefill")):
            for i, (x, y) in enumerate(zip(first[key], last[key], strict=True)):
                acc[i] += y - x
    return fit_totals(decode, prefill)


def measured_rows(runs: list[Any]) -> list[dict[str, Any]]:
    """Every run's iteration rows past the warm-up (`WARMUP`): what the profile is read from."""
    return [r for res in runs for r in res.iterations[WARMUP:]]


def train_rate(runs: list[Any]) -> float:
    """Trained tokens per train-busy device-second (steps and gradient flushes) over `runs`' measured
    iterations; 0 without any."""
    rows = measured_rows(runs)
    busy = sum(d.get("train", 0.0) + d.get("flush", 0.0) for r in rows for d in r["device_time"].values())
    return sum(r["tokens_train"] for r in rows) / busy if busy > 0 else 0.0


def shift_overhead(runs: list[Any], phases: list[float]) -> float:
    """Seconds a device spends shifting per shift beyond the shift's measured phases (abort, offload,
    fetch, load): from the command to the worker picking it up and reporting back. The runs' measured
    iterations' `shifting` device time over their shifts, less the phases' mean; 0 without shifts."""
    rows = measured_rows(runs)
    n = sum(int(r.get("shifts", 0)) for r in rows)
    if n <= 0 or not phases:
        return 0.0
    shifting = sum(d.get("shifting", 0.0) for r in rows for d in r["device_time"].values())
    return max(0.0, shifting / n - statistics.mean(phases))


def _median(xs: list[float], fallback: list[float]) -> float:
    vals = xs or fallback
    return statistics.median(vals) if vals else 0.0


def simulated(sim_cfg: Any, mode: str, split: dict[str, int] | None, tokens_per_iteration: float) -> dict:
    from pivotrl.sim.compare import simulate

    r = simulate(sim_cfg, mode, split, record=False)
    ends = [it["start_s"] + it["total_s"] for it in r.iterations]
    # the real side's window: from the warm-up's counterpart (the first) to the last before the cool-down
    secs = [b - a for a, b in itertools.pairwise(ends[: len(ends) - COOLDOWN])]
    s = statistics.median(secs)
    window = statistics.mean(secs)  # a window's throughput, as the real side (`paradigms.window_throughput`)
    # busy device-seconds per role per iteration, the real runs' `device_s_per_iteration` counterpart
    busy = {role: r.busy_device_s.get(role, 0.0) / max(len(r.iterations), 1) for role in ROLES}
    return {"iteration_s": s, "iteration_s_each": secs, "finished": r.finished,
            "device_s_per_iteration": busy,
            "tokens_per_s_per_device": tokens_per_iteration / window / sim_cfg.cluster.devices}


Config = tuple[str, str, list[list[str]] | None, int]  # (name, mode, static groups, max_staleness)


def simulate_config(prof: dict[str, Any], groups: list[list[str]] | None, name: str, k: int,
                    tokens_per_iteration: float) -> dict[str, Any]:
    """One configuration in the simulator from the profile `prof` (plain data), at staleness `k`."""
    from pivotrl.config import validate
    from pivotrl.sim.config import SimConfig

    data = json.loads(json.dumps(prof))
    data["workload"]["max_staleness"] = k
    sim_cfg = validate(data, SimConfig, source="benchmarks.fidelity profile")
    if groups is None:
        return simulated(sim_cfg, "colocated" if name == "colocated" else "shiftable", None,
                         tokens_per_iteration)
    return simulated(sim_cfg, "grouped", {"+".join(g): 1 for g in groups}, tokens_per_iteration)


def paired_errors(cfg: Any, runs: dict[str, list[Any]], onpolicy: list[str], name: str,
                  groups: list[list[str]] | None, k: int) -> dict[str, Any]:
    """Each run of `name` against the simulator given that run's own profile (`profile`'s `own`): the
    ratios sim / real per round, and `error`, their median less one."""
    ratios, sims = [], []
    for res in runs[name]:
        real = measured(res)
        sim = simulate_config(profile(cfg, runs, onpolicy, own=(name, res)), groups, name, k,
                              real["tokens_per_iteration"])
        sims.append(sim["tokens_per_s_per_device"])
        ratios.append(sim["tokens_per_s_per_device"] / real["tokens_per_s_per_device"])
    return {"error": statistics.median(ratios) - 1.0, "ratios": ratios, "sim_tokens_per_s_per_device": sims}


def compare(cfg: Any, configs: list[Config], runs: dict[str, list[Any]]) -> dict[str, Any]:
    """Every configuration's real runs against the simulator, two ways: `error` (the headline) pairs each
    run with a simulation from its own profile (`paired_errors`); `error_pooled_profile` compares the
    median run with one simulation from a profile pooled over every run of every configuration.
    `max_abs_error` is the largest |error| over the configurations (`max_abs_error_pooled_profile`
    beside it)."""
    onpolicy = [name for name, _m, _g, k in configs if k == 0]
    prof = profile(cfg, runs, onpolicy)
    print(f"profile: control plane {prof['cost']['control_cores']:.3f} cores beside the devices, train "
          f"data-parallel efficiency {prof['cost']['train']['dp_efficiency_per_doubling']:.3f}", flush=True)
    out: dict[str, Any] = {"profile": {k: v for k, v in prof["cost"].items()}, "sim_config": prof,
                           "paradigms": {}}
    for name, _mode, groups, k in configs:
        real = combined(runs[name])
        sim = simulate_config(prof, groups, name, k, real["tokens_per_iteration"])
        pooled = sim["tokens_per_s_per_device"] / real["tokens_per_s_per_device"] - 1.0
        paired = paired_errors(cfg, runs, onpolicy, name, groups, k)
        out["paradigms"][name] = {"max_staleness": k, "real": real, "sim": sim, "error": paired["error"],
                                  "paired": paired, "error_pooled_profile": pooled}
        print(f"{name:<32} real {real['tokens_per_s_per_device']:8.1f}  "
              f"sim {sim['tokens_per_s_per_device']:8.1f}  error {paired['error']:+.3f} "
              f"(runs paired with their own profiles: "
              f"{' '.join(f'{x - 1:+.3f}' for x in paired['ratios'])}), pooled profile {pooled:+.3f}",
              flush=True)
    rows = out["paradigms"].values()
    out["max_abs_error_pooled_profile"] = max(abs(p["error_pooled_profile"]) for p in rows)
    out["max_abs_error"] = max(abs(p["error"]) for p in rows)
    print(f"max_abs_error_pooled_profile {out['max_abs_error_pooled_profile']:.3f}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the quick paradigms workload")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--storage", type=Path, default=Path("storage/bench"))
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds over every configuration")
    args = ap.parse_args(argv)
    for name in ("distributed", "distributed.worker", "distributed.scheduler", "distributed.nanny"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import torch

    torch.set_num_threads(1)
    t0 = time.monotonic()
    cfg = workload(args.quick, args.storage, "debug")
    configs: list[Config] = [("colocated", "colocated", None, 0)]
    configs += [(f"static {name}", "disaggregated", groups, 0) for name, groups in GROUPINGS.items()]
    configs += [("shiftable", "shiftable", None, 0), ("shiftable_async", "shiftable", None, STALENESS_RUN)]
    runs: dict[str, list[Any]] = {name: [] for name, *_ in configs}
    for rep in range(max(1, args.repeats)):
        for name, mode, groups, k in rotated(configs, rep):
            runs[name].append(run_config(cfg, mode, groups, k))
            tps = measured(runs[name][-1])["tokens_per_s_per_device"]
            print(f"real round {rep + 1} {name:<32} {tps:8.1f} tok/s/device", flush=True)
    out = compare(cfg, configs, runs)
    out["wall_s"] = time.monotonic() - t0
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    print(f"max_abs_error {out['max_abs_error']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
