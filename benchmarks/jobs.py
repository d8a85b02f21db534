"""The worked example of a real job, end to end: `configs/examples/jsonl-math.yaml` through `run_pipeline`
(the code `pivotrl-pipeline submit` runs) on a local Dask cluster.

It answers "does a user's job run, and is its bookkeeping right": the run completes, the judge's verdicts
parse (the unparseable share), the store is bounded by `gps.keep_last` (policy versions left on disk),
and held-out accuracy under the verifier before and after. Not a speed benchmark: no ratio is claimed.
Exits 1 when the run fails (the JSON then says `completed: false` and why).

    python -m benchmarks.jobs --quick --json OUT.json     # 3 iterations
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from pivotrl.config import PipelineConfig, add_override_argument, load_config

EXAMPLE = Path(__file__).resolve().parents[1] / "configs/examples/jsonl-math.yaml"


def summarize(cfg: PipelineConfig, res: Any) -> dict[str, Any]:
    """The benchmark's keys from a finished run (`pivotrl.run.RunResult`)."""
    from pivotrl.gps import ParameterStore

    rows = res.iterations
    judged = sum(int(r.get("judged", 0)) for r in rows)
    unparsed = sum(int(r.get("judge_unparsed", 0)) for r in rows)
    agree = [r["judge_agreement"] for r in rows if "judge_agreement" in r]
    gps_root = cfg.gps.root or str(res.run_dir / "gps")
    with ParameterStore(gps_root, device_tier_bytes=0) as store:
        versions = store.versions(cfg.models.policy.name)
    return {
        "completed": len(rows) == cfg.run.iterations,
        "iterations": len(rows),
        "judged": judged,
        "judge_unparseable_fraction": unparsed / judged if judged else math.nan,
        "judge_agreement_percent": sum(agree) / len(agree) if agree else math.nan,
        "storage_versions_policy": len(versions),
        "storage_policy_versions": versions,
        "gps_keep_last": cfg.gps.keep_last,
        "heldout_accuracy_start": res.eval.get("accuracy_before", math.nan),
        "heldout_accuracy_end": res.eval.get("accuracy_after", math.nan),
        "epochs": rows[-1].get("epochs", math.nan) if rows else 0.0,
        "final_policy_version": rows[-1]["version"] if rows else 0,
        "run_dir": str(res.run_dir),
        "wall_s": res.wall_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(EXAMPLE))
    ap.add_argument("--quick", action="store_true", help="3 iterations")
    ap.add_argument("--iterations", type=int, help="default: 3 with --quick, else the config's")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the result here")
    add_override_argument(ap, "run.storage_root=storage")
    args = ap.parse_args(argv)
    for name in ("distributed", "distributed.worker", "distributed.scheduler", "distributed.nanny"):
        logging.getLogger(name).setLevel(logging.ERROR)

    overrides = list(args.overrides)
    iterations = args.iterations or (3 if args.quick else None)
    if iterations is not None:
        overrides.append(f"run.iterations={iterations}")
    overrides.append("cluster.dashboard_address=null")
    out: dict[str, Any] = {"config": args.config, "overrides": overrides, "completed": False}
    t0 = time.monotonic()
    try:
        from pivotrl.run import run_pipeline

        cfg = load_config(args.config, PipelineConfig, overrides)
        res = run_pipeline(cfg, workers=args.workers, progress=False, log=print)
        out.update(summarize(cfg, res))
    except Exception as exc:  # the benchmark reports a failed run in its JSON and its exit code
        out["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    out["benchmark_s"] = time.monotonic() - t0
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=float))
    print(
        f"jobs: completed {out['completed']}, {out.get('iterations', 0)} iterations, judge unparseable "
        f"{out.get('judge_unparseable_fraction', math.nan):.3f}, policy versions stored "
        f"{out.get('storage_versions_policy', '?')} (keep_last {out.get('gps_keep_last', '?')} + pinned v0), "
        f"held-out accuracy {out.get('heldout_accuracy_start', math.nan):.1f}% -> "
        f"{out.get('heldout_accuracy_end', math.nan):.1f}%"
    )
    return 0 if out["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
