"""The parts of `benchmarks.gpu_smoke` (see its docstring), each runnable on CPU too (`device="cpu"`), so
that their logic is tested in CI although their point is the GPU run.

Each part takes `(device, work_dir)` and returns a JSON-able dict with an `ok` flag and its figures.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _model_dir(work: Path, size: str) -> Path:
    from pivotrl.engines.checkpoints import create_model

    path = work / size
    return path if (path / "config.json").is_file() else create_model(size, path, seed=0)


def engine_vs_hf(device: str, work: Path, *, size: str = "small", n: int = 32, new: int = 128) -> dict:
    """Greedy tokens/s of our engine and of transformers' `generate`, same model, dtype, device, lengths."""
    import torch
    from transformers import AutoModelForCausalLM

    from pivotrl.engines.checkpoints import from_pretrained
    from pivotrl.engines.generation import GenerationEngine, GenRequest, SamplingParams

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    path = _model_dir(work, size)
    prompts = [[1, *(5 + (7 * i + j) % 80 for j in range(16))] for i in range(n)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new, stop_ids=())
    ours = GenerationEngine(
        from_pretrained(path, device=device, dtype=dtype),
        kv_budget_tokens=n * (new + 32),
        max_batch=n,
        device=device,
    )
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    gen_kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    def run_ours() -> float:
        _sync(device)
        t0 = time.perf_counter()
        out = ours.generate([GenRequest(f"q{i}", p, greedy) for i, p in enumerate(prompts)])
        _sync(device)
        assert all(len(r.generated_ids) == new for r in out)
        return time.perf_counter() - t0

    def run_hf() -> float:
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw)
        _sync(device)
        assert out.shape[1] == ids.shape[1] + new
        return time.perf_counter() - t0

    run_ours(), run_hf()  # warm-up: kernels, allocator, caches
    ours_s, hf_s = [], []
    for _ in range(3):  # interleaved, so drift hits both alike
        ours_s.append(run_ours())
        hf_s.append(run_hf())
    tokens = n * new
    ours_tps, hf_tps = tokens / sorted(ours_s)[1], tokens / sorted(hf_s)[1]
    return {
        "ok": True,
        "model": size,
        "dtype": str(dtype).removeprefix("torch."),
        "sequences": n,
        "new_tokens": new,
        "ours_tokens_per_s": ours_tps,
        "hf_generate_tokens_per_s": hf_tps,
        "engine_ratio_vs_hf_generate": ours_tps / hf_tps,
    }


def abort_resume(device: str, work: Path, *, new: int = 48, abort_after: int = 24) -> dict:
    """Sequences past the initial cache (16), a non-tail row aborted after growth, resumed elsewhere."""
    import torch

    from pivotrl.engines.checkpoints import from_pretrained
    from pivotrl.engines.generation import GenerationEngine, GenRequest, SamplingParams

    path = _model_dir(work, "debug")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new, stop_ids=(2, 3))  # two stop ids

    def engine() -> GenerationEngine:
        model = from_pretrained(path, device=device, dtype=torch.float32)
        return GenerationEngine(
            model, kv_budget_tokens=4096, max_batch=4, device=device, initial_cache_len=16
        )

    prompts = [[1, 10 + i, 20 + i, 30 + i] for i in range(3)]
    reference = {
        r.seq_id: r.generated_ids
        for r in engine().generate([GenRequest(f"s{i}", p, greedy) for i, p in enumerate(prompts)])
    }
    first = engine()
    for i, p in enumerate(prompts):
        first.add(GenRequest(f"s{i}", p, greedy))
    done: dict[str, list[int]] = {}
    for _ in range(abort_after):
        done.update({r.seq_id: r.generated_ids for r in first.step()})
    partials = first.abort(["s0"])  # row 0: not the tail row, after the cache grew past 16
    while first.has_work():
        done.update({r.seq_id: r.generated_ids for r in first.step()})
    first.offload()
    second = engine()
    for p in partials:
        done.update({r.seq_id: r.generated_ids for r in second.generate([p.as_request(greedy)])})
    lengths = {k: len(v) + len(prompts[int(k[1:])]) for k, v in reference.items()}
    return {
        "ok": True,
        "abort_resume_identical": done == reference,
        "aborted_at_tokens": [len(p.generated_ids) for p in partials],
        "sequence_lengths": lengths,
    }


