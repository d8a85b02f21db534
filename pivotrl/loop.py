"""The single-process GRPO loop with a generative reward: rollout → GenRM reward → GRPO step → new version.

Why stage functions rather than one loop body: the Dask runtime runs the same stages on different devices
and batches — rollout on the rollout replicas, judging on reward replicas, gradient sums on train replicas —
so each stage is a plain function of (engine or trainer, work items). ``run_loop`` only strings them together
for one process; it is the reference the distributed pipeline must match.

Per iteration it logs mean GenRM reward, held-out verifier accuracy (greedy, on a fixed held-out set; the
verifier only measures, it never rewards), response and critique lengths, KL, and tokens/s per stage.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pivotrl.config import PipelineConfig
from pivotrl.engines.genrm import GenRMJudge, JudgeTemplate, Judgment
from pivotrl.engines.trainer import GRPOTrainer, StepStats, TrainSample, compute_advantages
from pivotrl.tasks import Problem, Task, get_task

HELD_OUT_SEED = 987_654_321  # never used for training prompts


def seq_seed(*parts: Any) -> int:
    """A stable 31-bit seed per sequence (sampling RNG is keyed by it), so resumes and replays agree."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def train_problems(task: Task, n: int, run_seed: int, iteration: int) -> list[Problem]:
    return task.sample(n, seed=seq_seed("train", run_seed, iteration))


def held_out_problems(task: Task, n: int) -> list[Problem]:
    return task.sample(n, seed=HELD_OUT_SEED)


# ----------------------------------------------------------------------------------------------------
# Work items
# ----------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One policy sample of one problem; ``group`` ties the G samples of a prompt together."""

    problem: Problem
    group: str
    sample: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    reward: float | None = None
    judge_text: str = ""
    judge_tokens: int = 0


def _sampling(temperature: float, top_p: float, max_new_tokens: int, eos: int, seed: int):
    from pivotrl.engines.generation import SamplingParams

    return SamplingParams(
        temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, stop_ids=(eos,), seed=seed
    )


def decode_response(tokenizer, ids: Sequence[int]) -> str:
    eos = tokenizer.eos_token_id
    ids = [i for i in ids if i != eos]
    return tokenizer.decode(ids, skip_special_tokens=True)


def prompt_items(prompt: str) -> int:
    """Items of a task prompt (``sort 3 9 1 3=`` → 4): the words between the task word and ``=``."""
    body = prompt.rsplit("=", 1)[0].split(None, 1)
    return len(body[1].split()) if len(body) > 1 else 0


def response_budget(problem: Problem, cap: int, per_item: int = 0, slack: int = 2) -> int:
    """The rollout's token budget for one prompt: ``per_item`` × items + ``slack``, at most ``cap``.

    Why per prompt: an answer to an n-item prompt needs about ``per_item`` × n tokens, so a fixed budget
    sized for the longest prompt lets short prompts ramble — the room a policy uses to exploit a judge
    (observed: responses grew 6.5 → 11.6 tokens as judge/verifier agreement fell). The budget is an
    environment constraint derived from the prompt alone, never from the answer or the verifier.
    """
    if per_item <= 0:
        return cap
    return max(1, min(cap, per_item * prompt_items(problem.prompt) + slack))


def rollout_requests(
    tokenizer,
    problems: Sequence[Problem],
    group_size: int,
    sampling_cfg,
    *,
    run_seed: int,
    iteration: int,
    budget_per_item: int = 0,
    budget_slack: int = 2,
) -> list[tuple[Any, Problem, str, int]]:
    """(GenRequest, problem, group, sample index) for every sample of every prompt of an iteration."""
    from pivotrl.engines.generation import GenRequest

    out = []
    for p in problems:
        ids = tokenizer.encode(p.prompt)
        group = f"{iteration}:{p.uid}"
        budget = response_budget(p, sampling_cfg.max_new_tokens, budget_per_item, budget_slack)
        for k in range(group_size):
            seed = seq_seed("rollout", run_seed, iteration, p.uid, k)
            sp = _sampling(
                sampling_cfg.temperature,
                sampling_cfg.top_p,
                budget,
                tokenizer.eos_token_id,
                seed,
            )
            out.append((GenRequest(seq_id=f"r{group}:{k}", prompt_ids=ids, sampling=sp), p, group, k))
    return out


def rollout_from_result(tokenizer, result, problem: Problem, group: str, sample: int) -> Rollout:
    return Rollout(
        problem=problem,
        group=group,
        sample=sample,
        prompt_ids=list(result.prompt_ids),
        response_ids=list(result.generated_ids),
        logprobs=[float(x) for x in result.logprobs],
        text=decode_response(tokenizer, result.generated_ids),
        finish_reason=result.finish_reason,
    )


