"""The single-process run: the runtime's pipeline over a `LocalSession`, with real engines, the GenRM as the
only reward, a real parameter store, and `train.minibatches` optimizer steps per iteration."""

from __future__ import annotations

import pytest

from pivotrl import grpo
from pivotrl.engines.checkpoints import build_tokenizer
from pivotrl.gps import ParameterStore
from pivotrl.loop import run_loop
from pivotrl.pipeline import Pipeline, StageContext, default_stages
from pivotrl.tasks import get_task
from tests.tiny import tiny_bootstrap


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_bootstrap(tmp_path_factory.mktemp("loop"), ["task.eval_prompts=16"])


def one_iteration(cfg, boot) -> list:
    seen = []
    run_loop(cfg, boot.policy_dir, boot.judge_dir, iterations=1, on_iteration=lambda it, row: seen.append(it))
    return seen[0].samples


def test_run_loop_logs_every_stage_and_publishes_a_version_per_minibatch(setup, tmp_path):
    cfg, boot = setup
    cfg = cfg.model_copy(deep=True)
    cfg.train.minibatches = 2
    seen = []
    res = run_loop(
        cfg,
        boot.policy_dir,
        boot.judge_dir,
        iterations=2,
        on_iteration=lambda it, row: seen.append((it, row)),
        save_dir=tmp_path / "out",
    )
    assert [h["iteration"] for h in res.history] == [0, 1] and [r for _, r in seen] == res.history
    h = res.history[-1]
    assert h["version"] == 4 and h["heldout_accuracy"] is not None  # 2 steps per iteration
    assert h["tokens_rollout"] > 0 and h["tokens_reward"] > 0 and h["tokens_train"] > 0
    assert h["judge_tokens_mean"] > 0 and h["response_tokens_mean"] > 0
    assert res.curve[0][0] == 0 and res.curve[-1][0] == 2 and 0 <= res.final_accuracy <= 1
    samples = seen[0][0].samples
    assert len(samples) == 16 and all(len(s.logprobs) == len(s.response_ids) for s in samples)
    groups = {}
    for s in samples:
        groups.setdefault(s.group, []).append(tuple(s.response_ids))
    assert len(groups) == 4 and any(len(set(v)) > 1 for v in groups.values())  # own seed per sample
    assert all("judge_text" in s.data for s in samples)  # every (untruncated) rollout was judged
    assert (tmp_path / "out" / "policy" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "loop.json").is_file()


def test_truncated_rollouts_get_the_minimum_without_a_judge_call(setup):
    """One rule everywhere: a rollout cut off at its per-prompt budget gets `truncated_reward` and is never
    sent to the judge."""
    cfg, boot = setup
    cfg = cfg.model_copy(deep=True)
    cfg.reward.budget_per_item, cfg.reward.budget_slack, cfg.reward.truncated_reward = 1, 0, -1.0
    cfg.task.eval_prompts = 0
    samples = one_iteration(cfg, boot)
    for s in samples:
        assert len(s.response_ids) <= grpo.prompt_items(s.problem.prompt)
    cut = [s for s in samples if s.finish_reason == "length"]
    assert cut and all(s.reward == -1.0 and "judge_text" not in s.data for s in cut)
    assert all("judge_text" in s.data for s in samples if s.finish_reason != "length")


def test_run_is_reproducible(setup):
    cfg, boot = setup
    cfg = cfg.model_copy(deep=True)
    cfg.task.eval_prompts = 0
    runs = [[(s.response_ids, s.reward) for s in one_iteration(cfg, boot)] for _ in range(2)]
    assert runs[0] == runs[1]


def test_pipeline_requires_the_updater_for_local_and_runtime_alike(setup, tmp_path):
    """`PolicyUpdater` publishes version 0 and slices by `train.minibatches`; the pipeline asks it."""
    cfg, boot = setup
    cfg = cfg.model_copy(deep=True)
    cfg.train.minibatches = 3
    with ParameterStore(tmp_path / "gps", device_tier_bytes=0) as gps:
        upd = grpo.PolicyUpdater.load(cfg, boot.policy_dir, gps)
        assert upd.publish() == 0 and gps.latest(cfg.models.policy.name) == 0
        assert upd.slices(16) == grpo.minibatch_slices(16, 3) == [range(0, 5), range(5, 11), range(11, 16)]
        assert upd.apply([], 0) == 0 and upd.last_stats == {"skipped": 1.0}
        ctx = StageContext(build_tokenizer(), get_task(cfg.task.name, cfg.task.options), cfg)
        assert Pipeline(default_stages(), ctx, object(), upd).updater is upd


def test_response_budget_is_per_prompt_and_capped():
    task = get_task("sort", {"max_size": 10})
    p = task.make([3, 9, 1, 3], uid="x")
    assert grpo.prompt_items(p.prompt) == 4
    assert grpo.response_budget(p, cap=24) == 24  # off by default: the fixed cap
    assert grpo.response_budget(p, cap=24, per_item=2, slack=2) == 10
    assert grpo.response_budget(p, cap=8, per_item=2, slack=2) == 8
    assert len(p.answer) + 1 <= grpo.response_budget(p, cap=24, per_item=2, slack=2)  # a right answer fits


def test_seeds_and_prompts_are_functions_of_their_keys():
    task = get_task("sort", {"max_size": 4})
    assert grpo.seq_seed("rollout", 0, 1, "p", 2) == grpo.seq_seed("rollout", 0, 1, "p", 2)
    assert grpo.seq_seed("rollout", 0, 1, "p", 2) != grpo.seq_seed("rollout", 0, 1, "p", 3)
    a, b = grpo.train_problems(task, 5, 0, 1), grpo.train_problems(task, 5, 0, 1)
    assert [p.prompt for p in a] == [p.prompt for p in b]
    held = {p.prompt for p in grpo.held_out_problems(task, 5)}
    assert held != {p.prompt for p in grpo.train_problems(task, 5, 0, 0)}


def test_one_stale_iteration_trains_every_sample_once_in_order(setup):
    """`run.max_staleness: 1` on real engines: the next iteration's rollouts run at the version before the
    last step, the staleness recorded per iteration is what the versions say, the curve stays complete."""
    cfg, boot = setup
    cfg = cfg.model_copy(deep=True)
    cfg.run.max_staleness = 1
    res = run_loop(cfg, boot.policy_dir, boot.judge_dir, iterations=3)
    h = res.history
    assert [r["iteration"] for r in h] == [0, 1, 2] and [r["version"] for r in h] == [1, 2, 3]
    assert h[0]["staleness_max"] == 0 and all(r["staleness_max"] == 1 for r in h[1:])
    assert h[-1]["heldout_accuracy"] is not None and res.curve[-1][0] == 3


def test_each_iteration_report_carries_the_held_out_accuracy_measured_after_it(setup, monkeypatch):
    """The scheduler's learning curve (the `/pivotrl` page) is built from these reports: one sent before
    the evaluation would never carry an accuracy."""
    from pivotrl.runtime.local_session import LocalSession

    cfg, boot = setup
    sent = []
    monkeypatch.setattr(LocalSession, "report", lambda self, report: sent.append(report))
    res = run_loop(cfg, boot.policy_dir, boot.judge_dir, iterations=2, eval_every=1)
    assert [r.iteration for r in sent] == [0, 1]
    assert [r.heldout_accuracy for r in sent] == [h["heldout_accuracy"] for h in res.history]
    assert all(r.heldout_accuracy is not None for r in sent)
