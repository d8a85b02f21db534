"""The end-of-iteration train barrier, driver-owned optimizer against the sharded train group.

    python -m benchmarks.train_step --quick --json OUT.json

The barrier: from the moment the last train replica's gradient sum is flushed to the parameter store,
through reduce → optimizer step → publish, until the new version is readable by a rollout device (a task
on a device worker fetches it whole). Two policy sizes (`small`, ~12.6 M parameters, and `medium`,
~63 M, built here from `pivotrl.engines.checkpoints.MODEL_SIZES`), 2 device workers on a LocalCluster,
each worker holding one flushed sum (two train replicas). The driver-owned design is
`pivotrl.grpo.PolicyUpdater` in the driver process; the sharded one is `pivotrl.sharded_updater`.
Each design runs in its own driver subprocess, so each one's `ru_maxrss` is its own peak.

Keys: `barrier_s_driver`, `barrier_s_sharded` (per size: medians over the repeats), `ratio_barrier_speedup`
(driver / sharded at the larger size), `driver_peak_rss_mb_driver`, `driver_peak_rss_mb_sharded`, and
`phases_driver` / `phases_sharded` (per size, the median seconds of each phase: where the barrier went).
Driver phases: `fetch` (the sums from the store), `step` (reduce, clip, AdamW), `publish`. Sharded: `plan`
(the scheduler call), then per phase the slowest rank (`r<i>.<phase>` each rank's own): `dispatch` (task
start minus submit), `form` (group formation, 0 while membership holds), `fetch` (sums not handed over in
memory), `settle` (the previous step's behind-the-barrier write, if still running), `counts`, `pack`,
`exchange` and `sum` (the bucketed reduce-scatter), `clip`, `adam`, `targets`, `shard_write`,
`written_barrier`, `commit`. Both: `apply` (the updater's whole step), `read` (the rollout device's load),
and `behind`: the optimizer-state write and gc the sharded ranks do after the barrier (overlapping `read`;
a run has a whole iteration before the next barrier, so here it is let finish, untimed, between repeats).

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


def make_sum(policy: str, version: int, gps: dict[str, Any], name: str, seed: int,
             hand_over: bool = False) -> dict[str, Any]:
    """On a worker: a train replica's flushed sum — random gradients of the policy's shapes — published
    under `name` (and, for the sharded owner, handed over in memory to the rank on this device, as
    `TrainContext.flush` does with `hand_over` set); returns what its `GradResult` would carry."""
    import torch

    from pivotrl.engines.trainer import GradSum
    from pivotrl.gps import ParameterStore
    from pivotrl.runtime.handover import hand_over as keep_for_rank

    torch.set_num_threads(1)
    with ParameterStore(gps["root"], device_tier_bytes=0, write_behind=False) as store:
        man = store.manifest(policy, version)
        g = torch.Generator().manual_seed(seed)
        grads = {t.name: torch.randn(t.shape, generator=g) * 1e-3 for t in man.tensors}
        v = max(store.versions(name), default=-1) + 1 if name in store.models() else 0
        store.publish(name, v, grads)
    out = {"model": name, "version": v, "tokens": 1000 + seed, "samples": 8}
    if hand_over:
        gs = GradSum(grads=grads, tokens=out["tokens"], samples=8, version=version)
        keep_for_rank(name, v, gs)
    return out


def read_version(policy: str, version: int, gps: dict[str, Any]) -> float:
    """On a worker: a rollout device loading the new version (the barrier ends when it has it), as a role
    context does (`RoleContext.fetch`: a read-only fetch from the worker's long-lived store, here kept on
    the Dask worker object: this module runs as `__main__`, whose globals each task gets afresh); returns
    the seconds the fetch itself took (the rest of `read` is the task's round trip)."""
    from distributed import get_worker

    from pivotrl.gps import ParameterStore

    t0 = time.perf_counter()
    w = get_worker()
    readers = w.__dict__.setdefault("_bench_train_step_readers", {})
    if gps["root"] not in readers:
        readers[gps["root"]] = ParameterStore(gps["root"], device_tier_bytes=0)
    sd = readers[gps["root"]].fetch(policy, version, copy=False)
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
    """One driver process: every size, `repeats` barriers (+1 warm-up) of one design."""
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
            cfg = load_config(None, PipelineConfig, [f"run.storage_root={root}", "gps.keep_last=2"])
            gps = {"root": str(root / f"gps-{design}-{size}-{os.getpid()}")}
            name = cfg.models.policy.name
            if design == "driver":
                store = ParameterStore(gps["root"], device_tier_bytes=0)
                up: Any = PolicyUpdater.load(cfg, hf, store)
                up.publish()
            else:
                client.submit(publish_initial, name, str(hf), gps, workers=workers[:1]).result()
                up = ShardedUpdater(cfg, client, gps, str(hf), PAD_ID, timeout_s=600)
            times = []
            phases: dict[str, list[float]] = {}
            for rep in range(repeats + 1):
                v = up.version
                refs = [client.submit(make_sum, name, v, gps, f"grad-w{i}", 100 * rep + i,
                                      design == "sharded", workers=[w], pure=False)
                        for i, w in enumerate(workers)]
                grads = [GradResult(r["model"], r["version"], [], GradStats(r["tokens"], r["samples"], v),
                                    worker=w) for r, w in zip(client.gather(refs), workers, strict=True)]
                t0 = time.perf_counter()
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
                got.update(apply=t1 - t0, read=t2 - t1, read_fetch=fetch_s, behind=time.perf_counter() - t2)
                if rep > 0:
                    times.append(dt)
                    for k, x in got.items():
                        phases.setdefault(k, []).append(x)
                shown = {k: round(x, 3) for k, x in got.items()}
                print(f"{design} {size} rep {rep}: {dt:.3f}s {shown}", file=sys.stderr, flush=True)
            out[size] = statistics.median(times)
            out[f"phases_{size}"] = {k: round(statistics.median(xs), 4) for k, xs in phases.items()}
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 repeats per size (default 7)")
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--child", choices=["driver", "sharded"], help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help="storage root (default: a temporary directory)")
    ap.add_argument("--sizes", default=",".join(SIZES))
    a = ap.parse_args(argv)
    repeats = 3 if a.quick else 7
    sizes = a.sizes.split(",")
    if a.child:
        res = child(a.child, sizes, repeats, a.root)
        a.json.write_text(json.dumps(res))
        return 0
    with tempfile.TemporaryDirectory(prefix="pivotrl-train-step-") as tmp:
        root = a.root or Path(tmp)
        got = {}
        for design in ("driver", "sharded"):
            part = root / f"{design}.json"
            cmd = [sys.executable, "-m", "benchmarks.train_step", "--child", design, "--root", str(root),
                   "--json", str(part), "--sizes", ",".join(sizes)] + (["--quick"] if a.quick else [])
            subprocess.run(cmd, check=True)
            got[design] = json.loads(part.read_text())
    big = sizes[-1]
    result = {
        "barrier_s_driver": {s: got["driver"][s] for s in sizes},
        "barrier_s_sharded": {s: got["sharded"][s] for s in sizes},
        "driver_peak_rss_mb_driver": got["driver"]["peak_rss_mb"],
        "driver_peak_rss_mb_sharded": got["sharded"]["peak_rss_mb"],
        "ratio_barrier_speedup": got["driver"][big] / got["sharded"][big],
        # Where each barrier went (medians per phase, seconds): `apply` is the updater's whole step,
        # `read` the rollout device's fetch of the new version; see `step_phases` for the rest.
        "phases_driver": {s: got["driver"][f"phases_{s}"] for s in sizes},
        "phases_sharded": {s: got["sharded"][f"phases_{s}"] for s in sizes},
    }
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    for k, v in result.items():
        if k != "ratio_barrier_speedup" and not k.startswith("phases_"):
            print(f"{k}: {v}")
    print(f"ratio_barrier_speedup: {result['ratio_barrier_speedup']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
