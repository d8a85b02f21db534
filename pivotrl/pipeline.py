"""The pipeline API: an RL iteration as explicit stages over samples, run on the Dask runtime.

A *sample* is one response to one prompt (a GRPO group is the G samples of one prompt). Each stage either
runs on devices of a role (`role="rollout" | "reward" | "train" | ...`: the stage turns a sample into a work
item, the runtime schedules it on a device of that role, the stage folds the result back in) or runs in the
driver (`role=None`: cheap per-sample or per-group Python, e.g. a rule-based verifier or advantages).
Stages stream: a sample enters the next stage as soon as it leaves the previous one (a per-group stage
waits for its whole group), so with disaggregated or shiftable deployment reward work overlaps rollout.

The last stage is the train stage: its items become local gradient sums on train replicas. The iteration's
samples are cut into `train.minibatches` slices (`pivotrl.grpo.minibatch_slices`); when every sample of a
slice is in some flushed sum, the optimizer owner (`pivotrl.grpo.PolicyUpdater`) reduces the sums, steps
and publishes the next policy version to the Global Parameter Storage. A slice's train items are submitted
as their samples arrive once the slice before it has stepped (so they are computed at the version they are
applied to): with one slice, train streams alongside rollout and judging. Rollout replicas load the
iteration's final version.

A session executes the work: `pivotrl.runtime.session.RuntimeSession` on Dask devices, or
`pivotrl.runtime.local_session.LocalSession` in this process; `run_iterations` is the per-iteration
driver both `run_pipeline` and `run_loop` call, so the two are one recipe.

A user adds a stage by subclassing `Stage` and inserting it in the list, e.g.::

    class LengthPenalty(Stage):
        name = "length_penalty"
        def run(self, samples, ctx):
            for s in samples:
                s.reward -= 0.001 * len(s.response_ids)

    pipeline = Pipeline([RolloutStage(), GenRMRewardStage(), LengthPenalty(), AdvantageStage(), TrainStage()],
                        ...)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pivotrl.grpo import minibatch_slices, response_budget, seq_seed, train_problems
from pivotrl.runtime.messages import Collected, GradResult, ItemResult, WorkRequest
from pivotrl.tasks.base import Problem


@dataclass
class Sample:
    uid: str
    iteration: int
    group: str
    problem: Problem
    prompt_ids: list[int]
    seed: int = 0
    index: int = 0  # position in its group
    judge_seed: int = 0
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""
    response_text: str = ""
    reward: float | None = None
    advantage: float | None = None
    data: dict[str, Any] = field(default_factory=dict)  # what stages add (judge text, verifier result, ...)


@dataclass
class StageContext:
    """What stages may use: the tokenizer, the task, the config, the current policy version, and the
    `pivotrl.tasks.prompts.PromptRenderer` (chat templates, the judge template and verdict parser; None:
    raw prompts and the built-in tagged judge template, as the synthetic tasks use)."""

    tokenizer: Any
    task: Any
    cfg: Any
    policy_version: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    renderer: Any = None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The rollout prompt of `problem` as the policy engine sees it."""
        return self.renderer.rollout_ids(problem) if self.renderer else self.encode(problem.prompt)

    def decode(self, ids: list[int]) -> str:
        eos = self.tokenizer.eos_token_id
        return self.tokenizer.decode([i for i in ids if i != eos], skip_special_tokens=True)


class Stage:
    """A step of the iteration. Device stages implement `request`/`complete`; driver stages `run`."""

    name: str = "stage"
    role: str | None = None
    per_group: bool = False

    def request(self, sample: Sample, ctx: StageContext) -> dict[str, Any] | None:
        """The work for the role's devices, as `WorkRequest` fields: {"payload": ..., and cost hints
        prompt_tokens, max_new_tokens, est_tokens} — plain lists and numbers only (the pipeline adds the
        id, role, iteration and group). None: this sample skips the stage."""
        raise NotImplementedError

    def complete(self, sample: Sample, result: ItemResult, ctx: StageContext) -> None:
        raise NotImplementedError

    def run(self, samples: list[Sample], ctx: StageContext) -> None:
        raise NotImplementedError


def sampling_payload(sampling: Any, seed: int, eos_id: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "max_new_tokens": int(sampling.max_new_tokens),
        "seed": int(seed),
    }
    if eos_id is not None:
        out["stop_ids"] = [int(eos_id)]
    return out


