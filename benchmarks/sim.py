"""Simulator benchmarks: the paper configuration (median over seeds) and the sweep.

    python -m benchmarks.sim paper [--seeds 3] [--out docs/sim-paper.json]
                                   [--plot docs/sim-paper-allocation.png]
    python -m benchmarks.sim sweep [--jobs 2] [--out docs/sim-sweep.json]
                                   [--static-from OLD.json --seeds 0,1]   # reuse the static search
    python -m benchmarks.sim speed            # one 32-GPU iteration of 8,192 sequences, median of 3
    python -m benchmarks.sim table            # re-make the sweep table/figure from docs/sim-sweep.json
    python -m benchmarks.sim static-gap [--quick] [--workloads 12]   # static search vs every split simulated
    python -m benchmarks.sim random [--quick] [--workloads 52] [--jobs 2] [--json OUT.json]
                                              # drawn workloads (pivotrl.sim.randomized): does shiftable
                                              # ever lose to the best of colocated and the best static split?
                    [--search-top-k 8 --search-simulations 60]   # ... against a deeper static search
    python -m benchmarks.sim realizations --seeds 428,430 [--quick] [--realizations 8] [--json OUT.json]
                                              # the same drawn workloads on other length draws: is a loss
                                              # the plan's, or the baseline's pick of the luckiest split?

Every paradigm runs side by side on the same workload in one process; decisions are made by pivotrl.core.
Ratios are printed last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("ratio_vs_colocated", "ratio_vs_best_static", "fraction_of_fluid_bound")


def _compare(path: str, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    from pivotrl.sim.compare import compare
    from pivotrl.sim.config import load_sim_config
    from pivotrl.sim.fluid import work_per_iteration

    cfg = load_sim_config(path, list(overrides))
    rep = compare(cfg)
    results = rep.pop("_results")
    w = work_per_iteration(cfg)
    rep["fluid_work_share"] = {k: v / sum(w.values()) for k, v in w.items()}
    rep["all_finished"] = all(r.finished for r in results.values())
    rep["conserved"] = all(r.conservation["conserved"] for r in results.values())
    return rep


def paper(args: argparse.Namespace) -> None:
    from pivotrl.sim.compare import compare
    from pivotrl.sim.config import load_sim_config
    from pivotrl.sim.plot import plot_allocation

    path = ROOT / "configs/sim/paper-32gpu.yaml"
    runs = []
    for seed in range(args.seeds):
        cfg = load_sim_config(path, [f"seed={seed}"])
        rep = compare(cfg)
        results = rep.pop("_results")
        if seed == 0 and args.plot:
            plot_allocation({"colocated": results["colocated"],
                             f"best static {rep['best_static_split']}": results["best_static"],
                             "shiftable": results["shiftable"]}, args.plot,
                            title="paper-32gpu (seed 0): device roles over time")
        runs.append(rep)
        print(f"seed {seed}: " + ", ".join(f"{k}={rep[k]:.3f}" for k in KEYS), flush=True)
    out = {"config": str(path.relative_to(ROOT)), "seeds": args.seeds, "runs": runs}
    out["median"] = {k: statistics.median(r[k] for r in runs) for k in KEYS}
    out["median_tokens_per_s_per_device"] = {
        m: statistics.median(r["tokens_per_s_per_device"][m] for r in runs)
        for m in ("colocated", "best_static", "shiftable", "fluid_bound")}
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: round(v, 4) for k, v in out["median"].items()}))


def _compare_known_split(path: str, split: dict[str, int], seeds: tuple[int, ...]) -> dict[str, Any]:
    """Colocated, the given static split and shiftable, each simulated for every seed (all iterations);
    tokens/s and ratios are medians over the seeds. The split comes from an earlier full search
    (`--static-from`): the search is what costs (up to 12 simulations per 512-GPU point), and the static
    policy does not depend on the planner, so re-simulating its winner measures today's code."""
    from pivotrl.sim.compare import simulate
    from pivotrl.sim.config import load_sim_config
    from pivotrl.sim.fluid import fluid_bound, latency_bound, work_per_iteration

    per_seed = []
    for seed in seeds:
        cfg = load_sim_config(path, [f"seed={seed}"])
        runs = {"colocated": simulate(cfg, "colocated", record=False),
                "best_static": simulate(cfg, "disaggregated", split, record=False),
                "shiftable": simulate(cfg, "shiftable", record=False)}
        tps = {k: v.tokens_per_s_per_device for k, v in runs.items()}
        tps["fluid_bound"] = fluid_bound(cfg)["tokens_per_s_per_device"]
        tps["fluid_and_latency_bound"] = latency_bound(cfg)["tokens_per_s_per_device"]
        per_seed.append({"seed": seed, "tokens_per_s_per_device": tps,
                         "ratio_vs_colocated": tps["shiftable"] / tps["colocated"],
                         "ratio_vs_best_static": tps["shiftable"] / tps["best_static"],
                         "fraction_of_fluid_bound": tps["shiftable"] / tps["fluid_bound"],
                         "finished": all(r.finished for r in runs.values()),
                         "conserved": all(r.conservation["conserved"] for r in runs.values())})
    med = statistics.median
    w = work_per_iteration(load_sim_config(path))
    return {
        "config": Path(path).stem, "seeds": list(seeds), "best_static_split": split,
        "static_search": "split from --static-from (earlier full search), re-simulated per seed",
        "tokens_per_s_per_device": {k: med(r["tokens_per_s_per_device"][k] for r in per_seed)
                                    for k in per_seed[0]["tokens_per_s_per_device"]},
        **{k: med(r[k] for r in per_seed) for k in KEYS},
        "per_seed": per_seed,
        "fluid_work_share": {k: v / sum(w.values()) for k, v in w.items()},
        "all_finished": all(r["finished"] for r in per_seed),
        "conserved": all(r["conserved"] for r in per_seed),
    }


