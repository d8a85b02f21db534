"""The pipeline API without a cluster: stages stream per sample, per-group stages wait for their group,
user stages slot in, samples with nothing to learn skip training, and every sample is trained once."""

from __future__ import annotations

import types

import pytest

from pivotrl.config import PipelineConfig
from pivotrl.engines.checkpoints import build_tokenizer
from pivotrl.grpo import minibatch_slices
from pivotrl.pipeline import (
    AdvantageStage,
    GenRMRewardStage,
    Pipeline,
    RolloutStage,
    RuleVerifierStage,
    Sample,
    Stage,
    StageContext,
    TrainStage,
)
from pivotrl.runtime.messages import Collected, GradResult, GradStats, ItemResult
from pivotrl.tasks import get_task


class InlineSession:
    """Runs each submitted item at once, the way a device of its role would: rollout answers the sorted
    list for even sample indexes and garbage otherwise; the judge says yes to correct answers."""

    def __init__(self, task, tok, per_collect: int | None = None) -> None:
        self.task, self.tok = task, tok
        self.per_collect = per_collect  # results handed back per collect (None: all), as devices trickle
        self.judged_later: list[int] = []  # per train request: judgments not yet handed back then
        self.results: list[ItemResult] = []
        self.grads: list[GradResult] = []
        self.accumulated: list[str] = []
        self.submitted: list = []
        self.flushes = 0
        self.versions: list[tuple[str, int]] = []

    def submit(self, requests):
        for it in requests:
            self.submitted.append(it)
            p = it.payload
            if it.role == "rollout":
                k = int(it.id.split(":")[-1].split("/")[0])
                words = self.tok.decode(p["prompt_ids"][1:]).split("=")[0].split()
                text = " ".join(sorted(w for w in words if w.isdigit()))
                ids = self.tok.encode(text, add_special_tokens=False) if k % 2 == 0 else []
                self.results.append(ItemResult(it.id, ids, [-0.1] * len(ids), "stop"))
            elif it.role == "reward":
                verdict = self.tok.encode("verdict: yes", add_special_tokens=False)
                self.results.append(ItemResult(it.id, verdict))
            else:
                self.accumulated.append(it.id)
                self.judged_later.append(sum(r.id.endswith("/reward") for r in self.results))

    def flush(self, iteration):
        self.flushes += 1
        if self.accumulated:
            stats = GradStats(tokens=1, samples=len(self.accumulated), version=0)
            self.grads.append(GradResult("grad", self.flushes, list(self.accumulated), stats))
            self.accumulated = []

    def set_version(self, role, version):
        self.versions.append((role, version))

    def collect(self, wait_s=0.0):
        n = len(self.results) if self.per_collect is None else self.per_collect
        out = Collected(self.results[:n], self.grads)
        self.results, self.grads = self.results[n:], []
        return out


class CountLong(Stage):
    name = "count_long"

    def run(self, samples, ctx):
        for s in samples:
            s.data["long"] = len(s.response_ids) > 3


@pytest.fixture
def setup():
    tok = build_tokenizer()
    task = get_task("sort", {"median": 3, "max_size": 6})
    cfg = PipelineConfig.model_validate({"task": {"group_size": 4}})
    return tok, task, cfg


def test_pipeline_streams_stages_and_trains_every_sample_once(setup):
    tok, task, cfg = setup
    ctx = StageContext(tokenizer=tok, task=task, cfg=cfg)
    sess = InlineSession(task, tok)
    applied = []
    stages = [RolloutStage(), GenRMRewardStage(), CountLong(), AdvantageStage(), TrainStage()]
    pipe = Pipeline(stages, ctx, sess, lambda grads, it: applied.append((grads, it)) or 1)
    samples = pipe.make_samples(0, task.sample(3, seed=1), 4, run_seed=0)
    res = pipe.run_iteration(0, samples)
    assert len(samples) == 12 and sess.flushes == 1
    trained = [i for g in res.grads for i in g.items]
    with_response = [s for s in samples if s.response_ids]
    assert sorted(trained) == sorted(f"{s.uid}/train" for s in with_response)  # once each; empty ones skip
    assert all(s.reward == 1.0 for s in samples)  # the GenRM stage parsed the judge's verdict
    assert all("long" in s.data for s in samples)  # the user stage ran on every sample
    assert all(abs(s.advantage) < 1e-6 for s in samples)  # equal rewards in a group: no signal
    roles = [it.role for it in sess.submitted]
    assert roles.count("rollout") == 12 and roles.count("reward") == 12 and roles.count("train") == 6
    assert len({s.seed for s in samples}) == 12  # every sample samples with its own key