class RolloutStage(Stage):
    """The policy writes a response (on rollout devices, at the iteration's policy version)."""

    name, role = "rollout", "rollout"

    def __init__(self, expected_tokens: int | None = None) -> None:
        self.expected_tokens = expected_tokens

    def request(self, sample: Sample, ctx: StageContext) -> dict[str, Any]:
        s = ctx.cfg.rollout.sampling
        r = ctx.cfg.reward  # per-prompt budget (DAPO-style overlong handling)
        budget = response_budget(sample.problem, s.max_new_tokens, r.budget_per_item, r.budget_slack)
        sampling = sampling_payload(s, sample.seed, ctx.tokenizer.eos_token_id)
        sampling["max_new_tokens"] = budget
        return {
            "payload": {
                "prompt_ids": sample.prompt_ids,
                "sampling": sampling,
                "version": ctx.policy_version,
            },
            "prompt_tokens": len(sample.prompt_ids),
            "max_new_tokens": budget,
            "est_tokens": self.expected_tokens or s.max_new_tokens // 2,
        }

    def complete(self, sample: Sample, result: ItemResult, ctx: StageContext) -> None:
        sample.response_ids = list(result.generated)
        sample.logprobs = list(result.logprobs)
        sample.finish_reason = result.finish_reason
        sample.response_text = ctx.decode(sample.response_ids)
        if getattr(ctx.task, "measurable", True):  # a dataset with verifier none measures nothing
            sample.data["correct"] = bool(ctx.task.verify(sample.problem, sample.response_text))


class GenRMRewardStage(Stage):
    """The generative judge writes a critique and a verdict (on reward devices); the verdict is parsed from
    its text. Unparseable judgments get `cfg.reward.default_reward` and are counted. With
    `cfg.reward.truncated_reward` set, a rollout that ran into its budget (finish reason `length`) gets
    that reward and is never judged (DAPO's overlong filtering: an unfinished answer is never accepted, so
    running long cannot pay, and no judge call is spent on it)."""

    name, role = "reward", "reward"

    def __init__(self, expected_tokens: int | None = None) -> None:
        from pivotrl.engines.genrm import JudgeTemplate

        self.template = JudgeTemplate()
        self.expected_tokens = expected_tokens

    def request(self, sample: Sample, ctx: StageContext) -> dict[str, Any] | None:
        truncated = ctx.cfg.reward.truncated_reward
        if truncated is not None and sample.finish_reason == "length":
            # overran its budget: the minimum reward, without spending a judge call on it
            sample.reward = float(truncated)
            ctx.counters["truncated"] = ctx.counters.get("truncated", 0) + 1
            return None
        if ctx.renderer is not None:
            ids = ctx.renderer.judge_ids(sample.problem, sample.response_text)
            eos = ctx.renderer.judge.tokenizer.eos_token_id
        else:
            ids = ctx.encode(self.template.prompt(sample.problem.prompt, sample.response_text))
            eos = ctx.tokenizer.eos_token_id
        s = ctx.cfg.reward.sampling
        return {
            "payload": {
                "prompt_ids": ids,
                "sampling": sampling_payload(s, sample.judge_seed, eos),
            },
            "prompt_tokens": len(ids),
            "max_new_tokens": s.max_new_tokens,
            "est_tokens": self.expected_tokens or s.max_new_tokens // 2,
        }

    def complete(self, sample: Sample, result: ItemResult, ctx: StageContext) -> None:
        from pivotrl.engines.genrm import parse_verdict

        if ctx.renderer is not None:
            text = ctx.renderer.judge.decode(list(result.generated))
            value = ctx.renderer.read(text)
        else:
            text = ctx.decode(list(result.generated))
            value = parse_verdict(text)
        ctx.counters["judged"] = ctx.counters.get("judged", 0) + 1
        sample.data["judge_parsed"] = value is not None
        if value is None:
            ctx.counters["unparsed"] = ctx.counters.get("unparsed", 0) + 1
            value = float(ctx.cfg.reward.default_reward)
        sample.reward = float(value)
        sample.data["judge_text"] = text
        sample.data["judge_tokens"] = len(result.generated)


