"""The end-of-iteration train barrier, driver-owned optimizer against the sharded train group.

    python -m benchmarks.train_step --quick --json OUT.json

The barrier, as the issue writes it (last gradient → reduce → optimizer step → publish → readable): from
the moment both train replicas' gradient sums are complete in their workers' memory, through each one's
flush (`TrainContext.flush`'s own code, `pivotrl.runtime.handover.flush_sum`: written to the store for the
driver-owned design, handed over in memory to the rank for the sharded one), reduce → optimizer step →
publish, until the new version is readable by a rollout device (a task fetches it whole, read-only, from
its worker's long-lived store, as a role context does). Two policy sizes (`small`, ~12.6 M parameters, and
`medium`, ~63 M, built here from `pivotrl.engines.checkpoints.MODEL_SIZES`), 2 device workers on a
LocalCluster, each worker holding one sum (two train replicas). The driver-owned design is
`pivotrl.grpo.PolicyUpdater` in the driver process; the sharded one is `pivotrl.sharded_updater`. Each
design runs in its own driver subprocess, so each one's `ru_maxrss` is its own peak; the designs take
turns, round by round, and every repeat of every round is pooled.

Keys: `barrier_s_driver`, `barrier_s_sharded` (per size: medians over the repeats), `ratio_barrier_speedup`
(driver / sharded at the larger size), `driver_peak_rss_mb_driver`, `driver_peak_rss_mb_sharded`,
`barrier_s_after_flush_*` and `ratio_after_flush` (the same barriers timed from the flushed sums on, this
benchmark's clock before the flush joined it), `times_*` (every repeat's barrier), and `phases_driver` /
`phases_sharded` (per size, the median seconds of each phase: where the barrier went). Both: `flush`.
Driver phases: `fetch` (the sums from the store), `step` (reduce, clip, AdamW), `publish`. Sharded: `plan`
(the scheduler call), then per phase the slowest rank (`r<i>.<phase>` each rank's own): `dispatch` (task
start minus submit), `form` (group formation, 0 while membership holds), `fetch` (sums not handed over in
memory), `settle` (the previous step's behind-the-barrier write, if still running), `counts`, `pack`,
`exchange` and `sum` (the bucketed reduce-scatter; through shared memory between ranks of one host),
`clip`, `adam`, `targets`, `shard_write`, `written_barrier`, `commit`. Both: `apply` (the updater's whole
step), `read` (the rollout device's load), and `behind`: the optimizer-state write and gc the sharded
ranks do after the barrier (overlapping `read`; a run has a whole iteration before the next barrier, so
here it is let finish, untimed, between repeats).

Both drivers and the workers keep freed heap memory (`pivotrl.malloc.keep_freed_memory`), as `pivotrl.run`
and the worker plugin set them up in a run. Printed last: the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = ("small", "medium")
#: The store keeps this many versions (a run's default is 3); each barrier's gc deletes the one before.
KEEP_LAST = 2
#: Untimed barriers before the timed ones: a run's steady state, where each version's files land in page
#: cache the gc of an older one has just freed. Until the gc first deletes (KEEP_LAST barriers), every write
#: takes fresh pages, and on this VM (free-page reporting on: the host reclaims freed guest memory) a
#: 126 MB shard write then took 0.4-0.5 s instead of 0.05 s; both designs get the same warm-up, and its
#: barriers are reported beside (`warmup_times_*`).
WARMUP = KEEP_LAST + 1


def make_sum(policy: str, version: int, gps: dict[str, Any], name: str, seed: int) -> None:
    """On a worker: a train replica's gradient sum of the iteration — random gradients of the policy's
    shapes, in this worker's memory — as it stands when its last micro-batch is done (untimed)."""
    import torch
    from distributed import get_worker

    from pivotrl.engines.grpo_loss import GradSum

    torch.set_num_threads(1)
    man = _worker_store(gps).manifest(policy, version)
    g = torch.Generator().manual_seed(seed)
    grads = {t.name: torch.randn(t.shape, generator=g) * 1e-3 for t in man.tensors}
    get_worker().__dict__["_bench_train_step_sum"] = GradSum(grads=grads, tokens=1000 + seed, samples=8,
                                                             version=version)


def flush_sum(gps: dict[str, Any], name: str, hand_over: bool) -> dict[str, Any]:
    """On a worker: the replica's flush at the barrier, `TrainContext.flush`'s own code
    (`pivotrl.runtime.handover.flush_sum`): persisted before it returns for the driver-owned design;
    handed over in memory to the rank here, and persisted behind the barrier, for the sharded one.
    Returns what its `GradResult` carries."""
    from distributed import get_worker

    from pivotrl.runtime.handover import flush_sum as flush

    gs = get_worker().__dict__.pop("_bench_train_step_sum")
    v = flush(_worker_store(gps), name, gs, hand_over=hand_over)
    return {"model": name, "version": v, "tokens": gs.tokens, "samples": gs.samples}


