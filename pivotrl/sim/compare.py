"""Run the paradigms side by side on one workload: colocated, the best static split, shiftable.

The best static (disaggregated) split is the config's `static_split` when it names one. Otherwise it is
searched over every split of the cluster into whole replicas: all of them are simulated when there are at
most `search.exhaustive_max_splits`; otherwise every split is ranked by core's iteration model
(`model_ranked`), the best `top_k` are simulated and a hill-climb over neighbouring splits (one replica
moved between two roles) continues until no neighbour improves or `search.max_simulations` splits were
simulated. Both the candidate count and the method
are reported.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from pivotrl.errors import UserError
from pivotrl.sim.config import ROLES, SimConfig
from pivotrl.sim.engine import SimResult, Simulator
from pivotrl.sim.fluid import fluid_bound, latency_bound

if TYPE_CHECKING:
    from pivotrl.core.stage import Stage
    from pivotrl.core.types import Role


def simulate(cfg: SimConfig, mode: str, split: dict[str, int] | None = None,
             iterations: int | None = None, record: bool = True) -> SimResult:
    """One paradigm on the workload, every decision made by `pivotrl.core`."""
    return Simulator(cfg, mode, split, iterations=iterations, record=record).run()


def all_splits(cfg: SimConfig, idle_ok: bool = False) -> list[dict[str, int]]:
    """Every split of all devices into whole replicas, at least one replica per role. With `idle_ok`,
    train takes the whole replicas of what is left and fewer than its replica size of devices stay idle
    (for clusters no exact split fits: 697 devices in 2-device replicas)."""
    n = cfg.cluster.devices
    g = {r: getattr(cfg.cost, r).devices_per_replica for r in ROLES}
    out = []
    for a in range(g["rollout"], n + 1, g["rollout"]):
        for b in range(g["reward"], n - a + 1, g["reward"]):
            c = n - a - b
            if idle_ok:
                c -= c % g["train"]
            if c >= g["train"] and c % g["train"] == 0:
                out.append({"rollout": a, "reward": b, "train": c})
    return out


def all_groupings(cfg: SimConfig) -> list[dict[str, int]]:
    """Static *groupings* for clusters too small for one replica per role: the roles partitioned into 2+
    groups (each time-shares its roles colocated-style, in pipeline order), every way to give each group
    whole devices (at least one replica of each of its roles). Keyed like `driver.build_controller` wants:
    {"rollout+train": 1, "reward": 1}."""
    n = cfg.cluster.devices
    g = {r: getattr(cfg.cost, r).devices_per_replica for r in ROLES}

    def partitions(items: list[str]) -> list[list[list[str]]]:
        if not items:
            return [[]]
        head, out = items[0], []
        for rest in partitions(items[1:]):
            out.append([[head], *rest])
            for i in range(len(rest)):
                out.append([*rest[:i], [head, *rest[i]], *rest[i + 1:]])
        return out

    out: list[dict[str, int]] = []
    for part in partitions(list(ROLES)):
        if len(part) < 2:
            continue  # one group of every role is colocated, run on its own
        names = ["+".join(sorted(b, key=ROLES.index)) for b in part]
        need = [max(g[r] for r in b) for b in part]

        def fill(i: int, left: int, acc: list[int], names: list[str] = names, need: list[int] = need) -> None:
            if i == len(names) - 1:
                if left >= need[i]:
                    out.append(dict(zip(names, [*acc, left], strict=True)))
                return
            for k in range(need[i], left - sum(need[i + 1:]) + 1):
                fill(i + 1, left - k, [*acc, k])

        fill(0, n, [])
    return out


def model_ranked(cfg: SimConfig, splits: list[dict[str, int]], k: int) -> list[dict[str, int]]:
    """The `k` best splits, best first, by core's own iteration model (`pivotrl.core.makespan`), fed with the
    workload's true lengths of iteration 0 (the baseline may know everything core would measure) and the
    profile's step-time lines: a much closer ranking than the bottleneck estimate, since it prices each
    stage's longest item and the pipeline's fill and drain."""
    import numpy as np

    from pivotrl.core.makespan import ranked

    st = model_stages(cfg)
    if st is None:
        return list(splits[:k])
    reps = {r: np.asarray([s[str(r)] // st[r].g for s in splits], dtype=float) for r in st}
    return [splits[i] for i, _ in ranked(st, reps, k)]


def model_stages(cfg: SimConfig, measured: bool = True) -> dict[Role, Stage] | None:
    """core's stages (`pivotrl.core.iteration.stages`) of iteration 0, from the workload's true lengths and
    the profile's step-time lines; None where core has no model of them. `measured=False`: what core has
    before anything is measured, the plan's priors (the configured distributions), no profile."""
    import numpy as np

    from pivotrl.core.iteration import IterationProfile, RoleProfile, stages
    from pivotrl.core.stage import tail_lengths
    from pivotrl.core.types import Role
    from pivotrl.sim.driver import build_controller, iteration_plan
    from pivotrl.sim.workload import iteration_sequences

    ctl = build_controller(cfg, "disaggregated")
    ctl.state.plan = iteration_plan(cfg, 0)
    if not measured:
        return stages(ctl.state, ctl.shift_costs, None)
    seqs = iteration_sequences(cfg.workload, 0, cfg.seed)
    lens = {Role.ROLLOUT: [x.response_len for x in seqs], Role.REWARD: [x.critique_len for x in seqs],
            Role.TRAIN: [x.prompt_len + x.response_len for x in seqs]}
    prompts = {Role.ROLLOUT: float(np.mean([x.prompt_len for x in seqs])),
               Role.REWARD: float(np.mean([x.prompt_len + x.response_len for x in seqs]))
               + cfg.workload.judge_template_tokens, Role.TRAIN: 0.0}
    roles = {r: RoleProfile(len(v), float(np.mean(v)), float(max(v)),
                            tail_lengths(np.asarray(v, dtype=float)), prompts[r]) for r, v in lens.items()}
    prof = IterationProfile(0, 0.0, "static", 0.0, roles)
    return stages(ctl.state, ctl.shift_costs, prof)