def in_order(pool: Executor, futs: Mapping[str, Future]) -> Iterator[tuple[str, Any]]:
    """Each future's name and result, in submission order. The first failure ends the run there: the
    futures not yet started are cancelled and the error names its item. Why: leaving the pool's block
    waits for every submitted item, so one failed draw surfaced only after all the others had run
    (tens of minutes, with nothing printed)."""
    for name, fut in futs.items():
        try:
            yield name, fut.result()
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            print(f"{name} failed; the items not yet started are cancelled", file=sys.stderr, flush=True)
            raise


def sweep(args: argparse.Namespace) -> None:
    paths = sorted((ROOT / "configs/sim/sweep").glob("*.yaml"))
    t0 = time.perf_counter()
    rows: dict[str, Any] = {}
    known = json.loads(Path(args.static_from).read_text())["rows"] if args.static_from else None
    seeds = tuple(int(x) for x in args.seeds.split(","))
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        def submit(p: Path) -> Any:
            if known is not None:
                return pool.submit(_compare_known_split, str(p), known[p.stem]["best_static_split"], seeds)
            return pool.submit(_compare, str(p))

        futs = {p.stem: submit(p) for p in sorted(paths, key=lambda p: int(
            p.stem.rsplit("-", 1)[1].removesuffix("gpu")))}
        for name, r in in_order(pool, futs):
            rows[name] = r
            print(f"{name:24s} " + " ".join(f"{k}={r[k]:.3f}" for k in KEYS), flush=True)
            Path(args.out).write_text(json.dumps({"partial": True, "rows": rows}, indent=1, default=str))
    out = {"wall_s": time.perf_counter() - t0, "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    table = sweep_table(rows)
    Path(args.table).write_text(table)
    sweep_figure(rows, args.plot)
    print(table)
    worst = min(r["ratio_vs_best_static"] for r in rows.values())
    print(json.dumps({"configs": len(rows), "min_ratio_vs_best_static": round(worst, 4),
                      "shiftable_ge_best_static_everywhere": worst >= 1.0}))


def _order(rows: dict[str, Any]) -> list[tuple[str, int, str]]:
    out = []
    for name in rows:
        wl, n = name.rsplit("-", 1)
        out.append((wl, int(n.removesuffix("gpu")), name))
    order = {"rollout-heavy": 0, "balanced": 1, "reward-heavy": 2}
    return sorted(out, key=lambda x: (order.get(x[0], 9), x[1]))


def _tight(name: str, r: dict[str, Any]) -> float:
    """Fluid-and-latency bound (tokens/s/device): from the report, or computed from the config."""
    got = r["tokens_per_s_per_device"].get("fluid_and_latency_bound")
    if got is None:
        from pivotrl.sim.config import load_sim_config
        from pivotrl.sim.fluid import latency_bound

        cfg = load_sim_config(ROOT / "configs/sim/sweep" / f"{name}.yaml")
        got = latency_bound(cfg)["tokens_per_s_per_device"]
        r["tokens_per_s_per_device"]["fluid_and_latency_bound"] = got
    return got


def sweep_table(rows: dict[str, Any]) -> str:
    lines = ["| workload | GPUs | fluid work share r/w/t | colocated | best static (split r/w/t) | "
             "shiftable | fluid bound | fluid+latency bound | shiftable / colocated | "
             "shiftable / best static | of fluid | of fluid+latency |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for wl, n, name in _order(rows):
        r = rows[name]
        t = r["tokens_per_s_per_device"]
        s = r["best_static_split"]
        tight = _tight(name, r)
        share = "/".join(f"{r['fluid_work_share'][k]:.2f}" for k in ("rollout", "reward", "train"))
        lines.append(
            f"| {wl} | {n} | {share} | {t['colocated']:.0f} | {t['best_static']:.0f} "
            f"({s['rollout']}/{s['reward']}/{s['train']}) | {t['shiftable']:.0f} | {t['fluid_bound']:.0f} | "
            f"{tight:.0f} | {r['ratio_vs_colocated']:.2f} | {r['ratio_vs_best_static']:.2f} | "
            f"{r['fraction_of_fluid_bound']:.2f} | {t['shiftable'] / tight:.2f} |")
    return "\n".join(lines) + "\n"


def table(args: argparse.Namespace) -> None:
    """Re-make the sweep table and figure from a sweep JSON (e.g. after adding a bound)."""
    rows = json.loads(Path(args.out).read_text())["rows"]
    Path(args.table).write_text(sweep_table(rows))
    sweep_figure(rows, args.plot)
    print(Path(args.table).read_text())


def sweep_figure(rows: dict[str, Any], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    order = _order(rows)
    wls = list(dict.fromkeys(wl for wl, _, _ in order))
    fig, axes = plt.subplots(1, len(wls), figsize=(11, 3.4), sharey=True)
    for ax, wl in zip(axes, wls, strict=True):
        sub = [(n, rows[name]) for w, n, name in order if w == wl]
        xs = range(len(sub))
        width = 0.27
        for i, (key, label) in enumerate((("colocated", "colocated"), ("best_static", "best static"),
                                          ("shiftable", "shiftable"))):
            ax.bar([x + (i - 1) * width for x in xs],
                   [r["tokens_per_s_per_device"][key] / r["tokens_per_s_per_device"]["fluid_bound"]
                    for _, r in sub], width, label=label)
        names = [name for w, _n, name in order if w == wl]
        tight = [_tight(nm, rows[nm]) / rows[nm]["tokens_per_s_per_device"]["fluid_bound"] for nm in names]
        ax.hlines(tight, [x - 1.5 * width for x in xs], [x + 1.5 * width for x in xs], colors="k",
                  linewidth=1.2, label="fluid+latency bound" if wl == wls[0] else None)
        ax.set_xticks(list(xs), [str(n) for n, _ in sub])
        ax.set_xlabel("GPUs")
        ax.set_title(wl, fontsize=10)
        ax.axhline(1.0, color="k", linewidth=0.6)
    axes[0].set_ylabel("tokens/s/device / fluid bound")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def speed(args: argparse.Namespace) -> None:
    from pivotrl.sim.compare import simulate
    from pivotrl.sim.config import load_sim_config

    cfg = load_sim_config(ROOT / "configs/sim/paper-32gpu.yaml", ["workload.iterations=1"])
    out = {}
    for mode in ("colocated", "disaggregated", "shiftable"):
        split = {"rollout": 7, "reward": 12, "train": 13} if mode == "disaggregated" else None
        ts = []
        for _ in range(3):
            t = time.process_time()
            simulate(cfg, mode, split, record=False)
            ts.append(time.process_time() - t)
        out[mode] = statistics.median(ts)
    print(json.dumps({"cpu_s_per_32gpu_iteration_8192_seqs": {k: round(v, 2) for k, v in out.items()},
                      "under_5s": max(out.values()) < 5.0}))


def _at_least_one(text: str) -> int:
    """argparse type of a search width: an integer >= 1 (`SearchConfig`'s own bound)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seed_list(text: str) -> list[int]:
    """argparse type of `--seeds`: comma-separated draw seeds, each an integer >= 0."""
    try:
        seeds = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"seeds must be >= 0, got {text!r}")
    return seeds


def _random_one(seed: int, quick: bool, search: dict[str, int] | None = None) -> dict[str, Any]:
    """One drawn workload: colocated, the searched best static split and shiftable, side by side.
    `search`: overrides of the draw's static search (`SearchConfig` fields), for a deeper baseline."""
    from pivotrl.sim.compare import compare
    from pivotrl.sim.randomized import draw_config

    t0 = time.perf_counter()
    cfg, draw = draw_config(seed, quick)
    if search:
        cfg = cfg.model_copy(update={"search": cfg.search.model_copy(update=search)})
    rep = compare(cfg)
    results = rep.pop("_results")
    tps = rep["tokens_per_s_per_device"]
    base = max(tps["colocated"], tps["best_static"])
    return {
        "seed": seed, "draw": draw.as_dict(),
        "tokens_per_s_per_device": tps,
        "best_static_split": rep["best_static_split"],
        "static_search": {k: rep["static_search"][k] for k in ("method", "splits_total", "splits_simulated")},
        "ratio_vs_colocated": rep["ratio_vs_colocated"],
        "ratio_vs_best_static": rep["ratio_vs_best_static"],
        "ratio_vs_best_of_static_and_colocated": tps["shiftable"] / base,
        "fraction_of_fluid_bound": rep["fraction_of_fluid_bound"],
        "fraction_of_tighter_bound": rep["fraction_of_fluid_and_latency_bound"],
        "shift_device_share": rep["runs"]["shiftable"]["utilization"]["shift_device_share"],
        "finished": all(r.finished for r in results.values()),
        "conserved": all(r.conservation["conserved"] for r in results.values()),
        "wall_s": time.perf_counter() - t0,
    }


def random_workloads(args: argparse.Namespace) -> None:
    """The property-style benchmark: shiftable against the best of colocated and the best static split on
    `--workloads` drawn workloads (seeds 0..N-1, every length shape equally often). A *loss* is a workload
    where shiftable is below that best by more than 1 % (the acceptance line is a worst ratio >= 0.99)."""
    t0 = time.perf_counter()
    seeds = list(range(args.first_seed, args.first_seed + args.workloads))
    search = {k: v for k, v in (("top_k", args.search_top_k), ("max_simulations", args.search_simulations))
              if v is not None}
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futs = {f"seed {s}": pool.submit(_random_one, s, args.quick, search) for s in seeds}
        for _, r in in_order(pool, futs):
            rows.append(r)
            d = r["draw"]
            print(f"seed {r['seed']:3d} {d['shape']:13s} {d['devices']:5d} dev G={d['group_size']:2d} "
                  f"{d['shift']}: vs best-of {r['ratio_vs_best_of_static_and_colocated']:.3f} "
                  f"(colo {r['ratio_vs_colocated']:.3f}, static {r['ratio_vs_best_static']:.3f}) "
                  f"of tighter bound {r['fraction_of_tighter_bound']:.3f}  [{r['wall_s']:.0f}s]", flush=True)
            if args.json_out:  # partial results survive an interrupted run
                Path(args.json_out).write_text(json.dumps({"partial": True, "rows": rows}, default=str))
    ratios = [r["ratio_vs_best_of_static_and_colocated"] for r in rows]
    losses = [r["seed"] for r in rows if r["ratio_vs_best_of_static_and_colocated"] < 0.99]
    out = {
        "quick": args.quick,
        "search_overrides": search,
        "workloads": len(rows),
        "worst_ratio_vs_best_of_static_and_colocated": min(ratios),
        "median_ratio_vs_best_of_static_and_colocated": statistics.median(ratios),
        "median_fraction_of_tighter_bound": statistics.median(r["fraction_of_tighter_bound"] for r in rows),
        "median_fraction_of_fluid_bound": statistics.median(r["fraction_of_fluid_bound"] for r in rows),
        "losses": len(losses),
        "lost_seeds": losses,
        "below_best_static": sum(r["ratio_vs_best_static"] < 1.0 for r in rows),
        "below_colocated": sum(r["ratio_vs_colocated"] < 1.0 for r in rows),
        "all_finished": all(r["finished"] for r in rows),
        "conserved": all(r["conserved"] for r in rows),
        "wall_s": time.perf_counter() - t0,
        "rows": rows,
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1, default=str))
    keys = ("workloads", "worst_ratio_vs_best_of_static_and_colocated", "median_fraction_of_tighter_bound",
            "losses", "wall_s")
    print(json.dumps({k: round(out[k], 4) if isinstance(out[k], float) else out[k] for k in keys}))


def _gap_one(seed: int, quick: bool) -> dict[str, Any] | None:
    """The static search against every split simulated, on one drawn workload (search iterations)."""
    from pivotrl.sim.compare import all_splits, best_static, simulate
    from pivotrl.sim.randomized import draw_config

    cfg, draw = draw_config(seed, quick)
    cfg = cfg.model_copy(update={"search": cfg.search.model_copy(update={"exhaustive_max_splits": 1})})
    splits = all_splits(cfg)
    if not splits or len(splits) > 400:
        return None
    _, search = best_static(cfg)
    found = search["ranking"][0]["tokens_per_s_per_device"]
    best = max(simulate(cfg, "disaggregated", s, iterations=cfg.search.iterations,
                        record=False).tokens_per_s_per_device for s in splits)
    return {"seed": seed, "devices": draw.devices, "splits_total": len(splits),
            "splits_simulated": search["splits_simulated"], "search_tps": found, "exhaustive_tps": best,
            "gap": 1.0 - found / best}


def static_gap(args: argparse.Namespace) -> None:
    """How far the static search (model-ranked top-k + capped hill-climb) is from simulating every split,
    on drawn workloads with 65-400 splits (below 65 the search is exhaustive already)."""
    rows = []
    for seed in range(args.first_seed, args.first_seed + args.workloads):
        r = _gap_one(seed, args.quick)
        if r is None:
            continue
        rows.append(r)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    out = {"workloads": len(rows), "max_gap": max((r["gap"] for r in rows), default=0.0),
           "median_gap": statistics.median(r["gap"] for r in rows) if rows else 0.0, "rows": rows}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("workloads", "max_gap", "median_gap")}))


