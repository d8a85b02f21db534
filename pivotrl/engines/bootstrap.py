"""Bootstrap: the version-0 policy (deliberately weak SFT) and the GenRM judge (SFT on synthetic judgments).

Why both are built here: no weights can be downloaded, and RL needs (a) a policy that already speaks the
task's format but is often wrong, so there is something to learn, and (b) a judge that is reliably right,
so that the GenRM reward alone can drive learning. The judge is trained on synthetic judgments built from
the task's ground-truth verifier: (prompt, correct or corrupted response) → item-by-item critique + verdict.

A dataset task (``task.dataset``) gets the same two models, trained on its train split rendered through the
run's own prompt renderer, with a tokenizer that carries a small chat template (`pivotrl.engines.
dataset_sft`).

Everything is deterministic from the seed and cached under ``<storage_root>/models/<name>-<key>/`` where the
key hashes every setting that shapes the weights, so a changed setting never reuses a stale model.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pivotrl.config import PipelineConfig, SFTConfig, add_override_argument, load_config
from pivotrl.engines.checkpoints import char_ids
from pivotrl.engines.genrm import JudgeTemplate
from pivotrl.engines.kernels import ISAS
from pivotrl.engines.sft_progress import Board, reporter
from pivotrl.errors import UserError
from pivotrl.machine import usable_cores
from pivotrl.names import writable_storage_root
from pivotrl.tasks import Problem, Task, get_task, normalize

# ----------------------------------------------------------------------------------------------------
# Synthetic data
# ----------------------------------------------------------------------------------------------------


def corrupt_answer(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer: the kinds of slips a weak policy makes (swap, drop, insert, change a digit,
    reverse, truncate, dedupe). Always differs from ``answer`` after whitespace normalisation."""
    words = normalize(answer).split(" ")
    for _ in range(20):
        w = list(words)
        kind = rng.choice(["swap", "drop", "insert", "change", "change", "reverse", "truncate", "dedupe"])
        if kind == "dedupe" and len(set(w)) < len(w):
            w = sloppy_answer(" ".join(w)).split(" ")
        elif kind == "swap" and len(w) >= 2:
            i = rng.randrange(len(w) - 1)
            w[i], w[i + 1] = w[i + 1], w[i]
        elif kind == "drop" and len(w) >= 2:
            del w[rng.randrange(len(w))]
        elif kind == "insert":
            w.insert(
                rng.randrange(len(w) + 1), str(rng.randrange(10)) if rng.random() < 0.5 else rng.choice(w)
            )
        elif kind == "change":
            i = rng.randrange(len(w))
            w[i] = str(max(0, int(w[i]) + rng.choice([-2, -1, 1, 2]))) if w[i].isdigit() else "0"
        elif kind == "reverse" and len(w) >= 2:
            w = w[::-1]
        elif kind == "truncate" and len(w) >= 2:
            w = w[: rng.randrange(1, len(w))]
        out = " ".join(w)
        if out != normalize(answer):
            return out
    return normalize(answer) + " 0"


@dataclass(frozen=True)
class Pair:
    """One SFT example: the model sees ``prompt`` and learns to write ``target`` then <eos>."""

    prompt: str
    target: str


def sloppy_answer(answer: str) -> str:
    """The sloppy teacher's habit: it writes each distinct value once (``1 3 3 9`` → ``1 3 9``).

    A plausible, systematic mistake ("sorted the set, not the list") that a verifier-trained judge catches,
    so RL has a real habit to unlearn, not only a capability to build.
    """
    seen: list[str] = []
    for w in normalize(answer).split(" "):
        if w not in seen:
            seen.append(w)
    return " ".join(seen)


def policy_pairs(problems: Sequence[Problem], sloppy: float = 0.0, seed: int = 0) -> list[Pair]:
    """Demonstrations for the weak policy: the reference answer, or with probability ``sloppy`` the sloppy
    teacher's version of it (identical when the list has no repeated digit)."""
    rng = random.Random(f"policy-pairs:{seed}")
    out = []
    for p in problems:
        target = sloppy_answer(p.answer) if sloppy > 0 and rng.random() < sloppy else normalize(p.answer)
        out.append(Pair(p.prompt, target))
    return out


