"""Kill-and-resume against an uninterrupted run: the same config, `--workers 1` (or 2), debug-size models.

    python -m benchmarks.resume --quick --json OUT.json

The interrupted run is SIGKILLed again and again — at named fault points (inside an iteration as its work
comes back, inside the optimizer step, between publishing a version and making it durable, halfway through
writing a checkpoint; `pivotrl.faults`) and at random wall-clock moments — and each time continued with
`pivotrl-pipeline submit --resume latest`, until a last resume runs to the end. Then its metrics rows and
final policy are compared with the uninterrupted run's.

Keys: `kills` (processes that died by SIGKILL), `resumed_ok` (every resume started and the last one
finished), `iterations_repeated` and `iterations_skipped` (in the final run's metrics: must be 0),
`final_policy_bit_identical`, `resume_overhead_s` (median, from loading the checkpoint to the resumed run's
first optimizer step: cluster start and weight loads included). With `--workers 2` also
`final_policy_within_tolerance` (max |Δ| ≤ `--tolerance`: two replicas' gradient sums may be reduced in
another order). Printed last: `final_policy_bit_identical`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OVERHEAD = "resume overhead:"
POINTS = ["optimizer_step:2", "publish:1", "checkpoint:1", "collect:3"]  # the first kills a fresh run


def write_config(root: Path, storage: Path, iterations: int, max_staleness: int = 0) -> Path:
    cfg = root / f"{storage.name}.yaml"
    cfg.write_text(
        f"""run: {{name: resume, iterations: {iterations}, storage_root: {storage}, seed: 3,
      max_staleness: {max_staleness}}}
models:
  policy: {{name: policy, path: {root / "models" / "policy"}}}
  genrm: {{name: genrm, path: {root / "models" / "judge"}}}
task: {{name: sort, prompts_per_iteration: 4, group_size: 4, eval_prompts: 4}}
rollout: {{sampling: {{max_new_tokens: 24}}, engine: {{max_batch: 16, kv_budget_tokens: 4096}}}}
reward: {{sampling: {{max_new_tokens: 16}}, engine: {{max_batch: 16, kv_budget_tokens: 4096}}}}
train: {{micro_batch: 8, kl_coef: 0.05}}
cluster: {{dashboard_address: null}}
scheduler: {{mode: shiftable, tick_s: 0.1}}
"""
    )
    return cfg


ITERATIONS_PHASE = "phase: iterations"


def submit(cfg: Path, resume: bool, kill_at: str | None, kill_after_s: float | None,
           workers: int = 1) -> tuple[int, str, str, float]:
    """One `submit` process; killed at a fault point (`kill_at`) or `kill_after_s` after it starts its
    iterations (the "phase: iterations" line: start-up time varies with the machine and the worker count,
    so a kill timed from the process start can land after a short run has already finished). Returns its
    exit status, stdout, stderr and the seconds from that line to the process's end."""
    cmd = [sys.executable, "-m", "pivotrl.cli", "submit", str(cfg), "--workers", str(workers), "--quiet",
           "--no-eval"]
    if resume:
        cmd += ["--resume", "latest"]
    env = {k: v for k, v in os.environ.items() if k != "PIVOTRL_KILL_AT"}
    env["PYTHONUNBUFFERED"] = "1"  # what a killed driver printed is kept
    if kill_at:
        env["PIVOTRL_KILL_AT"] = kill_at
    pipe = subprocess.PIPE
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    out_lines: list[str] = []
    err_lines: list[str] = []
    started = threading.Event()
    t_iter = [math.inf]

    def pump_out() -> None:
        for line in p.stdout:
            out_lines.append(line)
            if line.startswith(ITERATIONS_PHASE) and not started.is_set():
                t_iter[0] = time.monotonic()
                started.set()

    readers = [threading.Thread(target=pump_out, daemon=True),
               threading.Thread(target=lambda: err_lines.extend(p.stderr), daemon=True)]
    for r in readers:
        r.start()
    if kill_after_s is not None:
        while not started.wait(0.05) and p.poll() is None:
            pass
        try:
            p.wait(timeout=kill_after_s)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the driver and its local cluster, as a crash would
    p.wait(timeout=900)
    t_end = time.monotonic()
    for r in readers:
        r.join(timeout=60)
    out, err = "".join(out_lines), "".join(err_lines)
    if p.returncode == -signal.SIGKILL:
        with contextlib.suppress(ProcessLookupError):  # a killed driver's workers may outlive it
            os.killpg(p.pid, signal.SIGKILL)
    return p.returncode, out, err, max(0.0, t_end - t_iter[0]) if t_iter[0] < math.inf else 0.0


def final_run(storage: Path) -> Path:
    runs = sorted((storage / "runs").iterdir())
    if len(runs) != 1:
        raise RuntimeError(f"expected one run under {storage}/runs, found {[r.name for r in runs]}")
    return runs[0]


