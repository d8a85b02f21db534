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

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pivotrl.errors import UserError
from pivotrl.grpo import minibatch_slices, response_budget, seq_seed, train_problems
from pivotrl.iteration_run import IterationRun, drive
from pivotrl.runtime.messages import Collected, GradResult, ItemResult
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
    rollout_version: int | None = None  # the policy version its rollout was requested at
    train_version: int | None = None  # the version its gradient was taken at
    data: dict[str, Any] = field(default_factory=dict)  # what stages add (judge text, verifier result, ...)


@dataclass
class StageContext:
    """What stages may use: the tokenizer, the task, the config, the current policy version, and the
    `pivotrl.engines.prompts.PromptRenderer` (chat templates, the judge template and verdict parser; None:
    raw prompts and the built-in tagged judge template, as the synthetic tasks use)."""

    tokenizer: Any
    task: Any
    cfg: Any
    policy_version: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    renderer: Any = None

    @functools.cached_property
    def _side(self) -> Any:
        """The tokenizer as a prompt side without a chat template (`prompts.ChatSide`): it encodes and
        decodes by lookup where the tokenizer is the built-in one. Why: the driver decodes every response,
        and the CPU of a tokenizer call per response is taken from the devices on a small machine."""
        from pivotrl.engines.prompts import ChatSide

        return ChatSide(self.tokenizer)

    @property
    def builtin(self) -> bool:
        """The tokenizer is the built-in character tokenizer's (`checkpoints.is_builtin_tokenizer`)."""
        return self._side.builtin

    def encode(self, text: str) -> list[int]:
        return self._side.ids(text)

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The rollout prompt of `problem` as the policy engine sees it."""
        return self.renderer.rollout_ids(problem) if self.renderer else self.encode(problem.prompt)

    def decode(self, ids: list[int]) -> str:
        return self._side.decode(ids)


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


def check_kv_budget(role: str, prompt: int, budget: int, kv_tokens: int, uid: str) -> None:
    """A `UserError` naming `<role>.engine.kv_budget_tokens` when one sequence (its prompt and its whole
    budget of new tokens, what the engine reserves) cannot fit a replica's KV cache: no replica could ever
    run it, and core's admission would otherwise fail the run with a traceback."""
    if prompt + budget > kv_tokens:
        raise UserError(
            f"{role}.engine.kv_budget_tokens: {kv_tokens} tokens cannot hold one sequence of problem {uid}: "
            f"its {prompt}-token prompt and {budget} new tokens ({role}.sampling.max_new_tokens)"
        )


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
        check_kv_budget("rollout", len(sample.prompt_ids), budget, ctx.cfg.rollout.engine.kv_budget_tokens,
                        sample.problem.uid)
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
        check_kv_budget("reward", len(ids), s.max_new_tokens, ctx.cfg.reward.engine.kv_budget_tokens,
                        sample.problem.uid)
        sample.data["judge_prompt_tokens"] = len(ids)
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
        from pivotrl.engines.grpo_loss import compute_advantages

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
    staleness: list[int] = field(default_factory=list)  # per trained sample (see `IterationRun.staleness`)


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
        """Run one iteration to completion (its optimizer steps included): the on-policy driver."""
        run = IterationRun(self, iteration, samples)
        run.start()
        while not run.done:
            drive(self.session, [run], self.poll_s, on_poll)
        return self.result(run)

    @staticmethod
    def result(run: IterationRun) -> IterationResult:
        train_stats = {**(run.steps[-1] if run.steps else {}), "steps": float(len(run.steps)),
                       "apply_s": run.apply_s}
        return IterationResult(
            run.iteration,
            run.samples,
            run.grads,
            run.seconds,
            run.stage_last,
            version=run.ctx.policy_version,
            train_stats=train_stats,
            staleness=run.staleness(),
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
    evaluate_fn: Callable[[int, Callable[[Collected], None]], float] | None = None,
    max_staleness: int = 0,
    first_iteration: int = 0,
    clock: Callable[[], float] = time.monotonic,
) -> list[dict[str, Any]]:
    """The driver every executor runs: draw each iteration's prompts, make its samples, announce its plan,
    run it (its optimizer steps included), meter it (a progress bar, or one log line per iteration).
    Returns the meter's rows.

    With `max_staleness` k > 0 up to k+1 iterations are in flight: core's `StalenessBound` says when the next
    may start (the one before has finished generating, and it would lag on-policy by at most k) and steps
    stay in iteration order. An iteration's row is written when it completes; its `seconds` are the time
    since the previous one completed (the throughput the run sees).

    `evaluate_fn(iteration, divert)` runs after every `evaluate_every`-th iteration and after the last one
    (its result lands in the row as `heldout_accuracy`), before the next iteration may train, so it measures
    that iteration's policy; output of iterations still in flight that it collects goes to `divert`. The time
    budget counts iterations and evaluations. Whether an iteration is the last is decided when it completes:
    with nothing else in flight, the next one starts unless the budget was spent by then (time spent after
    that, in `on_iteration`'s checkpoint, say, cannot leave the run ending unevaluated). A resumed run
    starts at `first_iteration` (the iterations before it have trained; `iterations` is the run's total)."""
    from pivotrl.core.staleness import InFlight, StalenessBound
    from pivotrl.runtime.metrics import IterationMeter
    from pivotrl.stall import StallWatch, session_describer

    cfg, session, ctx = pipeline.ctx.cfg, pipeline.session, pipeline.ctx
    bound = StalenessBound(max_staleness)
    meter = IterationMeter(session, log)
    rows: list[dict[str, Any]] = []
    bar = _progress_bar(iterations, first_iteration) if progress else None
    t_start = clock()
    watch = StallWatch(cfg.run.stall_warn_s, log, session_describer(session), since=t_start)
    runs: list[IterationRun] = []  # in flight, oldest first
    started = trained = first_iteration
    budget_hit = False

    rollout_spec: int | None = None  # the version devices taking up rollout load (the newest rollouts')

    def budget_spent() -> bool:
        return time_budget_s is not None and clock() - t_start >= time_budget_s

    def rollouts_at(version: int) -> None:
        nonlocal rollout_spec
        if version != rollout_spec:
            session.set_version("rollout", version)
            rollout_spec = version

    def divert(out: Collected) -> None:  # output of in-flight iterations that an evaluation collected
        for g in out.grads:
            raise RuntimeError(f"a gradient sum arrived during evaluation: {list(g.items)[:5]}")
        for res in out.results:
            owner = next((run for run in runs if run.owns(res.id)), None)
            if owner is None:
                raise RuntimeError(f"result {res.id} belongs to no iteration in flight")
            owner.on_result(res)

    while True:
        while started < iterations and not budget_hit:
            newest_done = not runs or runs[-1].rollouts_done
            if not bound.may_start(InFlight(started, trained, newest_done)):
                break
            # with nothing in flight the last completion has decided already (budget_hit)
            if runs and budget_spent():
                log(f"run.time_budget_s={time_budget_s:g} reached after {started} iterations; finishing")
                budget_hit = True
                break
            problems = train_problems(ctx.task, cfg.task.prompts_per_iteration, cfg.run.seed, started)
            samples = pipeline.make_samples(started, problems, cfg.task.group_size, cfg.run.seed)
            session.begin_iteration(meter.iteration_plan(started, samples, cfg))
            rollouts_at(ctx.policy_version)
            if not runs:
                meter.start(started)
            run = IterationRun(pipeline, started, samples, may_train=bound.may_train(started, trained))
            run.start()
            runs.append(run)
            started += 1
        if not runs:
            break
        out = drive(session, runs, pipeline.poll_s, meter.poll)
        watch.round(clock(), bool(out.results or out.grads))
        completed = bool(runs and runs[0].done)
        while runs and runs[0].done:
            res = pipeline.result(runs.pop(0))
            trained += 1
            if not runs:  # nothing generating: devices taking up rollout load the new version now
                rollouts_at(res.version)
            row = meter.finish(res, res.train_stats, res.version)
            if res.staleness:
                row["staleness_mean"] = sum(res.staleness) / len(res.staleness)
                row["staleness_max"] = max(res.staleness)
            row["elapsed_s"] = clock() - t_start
            if hasattr(ctx.task, "epochs"):  # a dataset: epochs of its train split drawn so far
                row["epochs"] = ctx.task.epochs(cfg.task.prompts_per_iteration, res.iteration)
            budget_hit = budget_hit or budget_spent()
            last = not runs and (trained == iterations or budget_hit)
            due = evaluate_every and trained % evaluate_every == 0
            if evaluate_fn is not None and (last or due):
                row["heldout_accuracy"] = evaluate_fn(res.iteration, divert)
            if hasattr(session, "report"):  # after the evaluation, so the learning curve has its point
                session.report(_report(res, row, ctx))
            rows.append(row)
            if bar is not None:
                bar.set_postfix_str(meter.postfix(row))
                bar.update(1)
            else:
                log(meter.line(row))
            if on_iteration is not None:
                on_iteration(res, row)
            if runs:
                meter.start(runs[0].iteration)
                runs[0].allow_training()
        if completed:  # evaluations and checkpoints are the driver's own time, not a stall
            watch.restart(clock())
    if bar is not None:
        bar.close()
    return rows


def _report(res: IterationResult, row: dict[str, Any], ctx: StageContext) -> Any:
    from pivotrl.runtime.messages import IterationReport

    return IterationReport(
        iteration=res.iteration,
        seconds=float(row["seconds"]),
        reward_mean=float(row["reward_mean"]),
        policy_version=int(res.version),
        judged=int(ctx.counters.get("judged", 0)),
        unparseable=int(ctx.counters.get("unparsed", 0)),
        heldout_accuracy=None if row.get("heldout_accuracy") is None else float(row["heldout_accuracy"]),
    )


def _progress_bar(total: int, done: int = 0) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc="iterations", unit="it", dynamic_ncols=True)