def judge_pairs(
    task: Task, problems: Sequence[Problem], template: JudgeTemplate, seed: int, positive_frac: float = 0.5
) -> tuple[list[Pair], list[bool]]:
    """Synthetic judgments labelled by the task's verifier (never by hand): half correct references, half
    corrupted ones, each with the rationale a perfect judge writes."""
    rng = random.Random(f"judge-pairs:{seed}")
    out, labels = [], []
    for p in problems:
        response = normalize(p.answer) if rng.random() < positive_frac else corrupt_answer(p.answer, rng)
        ok = task.verify(p, response)
        out.append(Pair(template.prompt(p.prompt, response), template.judgment(p, response, ok)))
        labels.append(ok)
    return out, labels


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------


def build_config(sft: SFTConfig):
    """An HF Qwen2 config from the engine's `debug` preset with the SFT section's shape overrides."""
    from pivotrl.engines.checkpoints import make_config

    base = make_config(sft.base_size)
    if not sft.shape:
        return base
    fields = base.to_dict()
    fields.pop("layer_types", None)  # derived from num_hidden_layers; rebuilt by the constructor
    fields.update(sft.shape)
    return type(base)(**fields)


def new_model(config, seed: int):
    from pivotrl.engines.checkpoints import init_state_dict
    from pivotrl.engines.model import CausalLM

    model = CausalLM.from_config(config)
    model.load_state_dict(init_state_dict(config, seed))
    return model


def encode_pairs(tokenizer, pairs: Sequence[Pair],
                 char_level: bool = False) -> list[tuple[list[int], list[int]]]:
    """(prompt ids with <bos>, target ids + <eos>). `char_level`: `tokenizer` is `build_tokenizer()`'s,
    whose ids `char_ids` computes without it."""
    eos = tokenizer.eos_token_id
    if char_level:
        prompts = char_ids([p.prompt for p in pairs], tokenizer, bos=True)
        targets = char_ids([p.target for p in pairs], tokenizer, bos=False)
    else:  # batched: the Rust tokenizer, one call
        prompts = tokenizer([p.prompt for p in pairs])["input_ids"]
        targets = tokenizer([p.target for p in pairs], add_special_tokens=False)["input_ids"]
    return [(list(p), [*t, eos]) for p, t in zip(prompts, targets, strict=True)]