def judge_request(tokenizer, template: JudgeTemplate, rollout: Rollout, sampling_cfg, *, run_seed: int):
    """The GenRM's generation request for one finished rollout."""
    from pivotrl.engines.generation import GenRequest

    prompt = template.prompt(rollout.problem.prompt, rollout.text)
    seed = seq_seed("judge", run_seed, rollout.group, rollout.sample)
    sp = _sampling(
        sampling_cfg.temperature,
        sampling_cfg.top_p,
        sampling_cfg.max_new_tokens,
        tokenizer.eos_token_id,
        seed,
    )
    return GenRequest(
        seq_id=f"j{rollout.group}:{rollout.sample}", prompt_ids=tokenizer.encode(prompt), sampling=sp
    )


# ----------------------------------------------------------------------------------------------------
# Stages
# ----------------------------------------------------------------------------------------------------


@dataclass
class StageTiming:
    seconds: float = 0.0
    tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def _run(engine, requests: Sequence[Any]) -> list[Any]:
    """Generate to completion and return results in request order (engines finish out of order)."""
    by_id = {r.seq_id: r for r in engine.generate(list(requests))}
    return [by_id[r.seq_id] for r in requests]


def rollout_stage(
    engine,
    tokenizer,
    problems: Sequence[Problem],
    group_size: int,
    sampling_cfg,
    *,
    run_seed: int,
    iteration: int,
    budget_per_item: int = 0,
    budget_slack: int = 2,
) -> tuple[list[Rollout], StageTiming]:
    items = rollout_requests(
        tokenizer,
        problems,
        group_size,
        sampling_cfg,
        run_seed=run_seed,
        iteration=iteration,
        budget_per_item=budget_per_item,
        budget_slack=budget_slack,
    )
    t0 = time.perf_counter()
    results = _run(engine, [it[0] for it in items])
    timing = StageTiming(time.perf_counter() - t0, sum(len(r.generated_ids) for r in results))
    rollouts = [
        rollout_from_result(tokenizer, res, p, g, k) for res, (_, p, g, k) in zip(results, items, strict=True)
    ]
    return rollouts, timing


def engine_generate_fn(engine, tokenizer, sampling_cfg, *, run_seed: int, tag: str = "judge"):
    """A ``GenRMJudge`` generate function backed by a generation engine."""
    from pivotrl.engines.generation import GenRequest

    counter = {"n": 0}

    def generate(prompts: Sequence[str]) -> list[tuple[str, int, str]]:
        reqs = []
        for text in prompts:
            counter["n"] += 1
            sp = _sampling(
                sampling_cfg.temperature,
                sampling_cfg.top_p,
                sampling_cfg.max_new_tokens,
                tokenizer.eos_token_id,
                seq_seed(tag, run_seed, counter["n"]),
            )
            reqs.append(
                GenRequest(seq_id=f"{tag}{counter['n']}", prompt_ids=tokenizer.encode(text), sampling=sp)
            )
        return [
            (decode_response(tokenizer, r.generated_ids), len(r.generated_ids), r.finish_reason)
            for r in _run(engine, reqs)
        ]

    return generate


def reward_stage(
    judge: GenRMJudge, rollouts: Sequence[Rollout], truncated_reward: float | None = None
) -> tuple[list[Judgment], StageTiming]:
    """Judge every rollout with the GenRM and attach its reward. The verifier is not consulted.

    With ``truncated_reward`` set, a rollout that hit its token budget (finish reason ``length``) gets that
    reward instead of the judge's verdict (DAPO's overlong filtering): an unfinished answer is never
    accepted, so running long cannot pay — whatever the judge would have said.
    """
    t0 = time.perf_counter()
    judgments = judge.judge([r.problem for r in rollouts], [r.text for r in rollouts])
    timing = StageTiming(time.perf_counter() - t0, sum(j.tokens for j in judgments))
    for r, j in zip(rollouts, judgments, strict=True):
        if truncated_reward is not None and r.finish_reason == "length":
            j.reward = truncated_reward
        r.reward, r.judge_text, r.judge_tokens = j.reward, j.text, j.tokens
    return judgments, timing


def train_samples(rollouts: Sequence[Rollout]) -> list[TrainSample]:
    """GRPO samples: advantages normalised within each group of G samples of one prompt."""
    rewards = [float(r.reward if r.reward is not None else 0.0) for r in rollouts]
    adv = compute_advantages(rewards, [r.group for r in rollouts])
    return [
        TrainSample(r.prompt_ids, r.response_ids, a, r.logprobs if r.logprobs else None)
        for r, a in zip(rollouts, adv, strict=True)
        if r.response_ids
    ]