def gps_device_tier(device: str, work: Path) -> dict:
    """The store's device tier on `device`: hits served from it, an oversized version never cached there."""
    import torch

    from pivotrl.gps import ParameterStore

    g = torch.Generator().manual_seed(0)
    small = {f"w{i}": torch.randn(256, 256, generator=g) for i in range(4)}  # 1 MiB
    big = {f"w{i}": torch.randn(1024, 1024, generator=g) for i in range(8)}  # 32 MiB
    root = work / "gps"
    with ParameterStore(root, device_tier_bytes=0) as w:
        w.publish("small", 0, small)
        w.publish("big", 0, big)
        w.flush()
    cuda = device.startswith("cuda")
    with ParameterStore(root, device_tier_bytes=4 << 20, device=device) as store:
        got = store.fetch("small", 0, device=device, copy=False)
        again = store.fetch("small", 0, device=device, copy=False)
        hit = all(again[n].data_ptr() == got[n].data_ptr() for n in got)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        fetched = store.fetch("big", 0, device=device, copy=False)
        peak = (torch.cuda.max_memory_allocated() - base) if cuda else None
        same = all(torch.equal(fetched[n].cpu(), big[n]) for n in big)
        out = {
            "ok": hit and same,
            "tier_device": str(store.device_tier.device),
            "hit_served_from_tier": hit,
            "values_equal": same,
            "oversized_not_cached": ("big", 0) not in store.device_tier.cached(),
        }
        if peak is not None:
            out["oversized_fetch_peak_over_size"] = peak / (32 << 20)  # 1.0: one copy on the GPU
            out["ok"] = out["ok"] and out["oversized_not_cached"] and peak <= 1.1 * (32 << 20)
    return out


def train_step(device: str, work: Path) -> dict:
    """One GRPO step on `device`: finite loss, weights moved; on CUDA a one-rank NCCL all-reduce too."""
    import torch

    from pivotrl.engines.checkpoints import PAD_ID, from_pretrained
    from pivotrl.engines.grpo_loss import TrainSample
    from pivotrl.engines.trainer import GRPOTrainer

    model = from_pretrained(_model_dir(work, "debug"), device=device, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = GRPOTrainer(model, pad_id=PAD_ID, lr=1e-3, micro_batch=4)
    samples = [
        TrainSample([1, 10 + i, 11], [20 + i, 21, 22, 23], advantage=(1.0 if i % 2 else -1.0))
        for i in range(8)
    ]
    stats = trainer.step(samples)
    moved = any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    loss = float(stats.loss)
    out = {
        "ok": bool(moved and loss == loss and not stats.skipped),
        "loss": loss,
        "weights_changed": moved,
        "skipped": bool(stats.skipped),
    }
    out["train_step_ok"] = out["ok"]
    if device.startswith("cuda"):
        out["nccl_allreduce_ok"] = _nccl_one_rank(work)
    return out


def _nccl_one_rank(work: Path) -> bool | str:
    import torch
    import torch.distributed as dist

    try:
        store = dist.FileStore(str(work / "nccl-store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0"))
        t = torch.ones(4, device="cuda:0")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        return bool(torch.equal(t.cpu(), torch.ones(4)))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:500]
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def train_group_step(device: str, work: Path) -> dict:
    """One step of the sharded train group's code path on `device` with one rank: NCCL on CUDA, gloo on
    CPU (`pivotrl.runtime.train_group.backend_for`), the version written as shards and read back."""
    import torch
    import torch.distributed as dist

    from pivotrl.core.train_group import decide_group
    from pivotrl.engines.checkpoints import PAD_ID, from_pretrained
    from pivotrl.engines.grpo_loss import TrainSample
    from pivotrl.engines.trainer import GRPOTrainer
    from pivotrl.gps import ParameterStore
    from pivotrl.runtime.train_group import TrainRank, backend_for, form_group

    out: dict = {"backend": backend_for(device)}
    try:
        model = from_pretrained(_model_dir(work, "debug"), device=device, dtype=torch.float32)
        trainer = GRPOTrainer(model, pad_id=PAD_ID, lr=1e-3, micro_batch=4)
        samples = [TrainSample([1, 10 + i, 11], [20 + i, 21, 22], advantage=(1.0 if i % 2 else -1.0))
                   for i in range(8)]
        group = form_group(dist.HashStore(), decide_group(None, ["d0"], 0), 0, device=device, timeout_s=60)
        rank = TrainRank(trainer, group)
        t0 = time.perf_counter()
        stats = rank.step(trainer.accumulate(samples))
        with ParameterStore(work / "train-group-gps", device_tier_bytes=0, write_behind=False) as store:
            rank.publish(store, "policy")
            _sync(device)
            got = store.fetch("policy", stats.version)
        same = all(torch.equal(got[n], t.cpu()) for n, t in model.state_dict().items())
        ok = bool(same and not stats.skipped and stats.version == 1)
        out.update(ok=ok, seconds=time.perf_counter() - t0, readback_equal=same)
    except Exception as exc:
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
    return out