#: `cfg.seed` of a drawn workload's other realizations: the same workload, other sampled lengths.
REALIZATION_SEEDS = 1000


def _realization_one(seed: int, quick: bool, realization: int,
                     splits: list[dict[str, int]]) -> dict[str, Any]:
    """Colocated, shiftable and each of `splits`, on one other realization of drawn workload `seed`."""
    from pivotrl.sim.compare import simulate
    from pivotrl.sim.randomized import draw_config

    cfg, _ = draw_config(seed, quick)
    cfg = cfg.model_copy(update={"seed": REALIZATION_SEEDS + realization})
    return {
        "colocated": simulate(cfg, "colocated", record=False).tokens_per_s_per_device,
        "shiftable": simulate(cfg, "shiftable", record=False).tokens_per_s_per_device,
        "static": [simulate(cfg, "disaggregated", s, record=False).tokens_per_s_per_device for s in splits],
    }


def _searched_splits(seed: int, quick: bool, top: int) -> list[dict[str, int]]:
    """The static search's `top` best splits on the draw's own lengths (the random benchmark's search)."""
    from pivotrl.sim.compare import best_static
    from pivotrl.sim.randomized import draw_config

    cfg, _ = draw_config(seed, quick)
    _, search = best_static(cfg)
    return [dict(r["split"]) for r in search["ranking"][:top]]


