"""`pivotrl-pipeline submit CONFIG`: run a pipeline on a Dask cluster (local by default).

Prints the dashboard URL, a progress bar per iteration (reward, accuracy, tokens/s, role allocation),
every role shift with its phase timings, and where the metrics (xarray → Zarr) and the final policy (HF
format) were written. Exit 0 on success, 2 on bad input (one line, no traceback).
"""

from __future__ import annotations

import argparse
import logging
import sys

from pivotrl.config import add_override_argument
from pivotrl.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="pipeline config (YAML), e.g. configs/quickstart.yaml")
    parser.add_argument(
        "--mode",
        choices=["colocated", "disaggregated", "shiftable"],
        help="deployment paradigm (default: scheduler.mode of the config)",
    )
    parser.add_argument(
        "--workers", type=int, help="device workers of a local cluster (default: one per core)"
    )
    parser.add_argument(
        "--scheduler", metavar="ADDR", help="connect to an existing Dask scheduler, tcp://host:port"
    )
    add_override_argument(parser, "train.lr=1e-4")
    parser.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        metavar="RUN_ID",
        help="continue a run from its last checkpoint: a run id under run.storage_root/runs, or latest",
    )
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out accuracy evaluation")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from pivotrl.config import load_config

    cfg = load_config(args.config, overrides=args.overrides)
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers {args.workers}: must be >= 1")
    if args.mode == "disaggregated" or (args.mode is None and cfg.scheduler.mode == "disaggregated"):
        split = cfg.scheduler.static_split
        if split is not None and args.workers is not None and sum(split.values()) > args.workers:
            raise UserError(
                f"scheduler.static_split needs {sum(split.values())} devices; --workers is {args.workers}"
            )
    for name in ("distributed", "distributed.worker", "distributed.scheduler", "distributed.nanny"):
        logging.getLogger(name).setLevel(logging.ERROR)

    from tqdm import tqdm

    from pivotrl.run import run_pipeline

    def log(msg: str) -> None:
        tqdm.write(msg, file=sys.stdout)

    res = run_pipeline(
        cfg,
        mode=args.mode,
        workers=args.workers,
        scheduler=args.scheduler,
        log=log,
        progress=not args.quiet,
        evaluate_policy=not args.no_eval,
        resume=args.resume,
    )
    shifts = res.shifts
    log(
        f"done in {res.wall_s:.1f}s: {len(res.iterations)} iterations on {res.devices} devices, "
        f"{len(shifts)} role shifts"
    )
    if shifts:
        from pivotrl.runtime.metrics import PHASES, shift_phase

        for ph in PHASES:
            vals = [shift_phase(e, ph) for e in shifts]
            log(f"  mean shift {ph:<7} {sum(vals) / len(vals):.3f}s")
    if res.eval:
        log("held-out accuracy: " + ", ".join(f"{k} {v:.1f}" for k, v in res.eval.items()))
    log(f"metrics: {res.run_dir / 'metrics.zarr'}")
    if res.final_policy is not None:
        log(f"final policy (HF format): {res.final_policy}")
    return 0