def test_rule_verifier_stage_and_group_advantages(setup):
    tok, task, cfg = setup
    ctx = StageContext(tokenizer=tok, task=task, cfg=cfg)
    sess = InlineSession(task, tok)
    stages = [RolloutStage(), RuleVerifierStage(mix=1.0), AdvantageStage(), TrainStage()]
    pipe = Pipeline(stages, ctx, sess, lambda grads, it: 1)
    samples = pipe.make_samples(0, task.sample(2, seed=3), 4, run_seed=0)
    pipe.run_iteration(0, samples)
    for s in samples:  # even samples answered correctly, odd ones said nothing
        assert s.reward == (1.0 if s.index % 2 == 0 else 0.0)
        assert (s.advantage > 0) == (s.index % 2 == 0)


def test_pipeline_rejects_bad_stage_lists(setup):
    tok, task, cfg = setup
    ctx = StageContext(tokenizer=tok, task=task, cfg=cfg)
    with pytest.raises(ValueError, match="last stage"):
        Pipeline([RolloutStage()], ctx, types.SimpleNamespace(), lambda g, i: 0)
    with pytest.raises(ValueError, match="unique"):
        Pipeline([RolloutStage(), RolloutStage(), TrainStage()], ctx, types.SimpleNamespace(), lambda g, i: 0)


def test_overlong_budget_and_truncated_reward_skip_the_judge(setup):
    """The runtime's stages apply the single-process loop's DAPO-style overlong handling."""
    tok, task, cfg = setup
    cfg = PipelineConfig.model_validate(
        {
            "reward": {"budget_per_item": 2, "budget_slack": 2, "truncated_reward": -1.0},
            "rollout": {"sampling": {"max_new_tokens": 24}},
        }
    )
    ctx = StageContext(tokenizer=tok, task=task, cfg=cfg)
    problem = task.make([3, 1, 2], uid="p")
    sample = Sample(uid="s", iteration=0, group="g", problem=problem, prompt_ids=ctx.encode(problem.prompt))
    req = RolloutStage().request(sample, ctx)
    assert req["max_new_tokens"] == 8 and req["payload"]["sampling"]["max_new_tokens"] == 8  # 2 × 3 items + 2
    judge = GenRMRewardStage()
    sample.finish_reason, sample.response_text = "length", "1 2 3 3 3"
    assert judge.request(sample, ctx) is None and sample.reward == -1.0 and ctx.counters["truncated"] == 1
    sample.finish_reason, sample.reward = "stop", None
    assert judge.request(sample, ctx) is not None and sample.reward is None


class _Updater:
    """Records each optimizer step's gradient sums; one version per step."""

    def __init__(self, k: int) -> None:
        self.k, self.steps, self.version, self.last_stats = k, [], 0, {}

    def slices(self, n):
        return minibatch_slices(n, self.k)

    def apply(self, grads, iteration):
        self.steps.append(sorted(i for g in grads for i in g.items))
        self.version += 1
        return self.version