def _worker_store(gps: dict[str, Any]) -> Any:
    """The worker's long-lived store, as a device worker's `env.gps` is (write-behind on, no device tier),
    kept on the Dask worker object: this module runs as `__main__`, whose globals each task gets afresh."""
    from distributed import get_worker

    from pivotrl.gps import ParameterStore

    stores = get_worker().__dict__.setdefault("_bench_train_step_stores", {})
    if gps["root"] not in stores:
        stores[gps["root"]] = ParameterStore(gps["root"], device_tier_bytes=0)
    return stores[gps["root"]]


def read_version(policy: str, version: int, gps: dict[str, Any]) -> float:
    """On a worker: a rollout device loading the new version (the barrier ends when it has it), as a role
    context does (`RoleContext.fetch`: a read-only fetch from the worker's long-lived store); returns the
    seconds the fetch itself took (the rest of `read` is the task's round trip)."""
    t0 = time.perf_counter()
    sd = _worker_store(gps).fetch(policy, version, copy=False)
    assert sum(t.numel() for t in sd.values()) > 0
    return time.perf_counter() - t0


def step_phases(stats: dict[str, Any], rank_phases: list[dict[str, float]]) -> dict[str, float]:
    """Seconds per phase of one step, from the updater's `last_stats`: the driver owner's fetch / step /
    publish; for the train group the driver's plan call and, per phase, the slowest rank (`r<i>.<phase>`
    keeps each rank's own figure too)."""
    out = {k[:-2]: float(stats[k]) for k in ("fetch_s", "step_s", "publish_s", "plan_s", "ranks_s")
           if k in stats}
    for i, ph in enumerate(rank_phases):
        for k, x in ph.items():
            out[k] = max(out.get(k, 0.0), float(x))
            out[f"r{i}.{k}"] = float(x)
    return out


def _set_threads() -> None:
    """A device worker as the pivotrl worker plugin sets it up: one torch thread, freed memory kept."""
    import torch

    from pivotrl.malloc import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()


