"""The GRPO recipe's shared pieces: seeds, prompts, budgets, the optimizer owner, held-out evaluation.

Why one module: the single-process run (`pivotrl.loop.run_loop` over a `LocalSession`) and the Dask runtime
(`pivotrl.run.run_pipeline`) must be the same recipe on different executors, so everything that
decides *what* is computed — which prompts an iteration draws, each sequence's sampling seed, each prompt's
token budget, how the iteration's samples are cut into optimizer steps, how the step is taken — lives here
once and both import it. Nothing here knows how work is executed; it talks to a session (`submit`,
`collect`) and a parameter store (`fetch`, `publish`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivotrl import faults
from pivotrl.config import PipelineConfig
from pivotrl.tasks import Problem, Task

if TYPE_CHECKING:
    from pivotrl.runtime.messages import Collected

HELD_OUT_SEED = 987_654_321  # never used for training prompts


def seq_seed(*parts: Any) -> int:
    """A stable 31-bit seed per sequence (sampling RNG is keyed by it), so resumes and replays agree."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def train_problems(task: Task, n: int, run_seed: int, iteration: int) -> list[Problem]:
    """The iteration's prompts: a function of (run seed, iteration) only, whatever executes the run. A
    dataset draws without replacement per epoch (`pivotrl.tasks.DatasetTask.draw`)."""
    if hasattr(task, "draw"):
        return task.draw(n, run_seed, iteration)
    return task.sample(n, seed=seq_seed("train", run_seed, iteration))


def held_out_problems(task: Task, n: int) -> list[Problem]:
    """Up to `n` held-out problems: a dataset's held-out split (none when its verifier is `none`: there
    is nothing to measure), or synthetic problems of a seed no training draw uses."""
    if hasattr(task, "held_out_problems"):
        return task.held_out_problems(n) if task.measurable else []
    return task.sample(n, seed=HELD_OUT_SEED)


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


def make_trainer(cfg: PipelineConfig, policy: Any, pad_id: int, reference: Any = None) -> Any:
    """The optimizer of a run, from ``cfg.train``. Log-probs are of the raw distribution (temperature 1):
    the engines report those, whatever temperature they sampled with."""
    from pivotrl.engines.trainer import GRPOTrainer

    return GRPOTrainer.from_train_config(cfg.train, policy, pad_id, ref_model=reference)


def minibatch_slices(n: int, k: int) -> list[range]:
    """``train.minibatches``: the iteration's ``n`` samples (in the order the pipeline makes them, prompt by
    prompt) cut into ``k`` contiguous, near-equal slices, one optimizer step each (PPO's mini-batch updates:
    more steps per generated sample; the clipped ratio against the rollout log-probs keeps the later,
    slightly off-policy steps safe).

    Why by sample position and not by which samples turn out trainable: the rule is then known when the
    iteration starts, so a slice's gradients can be submitted as soon as its own samples have advantages,
    on any executor. With ``k`` dividing the prompt count each slice is whole GRPO groups."""
    if n <= 0:
        return []
    k = max(1, min(int(k), n))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