class RuleVerifierStage(Stage):
    """A rule-based reward in the driver (the task's verifier) — an example of a user-added stage; use it
    instead of, or after, the GenRM stage (`mix` weights the two)."""

    name = "verifier"

    def __init__(self, mix: float = 1.0) -> None:
        self.mix = mix

    def run(self, samples: list[Sample], ctx: StageContext) -> None:
        for s in samples:
            rule = 1.0 if ctx.task.verify(s.problem, s.response_text) else 0.0
            s.reward = rule if s.reward is None else (1 - self.mix) * s.reward + self.mix * rule


class AdvantageStage(Stage):
    """GRPO's group-normalised advantages, once the whole group has its rewards."""

    name, per_group = "advantage", True

    def run(self, samples: list[Sample], ctx: StageContext) -> None:
        from pivotrl.engines.trainer import compute_advantages

        advs = compute_advantages([float(s.reward or 0.0) for s in samples], [s.group for s in samples])
        for s, a in zip(samples, advs):
            s.advantage = a


class TrainStage(Stage):
    """Gradients on train replicas (elastic); reduced and applied by the optimizer owner once per slice
    of the iteration (`train.minibatches`). Requested once its slice is the one training, so the payload's
    version is the policy the gradient is taken at."""

    name, role = "train", "train"

    def request(self, sample: Sample, ctx: StageContext) -> dict[str, Any] | None:
        if not sample.response_ids:  # nothing to learn from
            return None
        n = len(sample.prompt_ids) + len(sample.response_ids)
        return {
            "payload": {
                "prompt_ids": sample.prompt_ids,
                "response_ids": sample.response_ids,
                "logprobs": sample.logprobs,
                "advantage": float(sample.advantage or 0.0),
                "version": ctx.policy_version,
            },
            "prompt_tokens": 0,
            "max_new_tokens": n,
            "est_tokens": n,
        }

    def complete(self, sample: Sample, result: ItemResult, ctx: StageContext) -> None:
        return None


def default_stages() -> list[Stage]:
    return [RolloutStage(), GenRMRewardStage(), AdvantageStage(), TrainStage()]


@dataclass
class IterationResult:
    iteration: int
    samples: list[Sample]
    grads: list[GradResult]
    seconds: float
    stage_seconds: dict[str, float]
    version: int = 0  # the policy version after the iteration's optimizer steps
    train_stats: dict[str, Any] = field(default_factory=dict)  # the last step's, plus "steps"


class _OneStep:
    """A bare `apply_grads(grads, iteration) -> version` as an updater: one step per iteration."""

    def __init__(self, fn: Callable[[list[GradResult], int], int]) -> None:
        self.fn = fn
        self.last_stats: dict[str, Any] = {}

    def slices(self, n: int) -> list[range]:
        return minibatch_slices(n, 1)

    def apply(self, grads: list[GradResult], iteration: int) -> int:
        return self.fn(grads, iteration)