def child(design: str, sizes: list[str], repeats: int, root: Path) -> dict[str, Any]:
    """One driver process: every size, `repeats` barriers (after `WARMUP` untimed ones) of one design."""
    from distributed import Client, LocalCluster

    from pivotrl.config import PipelineConfig, load_config
    from pivotrl.engines.checkpoints import PAD_ID, ensure_model
    from pivotrl.gps import ParameterStore
    from pivotrl.grpo import PolicyUpdater
    from pivotrl.malloc import keep_freed_memory
    from pivotrl.runtime.messages import GradResult, GradStats
    from pivotrl.runtime.train_plugin import TrainGroupPlugin
    from pivotrl.runtime.train_worker import publish_initial
    from pivotrl.sharded_updater import ShardedUpdater

    keep_freed_memory()  # as `pivotrl.run` does for the driver (its optimizer steps)
    out: dict[str, Any] = {}
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as lc, \
            Client(lc) as client:
        client.register_plugin(TrainGroupPlugin())
        client.run(_set_threads)
        workers = sorted(client.scheduler_info()["workers"])
        for size in sizes:
            hf = ensure_model(root, f"bench-{size}", size)
            sets = [f"run.storage_root={root}", f"gps.keep_last={KEEP_LAST}"]
            cfg = load_config(None, PipelineConfig, sets)
            gps = {"root": str(root / f"gps-{design}-{size}-{os.getpid()}")}
            name = cfg.models.policy.name
            if design == "driver":
                store = ParameterStore(gps["root"], device_tier_bytes=0)
                up: Any = PolicyUpdater.load(cfg, hf, store)
                up.publish()
            else:
                client.submit(publish_initial, name, str(hf), gps, workers=workers[:1]).result()
                up = ShardedUpdater(cfg, client, gps, str(hf), PAD_ID, timeout_s=600)
            times, after_flush, warmup = [], [], []
            phases: dict[str, list[float]] = {}
            for rep in range(repeats + WARMUP):
                v = up.version
                client.gather([client.submit(make_sum, name, v, gps, f"grad-w{i}", 100 * rep + i,
                                             workers=[w], pure=False) for i, w in enumerate(workers)])
                t0 = time.perf_counter()
                refs = [client.submit(flush_sum, gps, f"grad-w{i}", design == "sharded", workers=[w],
                                      pure=False) for i, w in enumerate(workers)]
                grads = [GradResult(r["model"], r["version"], [], GradStats(r["tokens"], r["samples"], v),
                                    worker=w) for r, w in zip(client.gather(refs), workers, strict=True)]
                t_flushed = time.perf_counter()
                nv = up.apply(grads, rep)
                t1 = time.perf_counter()
                fetch_s = client.submit(read_version, name, nv, gps, workers=workers[1:], pure=False).result()
                t2 = time.perf_counter()
                dt = t2 - t0
                # The sharded owner writes the optimizer state behind the barrier (it overlaps the read
                # above, and in a run the whole next iteration); here the next barrier follows at once, so
                # it is let finish between the two, untimed, and reported as `behind`.
                if hasattr(up, "settle"):
                    up.settle()
                got = step_phases(up.last_stats, getattr(up, "last_phases", []))
                got.update(flush=t_flushed - t0, apply=t1 - t_flushed, read=t2 - t1, read_fetch=fetch_s,
                           behind=time.perf_counter() - t2)
                if rep < WARMUP:
                    warmup.append(dt)
                else:
                    times.append(dt)
                    after_flush.append(t2 - t_flushed)
                    for k, x in got.items():
                        phases.setdefault(k, []).append(x)
                shown = {k: round(x, 3) for k, x in got.items()}
                print(f"{design} {size} rep {rep}: {dt:.3f}s {shown}", file=sys.stderr, flush=True)
            out[size] = {"times": times, "after_flush": after_flush, "phases": phases, "warmup": warmup}
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def pooled(parts: list[dict[str, Any]], sizes: list[str]) -> dict[str, Any]:
    """One design's rounds pooled: per size the median barrier, the median from the flush on, and each
    phase's median over every repeat of every round; the peak RSS is the largest of its processes'."""
    out: dict[str, Any] = {"peak_rss_mb": max(p["peak_rss_mb"] for p in parts)}
    for s in sizes:
        runs = [p[s] for p in parts]
        out[s] = statistics.median([x for r in runs for x in r["times"]])
        out[f"after_flush_{s}"] = statistics.median([x for r in runs for x in r["after_flush"]])
        out[f"times_{s}"] = [round(x, 4) for r in runs for x in r["times"]]
        out[f"warmup_{s}"] = [round(x, 4) for r in runs for x in r["warmup"]]
        keys = dict.fromkeys(k for r in runs for k in r["phases"])
        out[f"phases_{s}"] = {
            k: round(statistics.median([x for r in runs for x in r["phases"].get(k, [])]), 4) for k in keys}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="2 rounds of 4 repeats per size and design (default 3 rounds of 5)")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--child", choices=["driver", "sharded"], help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help="storage root (default: a temporary directory)")
    ap.add_argument("--sizes", default=",".join(SIZES))
    a = ap.parse_args(argv)
    rounds, repeats = (2, 4) if a.quick else (3, 5)
    sizes = a.sizes.split(",")
    if a.child:
        res = child(a.child, sizes, repeats, a.root)
        a.json.write_text(json.dumps(res))
        return 0
    # The designs take turns (driver, sharded, driver, ...): this VM's speed drifts over minutes, and one
    # design's whole series in a slow spell would decide the ratio.
    parts: dict[str, list[dict[str, Any]]] = {"driver": [], "sharded": []}
    with tempfile.TemporaryDirectory(prefix="pivotrl-train-step-") as tmp:
        root = a.root or Path(tmp)
        for rnd in range(rounds):
            for design in ("driver", "sharded"):
                part = root / f"{design}-{rnd}.json"
                cmd = [sys.executable, "-m", "benchmarks.train_step", "--child", design, "--root", str(root),
                       "--json", str(part), "--sizes", ",".join(sizes)] + (["--quick"] if a.quick else [])
                subprocess.run(cmd, check=True)
                parts[design].append(json.loads(part.read_text()))
    got = {d: pooled(ps, sizes) for d, ps in parts.items()}
    big = sizes[-1]
    result = {
        "barrier_s_driver": {s: got["driver"][s] for s in sizes},
        "barrier_s_sharded": {s: got["sharded"][s] for s in sizes},
        "driver_peak_rss_mb_driver": got["driver"]["peak_rss_mb"],
        "driver_peak_rss_mb_sharded": got["sharded"]["peak_rss_mb"],
        "ratio_barrier_speedup": got["driver"][big] / got["sharded"][big],
        # The same barriers timed from the moment both sums were flushed (this benchmark's clock before
        # the flush joined it): what the designs' reduce-to-readable parts alone compare as.
        "barrier_s_after_flush_driver": {s: got["driver"][f"after_flush_{s}"] for s in sizes},
        "barrier_s_after_flush_sharded": {s: got["sharded"][f"after_flush_{s}"] for s in sizes},
        "ratio_after_flush": got["driver"][f"after_flush_{big}"] / got["sharded"][f"after_flush_{big}"],
        # Where each barrier went (medians per phase, seconds): `apply` is the updater's whole step,
        # `read` the rollout device's fetch of the new version; see `step_phases` for the rest.
        "phases_driver": {s: got["driver"][f"phases_{s}"] for s in sizes},
        "phases_sharded": {s: got["sharded"][f"phases_{s}"] for s in sizes},
        "times_driver": {s: got["driver"][f"times_{s}"] for s in sizes},
        "times_sharded": {s: got["sharded"][f"times_{s}"] for s in sizes},
        "warmup_times_driver": {s: got["driver"][f"warmup_{s}"] for s in sizes},
        "warmup_times_sharded": {s: got["sharded"][f"warmup_{s}"] for s in sizes},
    }
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    for k, v in result.items():
        if k != "ratio_barrier_speedup" and not k.startswith(("phases_", "times_", "warmup_")):
            print(f"{k}: {v}")
    print(f"ratio_barrier_speedup: {result['ratio_barrier_speedup']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