class PolicyUpdater:
    """The optimizer owner: holds the policy and its one AdamW state; reduces flushed gradient sums
    (fetched from the parameter store), steps, and publishes the new version for every replica to load.

    One step per `minibatch_slices` slice, so ``train.minibatches`` means the same on every executor."""

    def __init__(self, cfg: PipelineConfig, model: Any, gps: Any, pad_id: int) -> None:
        self.cfg, self.model, self.gps = cfg, model, gps
        self.name = cfg.models.policy.name
        self.trainer = make_trainer(cfg, model, pad_id)
        self.last_stats: dict[str, Any] = {}
        self.first_step_at: float | None = None  # monotonic time of the first optimizer step (resume cost)

    @classmethod
    def load(cls, cfg: PipelineConfig, policy_dir: str | Path, gps: Any) -> PolicyUpdater:
        import torch

        from pivotrl.engines.checkpoints import PAD_ID, from_pretrained

        model = from_pretrained(policy_dir, dtype=getattr(torch, cfg.models.policy.dtype))
        return cls(cfg, model, gps, PAD_ID)

    @property
    def version(self) -> int:
        return int(self.trainer.version)

    def slices(self, n: int) -> list[range]:
        return minibatch_slices(n, self.cfg.train.minibatches)

    def publish(self) -> int:
        """Publish the current version, then keep the store bounded: the last `gps.keep_last` versions
        and the pinned ones (version 0, the KL reference) survive. Older versions are never read again:
        every replica moves to the newest one."""
        v = self.version
        self.gps.publish(self.name, v, self.model.state_dict())
        faults.point("publish")
        self.gps.flush()  # replicas may be other processes: the version must be readable from a shared tier
        self.gps.gc(self.name, keep_last=self.cfg.gps.keep_last)
        return v

    def apply(self, grads: Sequence[Any], iteration: int) -> int:
        """One optimizer step over `grads` (`GradResult`s, each a local gradient sum of some replica);
        returns the policy version after it (unchanged when nothing was learnt or the step was skipped)."""
        from pivotrl.engines.grpo_loss import GradSum, reduce

        if self.first_step_at is None:
            self.first_step_at = time.monotonic()
        if not grads:  # no sample of the slice had a response to learn from
            self.last_stats = {"skipped": 1.0}
            return self.version
        t0 = time.perf_counter()
        sums = [GradSum(grads=self.gps.fetch(g.model, int(g.version)), **g.stats.as_kwargs()) for g in grads]
        faults.point("optimizer_step")
        t1 = time.perf_counter()
        stats = self.trainer.apply(reduce(sums))
        t2 = time.perf_counter()
        self.last_stats = stats.as_dict()
        self.last_stats["replica_sums"] = len(sums)
        for model in {g.model for g in grads}:
            with contextlib.suppress(Exception):
                self.gps.gc(model, keep_last=1)
        self.last_stats.update(fetch_s=t1 - t0, step_s=t2 - t1)  # seconds (benchmarks/train_step.py)
        if stats.skipped:
            return self.version
        t3 = time.perf_counter()
        v = self.publish()
        self.last_stats["publish_s"] = time.perf_counter() - t3
        return v


def evaluate(
    session: Any,
    ctx: Any,
    problems: Sequence[Problem],
    version: int,
    tag: str,
    seed: int,
    timeout_s: float = 900.0,
    divert: Callable[[Collected], None] | None = None,
) -> float:
    """Held-out accuracy (percent) of policy `version`: greedy responses from the rollout role of
    `session`, checked by the verifier (the verifier only measures; it never rewards).

    Output the session hands back that is not this evaluation's (iterations still in flight, with bounded
    staleness) goes to `divert`; without one it is an error, never silently dropped."""
    from pivotrl.runtime.messages import Collected, WorkRequest

    s = ctx.cfg.rollout.sampling
    requests = []
    for k, prob in enumerate(problems):
        ids = ctx.prompt_ids(prob)
        requests.append(
            WorkRequest(
                id=f"eval-{tag}-{k}",
                role="rollout",
                iteration=-1,
                payload={
                    "prompt_ids": ids,
                    "version": int(version),
                    "sampling": {
                        "temperature": 0.0,
                        "top_p": 1.0,
                        "max_new_tokens": int(s.max_new_tokens),
                        "seed": int(seed),
                        "stop_ids": [int(ctx.tokenizer.eos_token_id)],
                    },
                },
                prompt_tokens=len(ids),
                max_new_tokens=int(s.max_new_tokens),
                est_tokens=int(s.max_new_tokens) // 2,
            )
        )
    if not requests:
        return float("nan")
    session.submit(requests)
    got: dict[str, bool] = {}
    deadline = time.monotonic() + timeout_s
    mine = {r.id: k for k, r in enumerate(requests)}
    while len(got) < len(requests):
        out = session.collect(wait_s=0.03)
        other = [res for res in out.results if res.id not in mine]
        if other or out.grads:
            if divert is None:
                stray = other[:1] or out.grads[:1]
                raise RuntimeError(f"evaluation {tag} collected output of other work: {stray}")
            divert(Collected(other, list(out.grads)))
        for res in out.results:
            if res.id in mine:
                k = mine[res.id]
                got[res.id] = bool(ctx.task.verify(problems[k], ctx.decode(list(res.generated))))
        if time.monotonic() > deadline:
            raise TimeoutError(f"evaluation of version {version} did not finish in {timeout_s}s")
    return 100.0 * sum(got.values()) / len(got)