def policy_tensors(run: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(run / "policy-final" / "model.safetensors")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 iterations, 6 kills")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--storage", type=Path, default=Path("storage/bench/resume"))
    ap.add_argument("--seed", type=int, default=0, help="draws the wall-clock kill moments")
    ap.add_argument("--workers", type=int, default=1, help="device workers of every run (2: the final "
                    "policy is compared within --tolerance, not bit for bit)")
    ap.add_argument("--tolerance", type=float, default=1e-5, help="max |Δ| of any weight, with 2+ workers")
    ap.add_argument("--max-staleness", type=int, default=0, choices=(0, 1, 2),
                    help="run.max_staleness of every run (k >= 1: a kill may find two iterations in flight)")
    args = ap.parse_args(argv)
    iterations, wall_kills = (6, 2) if args.quick else (10, 4)
    rng = random.Random(args.seed)
    root = args.storage.resolve()
    shutil.rmtree(root, ignore_errors=True)
    (root / "models").mkdir(parents=True)
    from pivotrl.engines.checkpoints import create_model

    create_model("debug", root / "models" / "policy", seed=1)
    create_model("debug", root / "models" / "judge", seed=2)
    t0 = time.monotonic()
    ref_cfg = write_config(root, root / "uninterrupted", iterations, args.max_staleness)
    rc, out, err, iterations_s = submit(ref_cfg, resume=False, kill_at=None, kill_after_s=None,
                                        workers=args.workers)
    if rc != 0:
        print(out[-2000:], err[-2000:])
        raise SystemExit(f"the uninterrupted run failed (exit {rc})")
    uninterrupted_s = time.monotonic() - t0

    cfg = write_config(root, root / "interrupted", iterations, args.max_staleness)
    # the wall-clock kills come right after the first (fault-point) kill, at 1.2-1.6 uninterrupted
    # iterations counted from the resumed run's first iteration: each lets about one iteration commit and
    # dies inside the next, so the kills land at different iterations and the later fault points still
    # find iterations left (timed as a fraction of the whole run, with one slow worker two wall kills used
    # up the run and three of the fault-point runs found nothing left to do)
    plan: list[tuple[str | None, float | None]] = [(POINTS[0], None)]
    plan += [(None, rng.uniform(1.2, 1.6) * iterations_s / iterations) for _ in range(wall_kills)]
    plan += [(p, None) for p in POINTS[1:]]
    kills, resumes_ok, overheads, log = 0, True, [], []
    for i, (point, after) in enumerate(plan):
        rc, out, err, _ = submit(cfg, resume=i > 0, kill_at=point, kill_after_s=after, workers=args.workers)
        kills += rc == -signal.SIGKILL
        first = out.splitlines()[0] if out else ""
        if i > 0 and out and not first.startswith("resuming run"):  # (a kill may come before any output)
            resumes_ok = False
        overheads += [float(ln.split()[2].rstrip("s")) for ln in out.splitlines() if ln.startswith(OVERHEAD)]
        log.append({"kill_at": point, "kill_after_s": after, "exit": rc, "first_line": first})
        print(f"run {i + 1}: kill at {point or f'{after:.1f}s'} -> exit {rc}", flush=True)
        if rc not in (0, -signal.SIGKILL):
            print(out[-2000:], err[-2000:])
            resumes_ok = False
            break
    rc, out, err, _ = submit(cfg, resume=True, kill_at=None, kill_after_s=None, workers=args.workers)
    first = out.splitlines()[0] if out else ""
    if rc != 0:
        print(out[-2000:], err[-2000:])
    resumes_ok = resumes_ok and rc == 0 and first.startswith("resuming run")
    for line in out.splitlines():
        if line.startswith(OVERHEAD):
            overheads.append(float(line.split()[2].rstrip("s")))
    print(f"final resume: exit {rc}; {first}", flush=True)

    run = final_run(root / "interrupted")
    rows = json.loads((run / "summary.json").read_text())["iterations"]
    seen = [int(r["iteration"]) for r in rows]
    ref, got = policy_tensors(final_run(root / "uninterrupted")), policy_tensors(run)
    identical = ref.keys() == got.keys() and all(bool((ref[k] == got[k]).all()) for k in ref)
    same_keys = ref.keys() == got.keys()
    max_diff = max(float((ref[k].float() - got[k].float()).abs().max()) for k in ref) if same_keys else None
    out_json = {
        "iterations": iterations,
        "kills": kills,
        "resumed_ok": bool(resumes_ok),
        "iterations_repeated": len(seen) - len(set(seen)),
        "iterations_skipped": len(set(range(iterations)) - set(seen)),
        "final_policy_bit_identical": bool(identical),
        "final_policy_max_abs_diff": max_diff,
        "workers": args.workers,
        "max_staleness": args.max_staleness,
        "final_policy_within_tolerance": max_diff is not None and max_diff <= args.tolerance,
        "tolerance": args.tolerance,
        "resume_overhead_s": statistics.median(overheads) if overheads else None,
        "uninterrupted_wall_s": uninterrupted_s,
        "runs": log,
        "wall_s": time.monotonic() - t0,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out_json, indent=1))
    for k in ("kills", "resumed_ok", "iterations_repeated", "iterations_skipped", "resume_overhead_s"):
        print(f"{k} {out_json[k]}")
    if args.workers > 1:
        print(f"final_policy_max_abs_diff {max_diff} (tolerance {args.tolerance:g})")
        print(f"final_policy_within_tolerance {out_json['final_policy_within_tolerance']}")
    print(f"final_policy_bit_identical {out_json['final_policy_bit_identical']}")
    ok = resumes_ok and out_json["iterations_repeated"] == 0 and out_json["iterations_skipped"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