def train_stage(
    trainer: GRPOTrainer, rollouts: Sequence[Rollout], minibatches: int = 1
) -> tuple[StepStats, StageTiming]:
    """One GRPO step on the iteration's samples, or ``minibatches`` steps on disjoint slices of them (PPO's
    mini-batch updates: more optimizer steps per generated sample; the clipped ratio against the rollout
    log-probs keeps the later, slightly off-policy steps safe). Returns the last step's stats."""
    samples = train_samples(rollouts)
    t0 = time.perf_counter()
    k = max(1, min(minibatches, len(samples)))
    bounds = [round(i * len(samples) / k) for i in range(k + 1)]
    tokens = 0
    for a, b in itertools.pairwise(bounds):
        stats = trainer.step(samples[a:b])
        tokens += stats.tokens
    return stats, StageTiming(time.perf_counter() - t0, tokens)


def evaluate(
    engine, tokenizer, task: Task, problems: Sequence[Problem], max_new_tokens: int
) -> dict[str, float]:
    """Greedy held-out accuracy under the ground-truth verifier (measurement only)."""
    from pivotrl.engines.generation import GenRequest

    reqs = [
        GenRequest(
            seq_id=f"eval{i}",
            prompt_ids=tokenizer.encode(p.prompt),
            sampling=_sampling(0.0, 1.0, max_new_tokens, tokenizer.eos_token_id, 0),
        )
        for i, p in enumerate(problems)
    ]
    results = _run(engine, reqs)
    texts = [decode_response(tokenizer, r.generated_ids) for r in results]
    correct = [task.verify(p, t) for p, t in zip(problems, texts, strict=True)]
    return {
        "accuracy": sum(correct) / max(len(correct), 1),
        "mean_length": sum(len(r.generated_ids) for r in results) / max(len(results), 1),
    }


# ----------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------


@dataclass
class IterationLog:
    iteration: int
    version: int
    mean_reward: float
    verifier_reward: float  # fraction of this iteration's samples that are truly correct (measured only)
    judge_agreement: float  # fraction of GenRM verdicts that agree with the verifier on this batch
    heldout_accuracy: float | None
    response_len_mean: float
    response_len_max: int
    critique_len_mean: float
    critique_len_max: int
    kl_ref: float
    kl_old: float
    loss: float
    grad_norm: float
    skipped: bool
    unparsed: int
    rollout_tokens_per_s: float
    reward_tokens_per_s: float
    train_tokens_per_s: float
    rollout_s: float
    reward_s: float
    train_s: float
    elapsed_s: float


@dataclass
class LoopResult:
    initial_accuracy: float
    final_accuracy: float
    history: list[IterationLog] = field(default_factory=list)
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (iteration, elapsed_s, accuracy)

    @property
    def gain_points(self) -> float:
        return 100.0 * (self.final_accuracy - self.initial_accuracy)

    def to_json(self) -> dict[str, Any]:
        return {
            "initial_accuracy": self.initial_accuracy,
            "final_accuracy": self.final_accuracy,
            "accuracy_gain_points": self.gain_points,
            "curve": [{"iteration": i, "elapsed_s": t, "accuracy": a} for i, t, a in self.curve],
            "history": [asdict(h) for h in self.history],
        }


def load_policy(path: str | Path):
    from pivotrl.engines.checkpoints import from_pretrained

    return from_pretrained(path)


def make_engine(model, engine_cfg):
    from pivotrl.engines.generation import GenerationEngine

    return GenerationEngine(
        model, kv_budget_tokens=engine_cfg.kv_budget_tokens, max_batch=engine_cfg.max_batch
    )


def make_trainer(cfg: PipelineConfig, policy, pad_id: int, reference=None) -> GRPOTrainer:
    """The optimizer owner of a run, from ``cfg.train`` (the runtime's train role builds it the same way)."""
    t = cfg.train
    return GRPOTrainer(
        policy,
        pad_id=pad_id,
        lr=t.lr,
        clip_eps=t.clip_eps,
        kl_coef=t.kl_coef,
        micro_batch=t.micro_batch,
        grad_clip=t.grad_clip,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps,
        ref_model=reference,
    )  # temperature 1: the engine reports log-probs of the raw distribution, whatever it sampled with