class Pipeline:
    """Runs iterations of `stages` through a session (`RuntimeSession` or `LocalSession`).

    `updater` is the optimizer owner (`pivotrl.grpo.PolicyUpdater`): `slices(n)` cuts an iteration's
    samples into optimizer steps, `apply(grads, iteration) -> version` takes one step over the flushed
    gradient sums that cover a slice exactly once. A plain `apply_grads` callable is one step per
    iteration."""

    def __init__(
        self,
        stages: list[Stage],
        ctx: StageContext,
        session: Any,
        updater: Any,
        poll_s: float = 0.03,
    ) -> None:
        if not stages or stages[-1].role != "train":
            raise ValueError("the last stage must be the train stage (role 'train')")
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique: {names}")
        self.stages = stages
        self.ctx = ctx
        self.session = session
        self.updater = updater if hasattr(updater, "apply") else _OneStep(updater)
        self.poll_s = poll_s

    def make_samples(
        self, iteration: int, problems: list[Problem], group_size: int, run_seed: int
    ) -> list[Sample]:
        """G samples per prompt, each with its own sampling seed (`seq_seed`): a function of the run seed,
        iteration, prompt and index, so every executor samples the same tokens."""
        out = []
        seen: dict[str, int] = {}
        for prob in problems:
            ids = self.ctx.prompt_ids(prob)
            group = f"{iteration}:{prob.uid}"
            seen[group] = seen.get(group, 0) + 1
            if seen[group] > 1:  # the same problem drawn twice: a group of its own
                group = f"{group}#{seen[group]}"
            for k in range(group_size):
                seed = seq_seed("rollout", run_seed, iteration, prob.uid, k)
                judge_seed = seq_seed("judge", run_seed, group, k)
                out.append(
                    Sample(
                        f"r{group}:{k}",
                        iteration,
                        group,
                        prob,
                        ids,
                        seed=seed,
                        index=k,
                        judge_seed=judge_seed,
                    )
                )
        return out

    def run_iteration(
        self, iteration: int, samples: list[Sample], on_poll: Callable[[Collected], None] | None = None
    ) -> IterationResult:
        t0 = time.monotonic()
        by_uid = {s.uid: s for s in samples}
        at: dict[str, int] = {}  # sample → index of the stage it is in
        groups: dict[str, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s)
        waiting_group: dict[int, dict[str, set[str]]] = {}
        stage_last: dict[str, float] = {}
        grads: list[GradResult] = []
        submit_buf: list[WorkRequest] = []
        train_idx = len(self.stages) - 1
        train_stage = self.stages[train_idx]
        # the optimizer steps of the iteration: slice k's train items go out once slice k-1 is applied
        slices = self.updater.slices(len(samples))
        slice_of = {samples[j].uid: k for k, r in enumerate(slices) for j in r}
        arrived: list[list[Sample]] = [[] for _ in slices]  # samples at the train stage, per slice
        pending: set[str] = set()  # train item ids of the current slice not yet in a flushed sum
        slice_grads: list[GradResult] = []
        trained: set[str] = set()
        current, closed, flush_due = 0, False, False
        steps: list[dict[str, Any]] = []

        def request(sample: Sample, stage: Stage, req: dict[str, Any]) -> None:
            submit_buf.append(
                WorkRequest(
                    id=f"{sample.uid}/{stage.name}",
                    role=str(stage.role),
                    iteration=iteration,
                    group_id=sample.group,
                    **req,
                )
            )

        def enter(sample: Sample, idx: int) -> None:
            while idx < len(self.stages):
                stage = self.stages[idx]
                at[sample.uid] = idx
                if idx == train_idx:
                    k = slice_of[sample.uid]
                    arrived[k].append(sample)
                    if k == current:  # its slice trains at the current version: stream it now
                        release(sample)
                    return
                if stage.role is not None:
                    req = stage.request(sample, self.ctx)
                    if req is None:  # this sample skips the stage
                        idx += 1
                        continue
                    request(sample, stage, req)
                    return
                if stage.per_group:
                    waiting = waiting_group.setdefault(idx, {}).setdefault(sample.group, set())
                    waiting.add(sample.uid)
                    members = groups[sample.group]
                    if len(waiting) < len(members):
                        return
                    stage.run(members, self.ctx)
                    stage_last[stage.name] = time.monotonic() - t0
                    for m in members:
                        if m is not sample:
                            enter(m, idx + 1)
                    idx += 1
                    continue
                stage.run([sample], self.ctx)
                stage_last[stage.name] = time.monotonic() - t0
                idx += 1

        def release(sample: Sample) -> None:
            req = train_stage.request(sample, self.ctx)  # requested now: at the version it trains on
            if req is not None:
                request(sample, train_stage, req)
                pending.add(f"{sample.uid}/{train_stage.name}")

        def advance() -> None:
            """Once every sample of the current slice is at the train stage (each was released as it
            arrived), ask for the sums; once all its train items are in flushed sums, step, and release
            what has arrived of the next slice; repeat (a slice with nothing to learn steps at once)."""
            nonlocal current, closed, flush_due, slice_grads
            while current < len(slices):
                if not closed:
                    if len(arrived[current]) < len(slices[current]):
                        return
                    closed, flush_due = True, bool(pending)
                if pending:
                    return
                version = self.updater.apply(slice_grads, iteration)
                steps.append(dict(getattr(self.updater, "last_stats", {}) or {}))
                stage_last["train"] = time.monotonic() - t0
                if version != self.ctx.policy_version:
                    self.ctx.policy_version = version
                    self.session.set_version("train", version)  # a device taking up train loads it
                current, closed, slice_grads = current + 1, False, []
                if current < len(slices):
                    for sample in arrived[current]:
                        release(sample)

        for s in samples:
            enter(s, 0)
        advance()
        while current < len(slices):
            if submit_buf:
                self.session.submit(submit_buf)
                submit_buf = []
            if flush_due:  # every train item of the current slice is submitted: sums may be handed in
                self.session.flush(iteration)
                flush_due = False
            out = self.session.collect()
            for g in out.grads:
                uids = set(g.items)
                if uids - pending:
                    dup = uids & trained
                    raise RuntimeError(
                        f"gradient sum over items not awaited: {sorted(uids - pending)[:5]}"
                        + (f" (trained twice: {sorted(dup)[:5]})" if dup else "")
                    )
                pending.difference_update(uids)
                trained.update(uids)
                grads.append(g)
                slice_grads.append(g)
            for res in out.results:
                uid, _, stage_name = res.id.rpartition("/")
                sample = by_uid[uid]
                idx = at[uid]
                stage = self.stages[idx]
                if stage.name != stage_name:
                    raise RuntimeError(f"result of stage {stage_name} for {uid}, which is at {stage.name}")
                stage.complete(sample, res, self.ctx)
                stage_last[stage.name] = time.monotonic() - t0
                enter(sample, idx + 1)
            advance()
            if on_poll is not None:
                on_poll(out)
            if current < len(slices) and not (out.results or out.grads or submit_buf):
                time.sleep(self.poll_s)
        train_stats = {**(steps[-1] if steps else {}), "steps": float(len(steps))}
        return IterationResult(
            iteration,
            samples,
            grads,
            time.monotonic() - t0,
            stage_last,
            version=self.ctx.policy_version,
            train_stats=train_stats,
        )