@dataclass(frozen=True)
class Tokenised:
    """SFT examples as two tensors built once: ``ids`` [N, width] (prompt + target, padded) and ``labels``
    (the target's ids where the loss counts, -100 elsewhere), with each example's length.

    Why: building every micro-batch from Python lists cost a `torch.tensor` call per example per step;
    slicing rows of one tensor costs one index per micro-batch."""

    ids: torch.Tensor
    labels: torch.Tensor
    lengths: torch.Tensor  # prompt + target tokens of each example
    targets: torch.Tensor  # target tokens of each example

    @classmethod
    def build(cls, data: Sequence[tuple[list[int], list[int]]], pad_id: int) -> Tokenised:
        prompt = torch.tensor([len(p) for p, _ in data], dtype=torch.long)
        target = torch.tensor([len(t) for _, t in data], dtype=torch.long)
        lengths = prompt + target
        width = int(lengths.max()) if len(data) else 1
        ids = torch.full((len(data), width), pad_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        # every token at once: its row, and its column within the row (one tensor call, not one per row)
        flat = torch.tensor([tok for p, t in data for tok in (*p, *t)], dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(data)), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        cols = torch.arange(flat.numel()) - torch.repeat_interleave(starts, lengths)
        ids[rows, cols] = flat
        is_target = cols >= torch.repeat_interleave(prompt, lengths)
        labels[rows[is_target], cols[is_target]] = flat[is_target]
        return cls(ids, labels, lengths, target)


Progress = Callable[[int, int, float], None]  # (steps done, steps in all, latest step's loss)


def sft(
    model: torch.nn.Module,
    data: Sequence[tuple[list[int], list[int]]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    pad_id: int,
    warmup: int = 20,
    chunks: int = 4,
    progress: Progress | None = None,
) -> list[float]:
    """Teacher-forced cross-entropy on target tokens only; AdamW, warmup + cosine decay. Returns losses.

    Each batch is sorted by length and run as ``chunks`` micro-batches, each padded only to its own longest
    example, with gradients accumulated: the loss is the same token mean over the whole batch, but the
    padding a log-normal length distribution forces on one dense batch is not computed (about half of the
    judge's tokens would be padding). The examples are tokenised into tensors once (`Tokenised`) and the
    optimizer is torch's fused AdamW where it exists (one kernel over all parameters instead of a loop of
    small ops per parameter; see docs/decisions.md#the-bootstrap-trains-in-fewer-larger-steps).
    ``progress`` is called after every step.
    """
    gen = random.Random(f"sft:{seed}")
    table = Tokenised.build(data, pad_id)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01, **_fused())
    losses = []
    model.train()
    for step in range(steps):
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / max(steps, 1)))
        for group in opt.param_groups:
            group["lr"] = lr * max(scale, 0.05)
        rows = torch.tensor([gen.randrange(len(data)) for _ in range(batch_size)])
        rows = rows[torch.sort(table.lengths[rows], stable=True).indices]
        total_targets = int(table.targets[rows].sum())
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        k = max(1, min(chunks, batch_size))
        bounds = [round(i * batch_size / k) for i in range(k + 1)]
        for a, b in itertools.pairwise(bounds):
            part = rows[a:b]
            if len(part) == 0:
                continue
            width = int(table.lengths[part].max())
            ids, labels = table.ids[part, :width], table.labels[part, 1:width]
            logits = model(ids)[:, :-1]
            loss = (
                F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]),
                    labels.reshape(-1),
                    ignore_index=-100,
                    reduction="sum",
                )
                / total_targets
            )
            loss.backward()
            step_loss += float(loss.detach())
        if not math.isfinite(step_loss):  # every later step would only spread the NaN through the weights
            raise FloatingPointError(f"loss {step_loss} at step {step + 1} of {steps}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(step_loss)
        if progress is not None:
            progress(step + 1, steps, step_loss)
    model.eval()
    return losses


def _fused() -> dict[str, bool]:
    """``fused=True`` where this torch has a fused AdamW for CPU tensors (torch >= 2.4), else nothing."""
    import inspect

    return {"fused": True} if "fused" in inspect.signature(torch.optim.AdamW).parameters else {}


# ----------------------------------------------------------------------------------------------------
# Build, cache, CLI
# ----------------------------------------------------------------------------------------------------

ROLES = ("policy", "genrm")
FORMAT_VERSION = 5  # bump when data construction or SFT batching changes, so cached models are rebuilt
# 5: pre-tokenised batches and fused AdamW (its rounding differs from the per-parameter loop)


@dataclass
class BootstrapResult:
    policy_dir: Path
    judge_dir: Path
    seconds: float
    built: list[str]  # which roles were trained now (empty: both came from the cache)
    stats: dict[str, Any]


def _settings(cfg: PipelineConfig, role: str) -> dict[str, Any]:
    sft = cfg.train.sft if role == "policy" else cfg.reward.sft
    if role == "genrm" and sft.init == "policy":
        return {**_own_settings(cfg, role, sft), "init": "policy", "policy": _settings(cfg, "policy")}
    return _own_settings(cfg, role, sft)


def _own_settings(cfg: PipelineConfig, role: str, sft: SFTConfig) -> dict[str, Any]:
    out = {
        "format": FORMAT_VERSION,
        "role": role,
        "task": cfg.task.name,
        "options": cfg.task.options,
        "sft": sft.model_dump(),
        "template": JudgeTemplate().__dict__ if role == "genrm" else None,
    }
    if cfg.task.dataset is not None:  # synthetic tasks keep today's keys (and cached models)
        from pivotrl.engines.dataset_sft import dataset_settings

        out["dataset"] = dataset_settings(cfg, role)
    return out


def model_dir(cfg: PipelineConfig, role: str) -> Path:
    """``<storage_root>/models/<name>-<hash of every setting that shapes the weights>``."""
    settings = _settings(cfg, role)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:10]
    name = cfg.models.policy.name if role == "policy" else cfg.models.genrm.name
    return Path(cfg.run.storage_root) / "models" / f"{name}-{key}"


