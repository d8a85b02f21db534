"""The pipeline API: an RL iteration as explicit stages over samples, run on the Dask runtime.

A *sample* is one response to one prompt (a GRPO group is the G samples of one prompt). Each stage either
runs on devices of a role (`role="rollout" | "reward" | "train" | ...`: the stage turns a sample into a work
item, the runtime schedules it on a device of that role, the stage folds the result back in) or runs in the
driver (`role=None`: cheap per-sample or per-group Python, e.g. a rule-based verifier or advantages).
Stages stream: a sample enters the next stage as soon as it leaves the previous one (a per-group stage
waits for its whole group), so with disaggregated or shiftable deployment reward work overlaps rollout.

The last stage is the train stage: its items become local gradient sums on train replicas; when every
sample of the iteration is in some sum, the driver (the optimizer owner) reduces the sums, steps once and
publishes the next policy version to the Global Parameter Storage, which rollout replicas then load.

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
    """What stages may use: the tokenizer, the task, the config, the current policy version."""

    tokenizer: Any
    task: Any
    cfg: Any
    policy_version: int = 0
    counters: dict[str, float] = field(default_factory=dict)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        eos = self.tokenizer.eos_token_id
        return self.tokenizer.decode([i for i in ids if i != eos], skip_special_tokens=True)


class Stage:
    """A step of the iteration. Device stages implement `request`/`complete`; driver stages `run`."""

    name: str = "stage"
    role: str | None = None
    per_group: bool = False

    def request(self, sample: Sample, ctx: StageContext) -> dict[str, Any]:
        """The work item for the role's devices: {"payload": ..., and cost hints prompt_tokens,
        max_new_tokens, est_tokens} — plain lists and numbers only."""
        raise NotImplementedError

    def complete(self, sample: Sample, result: dict[str, Any], ctx: StageContext) -> None:
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
        from pivotrl.loop import response_budget

        s = ctx.cfg.rollout.sampling
        r = ctx.cfg.reward  # per-prompt budget (DAPO-style overlong handling), as in the single-process loop
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

    def complete(self, sample: Sample, result: dict[str, Any], ctx: StageContext) -> None:
        sample.response_ids = list(result["generated"])
        sample.logprobs = list(result["logprobs"])
        sample.finish_reason = result.get("finish_reason", "")
        sample.response_text = ctx.decode(sample.response_ids)
        sample.data["correct"] = bool(ctx.task.verify(sample.problem, sample.response_text))


class GenRMRewardStage(Stage):
    """The generative judge writes a critique and a verdict (on reward devices); the verdict is parsed from
    its text. Unparseable judgments get `cfg.reward.default_reward` and are counted."""

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
        ids = ctx.encode(self.template.prompt(sample.problem.prompt, sample.response_text))
        s = ctx.cfg.reward.sampling
        return {
            "payload": {
                "prompt_ids": ids,
                "sampling": sampling_payload(s, sample.judge_seed, ctx.tokenizer.eos_token_id),
            },
            "prompt_tokens": len(ids),
            "max_new_tokens": s.max_new_tokens,
            "est_tokens": self.expected_tokens or s.max_new_tokens // 2,
        }

    def complete(self, sample: Sample, result: dict[str, Any], ctx: StageContext) -> None:
        from pivotrl.engines.genrm import parse_verdict

        text = ctx.decode(list(result["generated"]))
        value = parse_verdict(text)
        ctx.counters["judged"] = ctx.counters.get("judged", 0) + 1
        if value is None:
            ctx.counters["unparsed"] = ctx.counters.get("unparsed", 0) + 1
            value = float(ctx.cfg.reward.default_reward)
        sample.reward = float(value)
        sample.data["judge_text"] = text
        sample.data["judge_tokens"] = len(result["generated"])


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
    """Gradients on train replicas (elastic); reduced and applied once per iteration by the driver."""

    name, role = "train", "train"

    def request(self, sample: Sample, ctx: StageContext) -> dict[str, Any] | None:
        if not sample.response_ids:  # nothing to learn from (as in the single-process loop)
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

    def complete(self, sample: Sample, result: dict[str, Any], ctx: StageContext) -> None:
        return None


def default_stages() -> list[Stage]:
    return [RolloutStage(), GenRMRewardStage(), AdvantageStage(), TrainStage()]


@dataclass
class IterationResult:
    iteration: int
    samples: list[Sample]
    grads: list[dict[str, Any]]
    seconds: float
    stage_seconds: dict[str, float]


class Pipeline:
    """Runs iterations of `stages` through a `RuntimeSession`. `apply_grads(grads, iteration) -> version`
    is the optimizer owner's step (reduce, apply, publish); the driver calls it when the iteration's every
    sample is in exactly one flushed gradient sum."""

    def __init__(
        self,
        stages: list[Stage],
        ctx: StageContext,
        session: Any,
        apply_grads: Callable[[list[dict[str, Any]], int], int],
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
        self.apply_grads = apply_grads
        self.poll_s = poll_s

    def make_samples(
        self, iteration: int, problems: list[Problem], group_size: int, run_seed: int
    ) -> list[Sample]:
        """G samples per prompt, seeded exactly as the single-process loop (pivotrl.loop) seeds them, so a
        distributed run samples the same tokens."""
        from pivotrl.loop import seq_seed

        out = []
        seen: dict[str, int] = {}
        for prob in problems:
            ids = self.ctx.encode(prob.prompt)
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
        self, iteration: int, samples: list[Sample], on_poll: Callable[[dict[str, Any]], None] | None = None
    ) -> IterationResult:
        t0 = time.monotonic()
        by_uid = {s.uid: s for s in samples}
        at: dict[str, int] = {}  # sample → index of the stage it is in
        groups: dict[str, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s)
        waiting_group: dict[int, dict[str, set[str]]] = {}
        stage_last: dict[str, float] = {}
        grads: list[dict[str, Any]] = []
        trained: set[str] = set()
        skipped: set[str] = set()  # samples the train stage does not take (e.g. empty responses)
        submit_buf: list[dict[str, Any]] = []
        n_train_submitted = 0
        train_idx = len(self.stages) - 1

        def enter(sample: Sample, idx: int) -> None:
            nonlocal n_train_submitted
            while idx < len(self.stages):
                stage = self.stages[idx]
                at[sample.uid] = idx
                if stage.role is not None:
                    req = stage.request(sample, self.ctx)
                    if req is None:  # this sample skips the stage
                        if idx == train_idx:
                            skipped.add(sample.uid)
                            return
                        idx += 1
                        continue
                    submit_buf.append(
                        {
                            "id": f"{sample.uid}/{stage.name}",
                            "role": stage.role,
                            "iteration": iteration,
                            "group_id": sample.group,
                            **req,
                        }
                    )
                    if idx == train_idx:
                        n_train_submitted += 1
                    return
                if stage.per_group:
                    pending = waiting_group.setdefault(idx, {}).setdefault(sample.group, set())
                    pending.add(sample.uid)
                    members = groups[sample.group]
                    if len(pending) < len(members):
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

        for s in samples:
            enter(s, 0)
        flushed = False
        while len(trained) + len(skipped) < len(samples):
            if submit_buf:
                self.session.submit(submit_buf)
                submit_buf = []
            if n_train_submitted + len(skipped) == len(samples) and not flushed:
                self.session.flush(iteration)
                flushed = True
            out = self.session.collect()
            for res in out["results"]:
                if res.get("kind") == "grad":
                    grads.append(res)
                    uids = [i.rsplit("/", 1)[0] for i in res["items"]]
                    dup = trained.intersection(uids)
                    if dup:
                        raise RuntimeError(f"samples trained twice: {sorted(dup)[:5]}")
                    trained.update(uids)
                    stage_last["train"] = time.monotonic() - t0
                    continue
                uid, _, stage_name = res["id"].rpartition("/")
                sample = by_uid[uid]
                idx = at[uid]
                stage = self.stages[idx]
                if stage.name != stage_name:
                    raise RuntimeError(f"result of stage {stage_name} for {uid}, which is at {stage.name}")
                stage.complete(sample, res, self.ctx)
                stage_last[stage.name] = time.monotonic() - t0
                enter(sample, idx + 1)
            if on_poll is not None:
                on_poll(out)
            if len(trained) + len(skipped) < len(samples) and not out["results"]:
                time.sleep(self.poll_s)
        return IterationResult(iteration, samples, grads, time.monotonic() - t0, stage_last)