def run_iterations(
    pipeline: Pipeline,
    *,
    iterations: int,
    time_budget_s: float | None = None,
    log: Callable[[str], None] = print,
    progress: bool = False,
    on_iteration: Callable[[IterationResult, dict[str, Any]], None] | None = None,
    evaluate_every: int | None = None,
    evaluate_fn: Callable[[int], float] | None = None,
) -> list[dict[str, Any]]:
    """The per-iteration driver every executor runs: draw the prompts, make the samples, announce the
    iteration's plan, run it (its optimizer steps included), move the rollout role to the new version,
    meter it (a progress bar, or one log line per iteration). Returns the meter's rows.

    `evaluate_fn(iteration)` runs after every `evaluate_every`-th iteration and after the last one (its
    result lands in the row as `heldout_accuracy`); the time budget counts iterations and evaluations."""
    from pivotrl.runtime.metrics import IterationMeter

    cfg, session, ctx = pipeline.ctx.cfg, pipeline.session, pipeline.ctx
    meter = IterationMeter(session, log)
    rows: list[dict[str, Any]] = []
    bar = _progress_bar(iterations) if progress else None
    t_start = time.monotonic()
    for it in range(iterations):
        if time_budget_s is not None and it > 0 and time.monotonic() - t_start >= time_budget_s:
            log(f"run.time_budget_s={time_budget_s:g} reached after {it} iterations; finishing the run")
            break
        problems = train_problems(ctx.task, cfg.task.prompts_per_iteration, cfg.run.seed, it)
        samples = pipeline.make_samples(it, problems, cfg.task.group_size, cfg.run.seed)
        session.begin_iteration(meter.iteration_plan(it, samples, cfg))
        meter.start(it)
        res = pipeline.run_iteration(it, samples, on_poll=meter.poll)
        session.set_version("rollout", res.version)
        row = meter.finish(res, res.train_stats, res.version)
        row["elapsed_s"] = time.monotonic() - t_start
        if hasattr(ctx.task, "epochs"):  # a dataset: epochs of its train split drawn so far
            row["epochs"] = ctx.task.epochs(cfg.task.prompts_per_iteration, it)
        last = it == iterations - 1 or (
            time_budget_s is not None and time.monotonic() - t_start >= time_budget_s
        )
        if evaluate_fn is not None and (last or (evaluate_every and (it + 1) % evaluate_every == 0)):
            row["heldout_accuracy"] = evaluate_fn(it)
        rows.append(row)
        if bar is not None:
            bar.set_postfix_str(meter.postfix(row))
            bar.update(1)
        else:
            log(meter.line(row))
        if on_iteration is not None:
            on_iteration(res, row)
    if bar is not None:
        bar.close()
    return rows


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="iterations", unit="it", dynamic_ncols=True)