PIPELINE_SETS = [  # tiny models bootstrapped in seconds (the same shape as tests/tiny.py)
    "train.sft.steps=40",
    "reward.sft.steps=2",
    "train.sft.examples=400",
    "reward.sft.examples=20",
    "train.sft.batch_size=16",
    "reward.sft.batch_size=2",
    "task.prompts_per_iteration=4",
    "task.group_size=4",
    "task.options={max_size: 4}",
    "rollout.sampling.max_new_tokens=10",
    "reward.sampling.max_new_tokens=12",
    "train.micro_batch=5",
    "scheduler.mode=shiftable",
    "cluster.dashboard_address=null",
    "task.eval_prompts=0",
]
TINY_SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def pipeline(device: str, work: Path, *, iterations: int = 3) -> dict:
    """A shiftable pipeline on a one-worker cluster. On CUDA: `LocalCUDACluster` if dask_cuda is there,
    else remote mode against a non-daemonic `LocalCluster` (whose worker must be discovered as CUDA)."""
    import dask
    from distributed import LocalCluster

    from pivotrl.config import PipelineConfig, load_config
    from pivotrl.run import run_pipeline
    from pivotrl.runtime.cluster import NON_DAEMONIC

    cfg = load_config(
        None,
        PipelineConfig,
        [f"run.storage_root={work / 'pipe'}", f"run.iterations={iterations}", *PIPELINE_SETS],
    )
    cfg.train.sft.shape = dict(TINY_SHAPE)
    cfg.reward.sft.shape = dict(TINY_SHAPE)
    from pivotrl.engines.bootstrap import ensure_bootstrap

    ensure_bootstrap(cfg, parallel=False, log=lambda *_: None)  # cached; no spawned SFT processes
    kw = dict(workers=1, progress=False, evaluate_policy=False, save_final=False, log=lambda *_: None)
    cuda = device.startswith("cuda")
    try:
        import dask_cuda  # noqa: F401

        have_dask_cuda = True
    except ImportError:
        have_dask_cuda = False
    if not cuda or have_dask_cuda:
        how = "LocalCUDACluster" if cuda else "LocalCluster (cpu)"
        result = run_pipeline(cfg, **kw)
    else:
        how = "remote: non-daemonic LocalCluster via --scheduler (dask_cuda not installed)"
        with (
            dask.config.set(NON_DAEMONIC),
            LocalCluster(
                n_workers=1,
                threads_per_worker=1,
                resources={"device": 1},
                memory_limit=0,
                dashboard_address=None,
                host="127.0.0.1",
                silence_logs=40,
            ) as lc,
        ):
            result = run_pipeline(cfg, scheduler=lc.scheduler_address, **kw)
    shifts = [
        {"src": s.get("src"), "role": s.get("role"), "timings": s.get("timings")} for s in result.shifts
    ]
    return {
        "ok": len(result.iterations) == iterations,
        "cluster": how,
        "pipeline_iterations": len(result.iterations),
        "pipeline_shifts": len(shifts),
        "shifts": shifts[:12],
        "wall_s": result.wall_s,
    }