def run_loop(
    cfg: PipelineConfig,
    policy_dir: str | Path,
    judge_dir: str | Path,
    *,
    iterations: int | None = None,
    time_budget_s: float | None = None,
    eval_every: int = 1,
    on_iteration: Callable[[IterationLog], None] | None = None,
    save_dir: str | Path | None = None,
) -> LoopResult:
    """Run GRPO with the GenRM reward for ``iterations`` (or until ``time_budget_s``), evaluating every
    ``eval_every`` iterations and at the end. The verifier measures only."""
    from pivotrl.engines.checkpoints import build_tokenizer, load_config, save_hf

    torch.manual_seed(cfg.run.seed)
    tokenizer = build_tokenizer()
    task = get_task(cfg.task.name, cfg.task.options)
    held = held_out_problems(task, cfg.task.eval_prompts)
    eval_max = cfg.rollout.sampling.max_new_tokens

    policy = load_policy(policy_dir)
    reference = load_policy(policy_dir) if cfg.train.kl_coef > 0 or cfg.train.log_ref_kl else None
    judge_model = load_policy(judge_dir)
    rollout_engine = make_engine(load_policy(policy_dir), cfg.rollout.engine)
    judge_engine = make_engine(judge_model, cfg.reward.engine)
    template = JudgeTemplate()
    judge = GenRMJudge(
        engine_generate_fn(judge_engine, tokenizer, cfg.reward.sampling, run_seed=cfg.run.seed),
        template,
        default_reward=cfg.reward.default_reward,
    )
    trainer = make_trainer(cfg, policy, tokenizer.pad_token_id, reference)
    total = iterations if iterations is not None else cfg.run.iterations
    t_start = time.perf_counter()
    initial = evaluate(rollout_engine, tokenizer, task, held, eval_max)["accuracy"]
    result = LoopResult(initial_accuracy=initial, final_accuracy=initial, curve=[(0, 0.0, initial)])
    t_start = time.perf_counter()  # the budget counts learning, not the baseline measurement
    for it in range(1, total + 1):
        problems = train_problems(task, cfg.task.prompts_per_iteration, cfg.run.seed, it)
        rollouts, t_roll = rollout_stage(
            rollout_engine,
            tokenizer,
            problems,
            cfg.task.group_size,
            cfg.rollout.sampling,
            run_seed=cfg.run.seed,
            iteration=it,
            budget_per_item=cfg.reward.budget_per_item,
            budget_slack=cfg.reward.budget_slack,
        )
        unparsed_before = judge.counters.unparsed
        judgments, t_rew = reward_stage(judge, rollouts, cfg.reward.truncated_reward)
        stats, t_train = train_stage(trainer, rollouts, cfg.train.minibatches)
        rollout_engine.load_state_dict(policy.state_dict())  # the new version goes to the rollout replica
        elapsed = time.perf_counter() - t_start
        last = it == total or (time_budget_s is not None and elapsed >= time_budget_s)
        acc = None
        if last or it % eval_every == 0:
            acc = evaluate(rollout_engine, tokenizer, task, held, eval_max)["accuracy"]
            result.curve.append((it, time.perf_counter() - t_start, acc))
            result.final_accuracy = acc
        truth = [task.verify(r.problem, r.text) for r in rollouts]
        lens = [len(r.response_ids) for r in rollouts] or [0]
        crit = [j.tokens for j in judgments] or [0]
        entry = IterationLog(
            iteration=it,
            version=trainer.version,
            mean_reward=sum(j.reward for j in judgments) / max(len(judgments), 1),
            verifier_reward=sum(truth) / max(len(truth), 1),
            judge_agreement=sum((j.reward >= 0.5) == t for j, t in zip(judgments, truth, strict=True))
            / max(len(truth), 1),
            heldout_accuracy=acc,
            response_len_mean=sum(lens) / len(lens),
            response_len_max=max(lens),
            critique_len_mean=sum(crit) / len(crit),
            critique_len_max=max(crit),
            kl_ref=stats.kl_ref,
            kl_old=stats.kl_old,
            loss=stats.loss,
            grad_norm=stats.grad_norm,
            skipped=stats.skipped,
            unparsed=judge.counters.unparsed - unparsed_before,
            rollout_tokens_per_s=t_roll.tokens_per_s,
            reward_tokens_per_s=t_rew.tokens_per_s,
            train_tokens_per_s=t_train.tokens_per_s,
            rollout_s=t_roll.seconds,
            reward_s=t_rew.seconds,
            train_s=t_train.seconds,
            elapsed_s=elapsed,
        )
        result.history.append(entry)
        if on_iteration is not None:
            on_iteration(entry)
        if last:
            break
    if save_dir is not None:
        out = Path(save_dir)
        save_hf(policy.state_dict(), load_config(policy_dir), tokenizer, out / "policy")
        (out / "loop.json").write_text(json.dumps(result.to_json(), indent=1))
    return result
