"""One prepared smoke run of the GPU paths: skipped (exit 0) without CUDA, at most ~8 minutes on one GPU.

    python -m benchmarks.gpu_smoke --json OUT.json

Why: no GPU had been lent to this project when it was written, so every CUDA path had only been read and
tested on CPU. This script is what to run the first time a GPU is there, once, in one go. Each part runs
in its own try/except and records its error, so one failure does not lose the others; a part starts only
while the run's time budget still has room for it. Parts, in order of value:

1. ``environment``: versions of torch / CUDA / transformers / distributed / dask_cuda / vllm, the GPU, its
   memory, /dev/shm's size.
2. ``engine``: the torch engine on CUDA — greedy tokens/s against transformers' `generate` on the same GPU,
   same model, dtype and lengths (``engine_ratio_vs_hf_generate``: ours / theirs).
3. ``abort_resume``: sequences far past the engine's initial KV cache (initial_cache_len=16), a *non-tail*
   row aborted after the cache grew, resumed on a second engine: its tokens must equal the uninterrupted
   run's (``abort_resume_identical``).
4. ``gps``: the store's device tier on CUDA — publish, fetch to the GPU (a hit is served from the tier),
   a version larger than the tier is not cached there, and the peak GPU memory of that fetch is one copy.
5. ``train``: one GRPO optimizer step on CUDA (``train_step_ok``: finite loss, the weights changed), and a
   one-rank NCCL all-reduce.
5b. ``train_group``: one step of the sharded train group's own code path (`pivotrl.runtime.train_group`,
   NCCL chosen by the device) with one rank, the version written as shards and read back equal.
6. ``pipeline``: a 3-iteration shiftable pipeline of tiny bootstrapped models on a one-worker cluster — a
   `LocalCUDACluster` when dask_cuda is installed, otherwise a non-daemonic `LocalCluster` reached through
   `--scheduler` (remote mode, which must discover CUDA on its worker) — with role shifts
   (``pipeline_iterations``, ``pipeline_shifts``, ``pipeline_device``).

What it cannot run is listed under ``could_not_run`` (vLLM above all: its wheels are too large to carry to
the lent machine, so the vLLM engine's GPU tests need a box with vLLM installed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gpu_smoke_parts import (
    abort_resume,
    engine_vs_hf,
    gps_device_tier,
    pipeline,
    train_group_step,
    train_step,
)

BUDGET_S = 450.0  # all parts together; the issue allows 8 minutes
VLLM_REASON = "vLLM is not installed (its wheels are too large to carry to the lent machine)"


def _error(exc: BaseException) -> dict[str, Any]:
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": "".join(tb)[-4000:]}


# ---------------------------------------------------------------------------------------------- parts
def environment(device: str) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    out["cuda_runtime"] = torch.version.cuda
    for name in ("transformers", "distributed", "dask_cuda", "vllm"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except Exception as exc:  # ImportError, or a broken install
            out[name] = f"unavailable ({type(exc).__name__})"
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        out.update(gpu=torch.cuda.get_device_name(0), gpu_total_bytes=total, gpu_free_bytes=free)
        out["gpu_capability"] = list(torch.cuda.get_device_capability(0))
    if os.path.isdir("/dev/shm"):
        out["dev_shm_bytes"] = shutil.disk_usage("/dev/shm").total
    out["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    return out


PARTS: list[tuple[str, Callable[..., dict], float]] = [  # name, part, its own time limit (s)
    ("engine", engine_vs_hf, 120.0),
    ("abort_resume", abort_resume, 60.0),
    ("gps", gps_device_tier, 45.0),
    ("train", train_step, 45.0),
    ("train_group", train_group_step, 60.0),
    ("pipeline", pipeline, 240.0),
]


def run(device: str, work: Path, parts: list[str] | None = None) -> dict[str, Any]:
    """Every part once, each isolated (an error is recorded, the rest still run), within `BUDGET_S`."""
    t_start = time.monotonic()
    report: dict[str, Any] = {"skipped": False, "device": device, "parts": {}}
    try:
        report["environment"] = environment(device)
    except Exception as exc:
        report["environment"] = _error(exc)
    could_not: list[str] = []
    if report["environment"].get("vllm", "").startswith("unavailable"):
        could_not.append(f"vllm engine (tests/engines/test_vllm_engine.py -m 'vllm and gpu'): {VLLM_REASON}")
    could_not.append(
        "multi-GPU: NCCL train group, tensor-parallel replicas, >1 LocalCUDACluster worker "
        "(one GPU lent; the runtime has no train process group yet)"
    )
    for name, part, limit in PARTS:
        if parts is not None and name not in parts:
            continue
        left = BUDGET_S - (time.monotonic() - t_start)
        if left < min(limit, 30.0):  # a part needs at least that much
            report["parts"][name] = {"ok": False, "error": f"not started: {left:.0f}s of the budget left"}
            could_not.append(f"{name}: out of time")
            continue
        t0 = time.monotonic()
        try:
            report["parts"][name] = part(device, work)
        except Exception as exc:
            report["parts"][name] = _error(exc)
        report["parts"][name]["seconds"] = time.monotonic() - t0
        with contextlib.suppress(Exception):
            import torch

            if device.startswith("cuda"):
                torch.cuda.empty_cache()
    p = report["parts"]
    report["engine_ratio_vs_hf_generate"] = p.get("engine", {}).get("engine_ratio_vs_hf_generate")
    report["abort_resume_identical"] = p.get("abort_resume", {}).get("abort_resume_identical")
    report["pipeline_iterations"] = p.get("pipeline", {}).get("pipeline_iterations")
    report["train_step_ok"] = p.get("train", {}).get("train_step_ok")
    report["failed_parts"] = [k for k, v in p.items() if not v.get("ok")]
    report["could_not_run"] = could_not
    report["wall_s"] = time.monotonic() - t_start
    return report


def cuda_reason() -> str | None:
    """None when a CUDA device is usable, else why not (the skip's `reason`)."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("--parts", help="comma-separated subset of: " + ",".join(n for n, _, _ in PARTS))
    args = ap.parse_args(argv)
    reason = cuda_reason()
    if reason is not None:
        report: dict[str, Any] = {
            "skipped": True,
            "reason": reason,
            "could_not_run": ["everything: " + reason],
        }
    else:
        with tempfile.TemporaryDirectory(prefix="pivotrl-gpu-smoke-") as tmp:
            report = run("cuda:0", Path(tmp), args.parts.split(",") if args.parts else None)
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text if len(text) < 20000 else text[:20000] + "\n... (truncated; the JSON file has it all)")
    summary = {
        k: report.get(k)
        for k in (
            "skipped",
            "engine_ratio_vs_hf_generate",
            "abort_resume_identical",
            "pipeline_iterations",
            "train_step_ok",
            "failed_parts",
        )
    }
    print("summary:", json.dumps(summary), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