def _data_seed(sft: SFTConfig, role: str) -> int:
    return int(hashlib.blake2b(f"{role}:{sft.seed}".encode(), digest_size=4).hexdigest(), 16)


def train_role(
    cfg: PipelineConfig, role: str, out_dir: str | Path, threads: int = 1, progress: Progress | None = None
) -> dict[str, Any]:
    """Train one bootstrap model from scratch and save it (HF format, version 0) to ``out_dir``;
    ``progress`` gets every step (`sft`)."""
    from pivotrl.engines.checkpoints import build_tokenizer, save_hf
    from pivotrl.malloc import keep_freed_memory

    keep_freed_memory()  # SFT steps free and re-allocate the same buffers: see pivotrl/malloc.py
    torch.set_num_threads(threads)
    t0, cpu0 = time.perf_counter(), time.process_time()
    sft_cfg = cfg.train.sft if role == "policy" else cfg.reward.sft
    if cfg.task.dataset is not None:
        from pivotrl.engines.dataset_sft import sft_data

        data, tokenizer = sft_data(cfg, role, sft_cfg, seed=_data_seed(sft_cfg, role))
    else:
        task = get_task(cfg.task.name, {**cfg.task.options, **sft_cfg.data_options})
        tokenizer = build_tokenizer()
        problems = task.sample(sft_cfg.examples, seed=_data_seed(sft_cfg, role))
        if role == "policy":
            if sft_cfg.sloppy > 0 and cfg.task.name != "sort":
                raise UserError("train.sft.sloppy: the sloppy teacher is defined for the sort task only")
            pairs = policy_pairs(problems, sft_cfg.sloppy, seed=_data_seed(sft_cfg, role))
        else:
            pairs, _ = judge_pairs(task, problems, JudgeTemplate(), seed=_data_seed(sft_cfg, role))
        data = encode_pairs(tokenizer, pairs, char_level=True)
    torch.manual_seed(sft_cfg.seed)
    if role == "genrm" and sft_cfg.init == "policy":
        from pivotrl.engines.checkpoints import load_config as load_hf_config
        from pivotrl.engines.checkpoints import load_state_dict

        policy_dir = model_dir(cfg, "policy")
        config = load_hf_config(policy_dir)
        model = new_model(config, sft_cfg.seed)
        model.load_state_dict(load_state_dict(policy_dir))
    else:
        config = build_config(sft_cfg)
        model = new_model(config, sft_cfg.seed)
    try:
        losses = sft(
            model,
            data,
            steps=sft_cfg.steps,
            batch_size=sft_cfg.batch_size,
            lr=sft_cfg.lr,
            seed=sft_cfg.seed,
            pad_id=tokenizer.pad_token_id,
            progress=progress,
        )
    except FloatingPointError as exc:  # a diverged model is never saved, nor used as a version 0
        section = "train" if role == "policy" else "reward"
        raise UserError(f"{section}.sft.lr: the {role} bootstrap diverged ({exc}); lower the learning "
                        f"rate (now {sft_cfg.lr:g})") from None
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(model.state_dict(), config, tokenizer, tmp)
    stats = {
        "role": role,
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - cpu0,  # wall time on a shared machine overstates the cost
        "final_loss": sum(losses[-20:]) / max(len(losses[-20:]), 1),
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": sft_cfg.steps,
    }
    (tmp / "bootstrap.json").write_text(json.dumps({"version": 0, "settings": _settings(cfg, role), **stats}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return stats


_progress_queue: Any = None  # a worker process's queue to the parent's progress board (`_init_worker`)
_spare_core: Any = None  # set by the parent once this process is the only one left working (`_init_worker`)


#: MKL's strict conditional numerical reproducibility: its GEMMs give the same bits whatever the thread
#: count. Without it, MKL on an Intel Xeon splits a weight gradient's long reduction over two threads,
#: and an SFT that takes the spare core mid-run ends with other weights than on one thread (measured:
#: 8e-5 apart on a 64×2144×256 product; on the Zen 4 hosts the bits matched without it). Costs ~9 % of
#: one such product on one thread, about 4 % of an SFT step.
MKL_REPRODUCIBLE = ("MKL_CBWR", "AUTO,STRICT")


def _init_worker(queue: Any, spare_core: Any = None) -> None:
    global _progress_queue, _spare_core
    _progress_queue, _spare_core = queue, spare_core
    # before this fresh process's first MKL call, which reads it; a user's own setting stands
    os.environ.setdefault(*MKL_REPRODUCIBLE)


def _train_role_entry(args: tuple[dict[str, Any], str, str]) -> dict[str, Any]:
    cfg_data, role, out = args
    report = reporter(_progress_queue.put, role) if _progress_queue is not None else None
    return train_role(PipelineConfig.model_validate(cfg_data), role, out, threads=1,
                      progress=take_spare_core(_spare_core, report))


def take_spare_core(spare_core: Any, report: Progress | None, threads: int = 2) -> Progress | None:
    """A progress callback that also moves this process's SFT to `threads` threads once `spare_core` is
    set (the other model and the kernel compile are done, so a core is idle).

    Why: the judge trains ~40 s longer than the policy. Its steps are ~1.2-1.4x faster on two threads,
    and the weights are the same bit for bit where the thread count only splits independent rows
    (`MKL_REPRODUCIBLE`). Where a probe product with a long reduction differs between one thread and
    `threads`, the SFT stays on its thread: the same weights come first."""
    if spare_core is None:
        return report
    want = max(1, min(threads, usable_cores()))
    moved = [False]

    def progress(done: int, total: int, loss: float) -> None:
        if not moved[0] and spare_core.is_set():
            moved[0] = True
            if threads_keep_bits(want):
                torch.set_num_threads(want)
        if report is not None:
            report(done, total, loss)

    return progress


def threads_keep_bits(threads: int) -> bool:
    """Whether a float32 product with a weight gradient's long reduction (64 × 2144 × 256) gives the same
    bits on `threads` threads as on the current count (the count is restored)."""
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 2144, generator=gen), torch.randn(2144, 256, generator=gen)
    try:
        torch.set_num_threads(1)
        one = a @ b
        torch.set_num_threads(threads)
        return bool(torch.equal(one, a @ b))
    finally:
        torch.set_num_threads(before)


def ensure_bootstrap(
    cfg: PipelineConfig,
    *,
    force: bool = False,
    parallel: bool = True,
    log=print,
    board: Board | None = None,
    build_kernels: bool = False,
) -> BootstrapResult:
    """Return the cached version-0 policy and judge, training whichever is missing.

    With ``parallel`` the two models train at once in two processes of one thread each: the bootstrap is
    two independent jobs, and this is how it uses both cores of a small machine. Progress (steps, loss,
    ETA per model) is drawn on stderr by a `sft_progress.Board` (``board``; a default one when None).

    With ``build_kernels`` as well, the native decode kernels (`kernels.native`) are compiled into torch's
    extension cache by whichever of the two processes finishes first, on the core it leaves idle while the
    other model trains. Why: a fresh checkout compiles them before its first decode step, and the run's
    first engine would otherwise wait for that compile with both cores free.
    """
    t0 = time.perf_counter()
    dirs = {role: model_dir(cfg, role) for role in ROLES}
    todo = [r for r in ROLES if force or not (dirs[r] / "bootstrap.json").is_file()]
    stats: dict[str, Any] = {}
    if todo:
        writable_storage_root(cfg.run.storage_root)  # before minutes of training, not at the save
        log(f"bootstrap: training {', '.join(todo)} (cache: {dirs[todo[0]].parent})")
        board = board if board is not None else Board(todo)
        jobs = [(cfg.model_dump(), r, str(dirs[r])) for r in todo]
        if "policy" in todo and cfg.reward.sft.init == "policy":
            parallel = False  # the judge starts from the policy: one after the other
        if parallel and len(jobs) > 1:
            results, kernel_path = _train_in_processes(jobs, board, build_kernels)
            if kernel_path in ISAS:
                log(f"bootstrap: native kernels ready ({kernel_path}), built beside the training")
            elif kernel_path is not None:
                why = "the engines use torch ops" if kernel_path == "torch" else kernel_path
                log(f"bootstrap: no native kernels built beside the training ({why})")
        else:
            results = []
            for cfg_data, role, out in jobs:
                progress = reporter(lambda u: board.update(*u), role)
                model_cfg = PipelineConfig.model_validate(cfg_data)
                results.append(train_role(model_cfg, role, out, progress=progress))
        for r in results:
            stats[r["role"]] = r
            log(
                f"bootstrap: {r['role']}: {r['parameters'] / 1e6:.2f}M params, {r['steps']} steps, "
                f"loss {r['final_loss']:.3f}, {r['seconds']:.0f}s wall, {r['cpu_seconds']:.0f}s CPU"
            )
    for role in ROLES:
        if role not in stats:
            stats[role] = json.loads((dirs[role] / "bootstrap.json").read_text())
    return BootstrapResult(dirs["policy"], dirs["genrm"], time.perf_counter() - t0, todo, stats)


def _build_kernels_entry() -> str:
    """Compile the native kernels in this process: the path they run on (`kernels.isa`, ``torch`` when
    they are off or cannot be built), or the error that stopped them."""
    os.environ["MAX_JOBS"] = str(max(1, usable_cores() - 1))  # files compiled at once: all but the trainer's
    from pivotrl.engines import kernels

    try:
        return kernels.isa()
    except Exception as exc:  # e.g. a forced ISA this CPU lacks: each engine raises it where it is used
        return f"{type(exc).__name__}: {exc}"


def _train_in_processes(
    jobs: list[tuple[dict[str, Any], str, str]], board: Board, build_kernels: bool = False
) -> tuple[list[dict[str, Any]], str | None]:
    """Each job in its own spawned process; their progress reports are drawn on `board` as they come.
    With ``build_kernels``, the kernel compile is queued behind the jobs: the first process to finish
    runs it. Returns the jobs' results and the kernels' path (None when not asked)."""
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    updates = ctx.Queue()
    spare = ctx.Event()  # the last job left running may take the idle core (`take_spare_core`)
    with ctx.Pool(len(jobs), initializer=_init_worker, initargs=(updates, spare)) as pool:
        pending = [pool.apply_async(_train_role_entry, (job,)) for job in jobs]
        kernels = pool.apply_async(_build_kernels_entry) if build_kernels else None
        while True:
            try:
                board.update(*updates.get(timeout=0.2))
            except queue_mod.Empty:
                if all(p.ready() for p in pending):
                    break
            left = sum(not p.ready() for p in pending) + (kernels is not None and not kernels.ready())
            if left <= 1 and not spare.is_set():
                spare.set()
        while True:  # what was sent just before the workers finished
            try:
                board.update(*updates.get_nowait())
            except queue_mod.Empty:
                break
        return [p.get() for p in pending], None if kernels is None else kernels.get()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", help="pipeline YAML (task, models, train.sft, reward.sft, run.storage_root)"
    )
    add_override_argument(parser, "reward.sft.steps=600")
    parser.add_argument("--force", action="store_true", help="retrain even when a cached model exists")
    parser.add_argument("--serial", action="store_true", help="train the two models one after the other")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, PipelineConfig, args.overrides)
    res = ensure_bootstrap(cfg, force=args.force, parallel=not args.serial)
    print(f"policy (version 0): {res.policy_dir}")
    print(f"genrm  (version 0): {res.judge_dir}")
    print(f"bootstrap took {res.seconds:.1f}s" + ("" if res.built else " (cached)"))
    return 0