def _key(split: dict[str, int]) -> tuple[int, int, int]:
    return (split["rollout"], split["reward"], split["train"])


def best_static(cfg: SimConfig, log: Any = None) -> tuple[SimResult, dict[str, Any]]:
    if cfg.static_split is not None:  # the config names the static baseline: simulate it, search nothing
        split = {r: int(cfg.static_split.get(r, 0)) for r in ROLES}
        final = simulate(cfg, "disaggregated", split)
        row = {"split": split, "tokens_per_s_per_device": final.tokens_per_s_per_device}
        return final, {"method": "given (static_split)", "splits_total": 1, "splits_simulated": 1,
                       "ranking": [row]}
    splits = all_splits(cfg) or all_splits(cfg, idle_ok=True)
    if not splits:
        return best_grouping(cfg, log)
    iters = cfg.search.iterations
    cache: dict[tuple[int, int, int], SimResult] = {}

    def run(split: dict[str, int]) -> SimResult:
        k = _key(split)
        if k not in cache:
            cache[k] = simulate(cfg, "disaggregated", split, iterations=iters, record=False)
            if log:
                log(f"  static {k}: {cache[k].tokens_per_s_per_device:.1f} tok/s/dev")
        return cache[k]

    if len(splits) <= cfg.search.exhaustive_max_splits:
        method = "exhaustive"
        for s in splits:
            run(s)
    else:
        method = f"model top-{cfg.search.top_k} + hill-climb (at most {cfg.search.max_simulations} simulated)"
        for s in model_ranked(cfg, splits, cfg.search.top_k):
            run(s)
        valid = {_key(s) for s in splits}
        g = {r: getattr(cfg.cost, r).devices_per_replica for r in ROLES}
        n = cfg.cluster.devices
        steps = [1]
        while steps[-1] * 2 <= max(n // 16, 1):
            steps.append(steps[-1] * 2)
        improved = True
        while improved and len(cache) < cfg.search.max_simulations:
            improved = False
            best_k = max(cache, key=lambda k: cache[k].tokens_per_s_per_device)
            best = dict(zip(ROLES, best_k, strict=True))
            for src in ROLES:
                for dst in ROLES:
                    if src == dst:
                        continue
                    for step in steps:
                        if len(cache) >= cfg.search.max_simulations:
                            break   # the cap holds inside a round too (a round is up to 6 x steps runs)
                        moved = math.lcm(g[src], g[dst]) * step   # whole replicas on both sides
                        cand = dict(best)
                        cand[src] -= moved
                        cand[dst] += moved
                        # keep whole replicas on the receiving side
                        if cand[dst] % g[dst] or _key(cand) not in valid or _key(cand) in cache:
                            continue
                        r = run(cand)
                        if r.tokens_per_s_per_device > cache[best_k].tokens_per_s_per_device:
                            improved = True
    best_k = max(cache, key=lambda k: cache[k].tokens_per_s_per_device)
    best_split = dict(zip(ROLES, best_k, strict=True))
    final = simulate(cfg, "disaggregated", best_split)  # full run with trace
    table = sorted(({"split": dict(zip(ROLES, k, strict=True)),
                     "tokens_per_s_per_device": v.tokens_per_s_per_device} for k, v in cache.items()),
                   key=lambda d: -d["tokens_per_s_per_device"])
    return final, {"method": method, "splits_total": len(splits), "splits_simulated": len(cache),
                   "ranking": table}


def best_grouping(cfg: SimConfig, log: Any = None) -> tuple[SimResult, dict[str, Any]]:
    """Fewer devices than one replica per role: the best static grouping, every one simulated."""
    groupings = all_groupings(cfg)
    if not groupings:
        raise UserError(
            f"cluster.devices: {cfg.cluster.devices} device(s) admit no static split or grouping of the "
            "three roles (each group needs a whole replica)"
        )
    runs = []
    for grp in groupings:
        r = simulate(cfg, "grouped", grp, iterations=cfg.search.iterations, record=False)
        if log:
            log(f"  grouping {grp}: {r.tokens_per_s_per_device:.1f} tok/s/dev")
        runs.append((r.tokens_per_s_per_device, grp))
    best = max(runs, key=lambda t: t[0])[1]
    final = simulate(cfg, "grouped", best)
    table = sorted(({"split": grp, "tokens_per_s_per_device": v} for v, grp in runs),
                   key=lambda d: -d["tokens_per_s_per_device"])
    return final, {"method": "exhaustive over role groupings (too few devices for one replica per role)",
                   "splits_total": len(groupings), "splits_simulated": len(groupings), "ranking": table}


def compare(cfg: SimConfig, log: Any = None) -> dict[str, Any]:
    """Everything `simulate` reports; ratios are computed on tokens/s per device."""
    t0 = time.perf_counter()
    colo = simulate(cfg, "colocated")
    static, search = best_static(cfg, log)
    shift = simulate(cfg, "shiftable")
    fluid = fluid_bound(cfg)
    tight = latency_bound(cfg)
    out: dict[str, Any] = {
        "config": cfg.name,
        "devices": cfg.cluster.devices,
        "gpu": cfg.cost.gpu,
        "controller": "pivotrl.core",
        "tokens_per_s_per_device": {
            "colocated": colo.tokens_per_s_per_device,
            "best_static": static.tokens_per_s_per_device,
            "shiftable": shift.tokens_per_s_per_device,
            "fluid_bound": fluid["tokens_per_s_per_device"],
            "fluid_and_latency_bound": tight["tokens_per_s_per_device"],
        },
        "best_static_split": static.split,
        "static_search": search,
        "fluid_bound": fluid,
        "latency_bound": tight,
        "runs": {"colocated": colo.summary(), "best_static": static.summary(), "shiftable": shift.summary()},
        "wall_s": time.perf_counter() - t0,
    }
    out["ratio_vs_colocated"] = shift.tokens_per_s_per_device / colo.tokens_per_s_per_device
    out["ratio_vs_best_static"] = shift.tokens_per_s_per_device / static.tokens_per_s_per_device
    out["fraction_of_fluid_bound"] = shift.tokens_per_s_per_device / fluid["tokens_per_s_per_device"]
    tight_tps = tight["tokens_per_s_per_device"]
    out["fraction_of_fluid_and_latency_bound"] = shift.tokens_per_s_per_device / tight_tps
    # Item 5 of issue #14: every paradigm against both bounds and the tighter of the two (per iteration the
    # larger makespan of fluid and critical path: the physical limit on-policy).
    tokens = shift.tokens
    chain_tps = tokens / tight["chain_makespan_s"] / cfg.cluster.devices if tight["chain_makespan_s"] else 0.0
    out["tokens_per_s_per_device"]["critical_path_bound"] = chain_tps
    out["tokens_per_s_per_device"]["tighter_bound"] = tight_tps
    out["fraction_of_critical_path_bound"] = shift.tokens_per_s_per_device / chain_tps if chain_tps else 0.0
    out["fraction_of_tighter_bound"] = shift.tokens_per_s_per_device / tight_tps
    out["paradigms_vs_bounds"] = {
        name: {"fraction_of_fluid_bound": r.tokens_per_s_per_device / fluid["tokens_per_s_per_device"],
               "fraction_of_critical_path_bound": r.tokens_per_s_per_device / chain_tps if chain_tps else 0.0,
               "fraction_of_tighter_bound": r.tokens_per_s_per_device / tight_tps}
        for name, r in (("colocated", colo), ("best_static", static), ("shiftable", shift))}
    k = cfg.workload.max_staleness
    out["max_staleness"] = k
    if k > 0:
        _staleness_keys(cfg, out, colo, static, shift)
    out["_results"] = {"colocated": colo, "best_static": static, "shiftable": shift}
    return out


def _staleness_keys(cfg: SimConfig, out: dict[str, Any], colo: SimResult, static: SimResult,
                    shift: SimResult) -> None:
    """With staleness k ≥ 1 the baselines run with the same k (the static async split is verl fully-async's
    design), and the paper's own baseline, on-policy colocated, is simulated once more with k = 0. The
    critical-path bound is an on-policy bound (iteration i+1 no longer waits for i's chain), so the
    physical limit is the fluid bound alone."""
    onpolicy = cfg.model_copy(update={"workload": cfg.workload.model_copy(update={"max_staleness": 0})})
    colo0 = simulate(onpolicy, "colocated", record=False)
    fluid_tps = out["tokens_per_s_per_device"]["fluid_bound"]
    s = shift.tokens_per_s_per_device
    out["tokens_per_s_per_device"]["colocated_onpolicy"] = colo0.tokens_per_s_per_device
    out["tokens_per_s_per_device"]["tighter_bound"] = fluid_tps
    out["ratio_vs_best_static_same_staleness"] = s / static.tokens_per_s_per_device
    out["ratio_vs_colocated_same_staleness"] = s / colo.tokens_per_s_per_device
    out["ratio_vs_colocated_onpolicy"] = s / colo0.tokens_per_s_per_device
    out["fraction_of_tighter_bound"] = s / fluid_tps
    for name, r in (("colocated", colo), ("best_static", static), ("shiftable", shift)):
        out["paradigms_vs_bounds"][name]["fraction_of_tighter_bound"] = r.tokens_per_s_per_device / fluid_tps
    out["runs"]["colocated_onpolicy"] = colo0.summary()