def realization_row(seed: int, splits: list[dict[str, int]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One draw over its realizations (`runs`, one `_realization_one` each). `expected_ratio`: shiftable's
    median tokens/s over the best median of colocated and each split, every plan fixed before any lengths
    are seen. `hindsight_ratios`: per realization, shiftable over the best of colocated and the splits on
    that realization's own lengths, as `random` compares (a baseline chosen after the fact)."""
    med = statistics.median
    shift = [r["shiftable"] for r in runs]
    colo = [r["colocated"] for r in runs]
    static = [[r["static"][i] for r in runs] for i in range(len(splits))]
    baselines = {"colocated": med(colo), **{_split_name(s): med(v) for s, v in zip(splits, static)}}
    best_name = max(baselines, key=lambda k: baselines[k])
    hindsight = [r["shiftable"] / max([r["colocated"], *r["static"]]) for r in runs]
    return {
        "seed": seed,
        "realizations": len(runs),
        "splits": [_split_name(s) for s in splits],
        "median_tokens_per_s_per_device": {"shiftable": med(shift), **baselines},
        "best_expected_baseline": best_name,
        "expected_ratio": med(shift) / baselines[best_name],
        "hindsight_ratios": hindsight,
        "median_hindsight_ratio": med(hindsight),
        "realizations_below_0.99": sum(h < 0.99 for h in hindsight),
    }


def _split_name(split: Mapping[str, int]) -> str:
    return "/".join(str(split[r]) for r in ("rollout", "reward", "train"))


def realizations(args: argparse.Namespace) -> None:
    """Drawn workloads (`random`'s draws) run again on `--realizations` other samples of their lengths:
    colocated, shiftable and the static search's `--top` splits from the draw's own lengths. A draw whose
    `expected_ratio` is >= 0.99 loses only where the baseline is the luckiest of several near-equal plans
    on the lengths that came out; one below it loses in expectation. Ratio summary printed last."""
    t0 = time.perf_counter()
    seeds = args.seeds
    rows = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        splits = dict(zip(seeds, pool.map(_searched_splits, seeds, [args.quick] * len(seeds),
                                          [args.top] * len(seeds))))
        futs = {f"seed {s} realization {i}": pool.submit(_realization_one, s, args.quick, i, splits[s])
                for s in seeds for i in range(args.realizations)}
        done = dict(in_order(pool, futs))
        for s in seeds:
            row = realization_row(s, splits[s], [done[f"seed {s} realization {i}"]
                                                for i in range(args.realizations)])
            rows.append(row)
            print(f"seed {s:3d}: expected {row['expected_ratio']:.4f} "
                  f"(best {row['best_expected_baseline']}), "
                  f"hindsight median {row['median_hindsight_ratio']:.4f}, "
                  f"{row['realizations_below_0.99']}/{row['realizations']} below 0.99", flush=True)
    out = {
        "quick": args.quick,
        "draws": len(rows),
        "realizations": args.realizations,
        "worst_expected_ratio": min(r["expected_ratio"] for r in rows),
        "median_expected_ratio": statistics.median(r["expected_ratio"] for r in rows),
        "expected_losses": [r["seed"] for r in rows if r["expected_ratio"] < 0.99],
        "median_hindsight_ratio": statistics.median(h for r in rows for h in r["hindsight_ratios"]),
        "wall_s": time.perf_counter() - t0,
        "rows": rows,
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    keys = ("draws", "realizations", "expected_losses", "median_hindsight_ratio", "median_expected_ratio",
            "worst_expected_ratio")
    print(json.dumps({k: round(out[k], 4) if isinstance(out[k], float) else out[k] for k in keys}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("paper")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "docs/sim-paper.json"))
    p.add_argument("--plot", default=str(ROOT / "docs/sim-paper-allocation.png"))
    s = sub.add_parser("sweep")
    s.add_argument("--jobs", type=int, default=2)
    s.add_argument("--static-from", default=None, metavar="SWEEP.json",
                   help="reuse each point's best static split from an earlier sweep JSON (skip the search) "
                        "and simulate colocated, that split and shiftable for every --seeds")
    s.add_argument("--seeds", default="0", help="with --static-from: comma-separated seeds (medians)")
    s.add_argument("--out", default=str(ROOT / "docs/sim-sweep.json"))
    s.add_argument("--table", default=str(ROOT / "docs/sim-sweep-table.md"))
    s.add_argument("--plot", default=str(ROOT / "docs/sim-sweep.png"))
    sub.add_parser("speed")
    t = sub.add_parser("table")
    t.add_argument("--out", default=str(ROOT / "docs/sim-sweep.json"))
    t.add_argument("--table", default=str(ROOT / "docs/sim-sweep-table.md"))
    t.add_argument("--plot", default=str(ROOT / "docs/sim-sweep.png"))
    rnd = sub.add_parser("random")
    rnd.add_argument("--quick", action="store_true", help="smaller draws (16-64 sequences per device, <= 6k "
                     "per iteration, 2 iterations)")
    rnd.add_argument("--workloads", type=int, default=52, help="how many workloads (>= 50 for acceptance)")
    rnd.add_argument("--first-seed", type=int, default=0)
    rnd.add_argument("--jobs", type=int, default=2)
    rnd.add_argument("--json", dest="json_out", default=None, metavar="OUT.json")
    rnd.add_argument("--search-top-k", type=_at_least_one, default=None, metavar="K",
                     help="a deeper static baseline: the model's K best splits (default: the draw's 3)")
    rnd.add_argument("--search-simulations", type=_at_least_one, default=None, metavar="N",
                     help="... and at most N splits in all (default: the draw's 12 with --quick, else 24)")
    gap = sub.add_parser("static-gap")
    gap.add_argument("--quick", action="store_true")
    gap.add_argument("--workloads", type=int, default=12, help="seeds to draw (those with 65-400 splits run)")
    gap.add_argument("--first-seed", type=int, default=0)
    gap.add_argument("--json", dest="json_out", default=None, metavar="OUT.json")
    rz = sub.add_parser("realizations")
    rz.add_argument("--seeds", required=True, type=_seed_list, help="comma-separated draw seeds (`random`'s)")
    rz.add_argument("--quick", action="store_true", help="the draws as `random --quick` makes them")
    rz.add_argument("--realizations", type=_at_least_one, default=8, help="other length samples per draw")
    rz.add_argument("--top", type=_at_least_one, default=4, help="the static search's best splits to rerun")
    rz.add_argument("--jobs", type=_at_least_one, default=2)
    rz.add_argument("--json", dest="json_out", default=None, metavar="OUT.json")
    args = ap.parse_args()
    cmds = {"paper": paper, "sweep": sweep, "speed": speed, "table": table, "random": random_workloads,
            "static-gap": static_gap, "realizations": realizations}
    cmds[args.cmd](args)


if __name__ == "__main__":
    main()