def test_minibatches_step_once_per_slice_and_release_slices_in_order(setup):
    """`train.minibatches`: slice k's train items are submitted only after slice k-1's step, at the new
    version, and each step covers exactly its slice's trainable samples."""
    tok, task, cfg = setup
    ctx = StageContext(tokenizer=tok, task=task, cfg=cfg)
    sess = InlineSession(task, tok)
    upd = _Updater(3)
    pipe = Pipeline([RolloutStage(), GenRMRewardStage(), AdvantageStage(), TrainStage()], ctx, sess, upd)
    samples = pipe.make_samples(0, task.sample(3, seed=1), 4, run_seed=0)
    res = pipe.run_iteration(0, samples)
    assert [len(r) for r in minibatch_slices(12, 3)] == [4, 4, 4]  # whole groups of 4
    want = [sorted(f"{s.uid}/train" for s in samples[4 * k : 4 * k + 4] if s.response_ids) for k in range(3)]
    assert upd.steps == want and res.version == 3 and res.train_stats["steps"] == 3
    train_versions = [it.payload["version"] for it in sess.submitted if it.role == "train"]
    assert train_versions == [0, 0, 1, 1, 2, 2]  # 2 trainable samples per group, each at its slice's version
    assert sess.flushes == 3 and sess.versions == [("train", 1), ("train", 2), ("train", 3)]
    assert minibatch_slices(10, 4) == [range(0, 2), range(2, 5), range(5, 8), range(8, 10)]
    assert minibatch_slices(3, 8) == [range(0, 1), range(1, 2), range(2, 3)] and minibatch_slices(0, 2) == []


def test_with_one_slice_train_streams_while_rollout_and_judging_go_on(setup):
    """One optimizer step per iteration: a finished group's train items go out at once, before the last
    rollout is even judged (the train role overlaps the others, as disaggregated and shiftable need)."""
    tok, task, cfg = setup
    ctx = StageContext(tokenizer=tok, task=task, cfg=cfg)
    sess = InlineSession(task, tok, per_collect=1)
    stages = [RolloutStage(), GenRMRewardStage(), AdvantageStage(), TrainStage()]
    pipe = Pipeline(stages, ctx, sess, _Updater(1))
    samples = pipe.make_samples(0, task.sample(3, seed=1), 4, run_seed=0)
    pipe.run_iteration(0, samples)
    assert len(sess.judged_later) == 6  # trainable samples
    assert sess.judged_later[0] == 8  # the first group went to train with two groups' verdicts to come
    assert sess.flushes == 1


_TOK = build_tokenizer()


@pytest.mark.parametrize("seed", range(3))
def test_the_stage_context_encodes_and_decodes_as_the_builtin_tokenizer(seed):
    """With the built-in tokenizer the driver encodes and decodes by lookup; the ids and text are the
    tokenizer's own, for random text (unknown characters and special-token spellings included) and random
    ids (special tokens and ids past the vocabulary included)."""
    import random

    from pivotrl.pipeline import StageContext

    ctx = StageContext(tokenizer=_TOK, task=None, cfg=None)
    assert ctx.builtin
    rng = random.Random(seed)
    alphabet = "0123456789 sort=abc\n<>/éλ" + "".join(chr(c) for c in range(32, 127))
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        if rng.random() < 0.1:
            text += rng.choice(["<eos>", "<pad>", "<bos>", "<unk>"])
        assert ctx.encode(text) == list(_TOK(text)["input_ids"]), text
        ids = [rng.randrange(0, len(_TOK) + 5) for _ in range(rng.randrange(0, 30))]
        eos = _TOK.eos_token_id
        want = _TOK.decode([i for i in ids if i != eos and i < len(_TOK)], skip_special_tokens=True)
        assert ctx.decode([i for i in ids if i < len(_TOK)]) == want, ids


def test_a_stage_context_with_another_tokenizer_calls_it():
    calls = []

    class Other:
        eos_token_id = 0

        def __call__(self, text):
            calls.append(text)
            return {"input_ids": [1, 2]}

        def decode(self, ids, skip_special_tokens=True):
            calls.append(tuple(ids))
            return "x"

    from pivotrl.pipeline import StageContext

    ctx = StageContext(tokenizer=Other(), task=None, cfg=None)
    assert not ctx.builtin and ctx.encode("ab") == [1, 2] and ctx.decode([0, 5]) == "x"
    assert calls == ["ab", (5,)]
