"""The single-process loop: stages wired with the real generation engine, rewards from the GenRM only."""

from __future__ import annotations

import pytest

from pivotrl import loop as L
from pivotrl.config import PipelineConfig, load_config
from pivotrl.engines.bootstrap import ensure_bootstrap
from pivotrl.engines.checkpoints import build_tokenizer
from pivotrl.engines.genrm import GenRMJudge
from pivotrl.engines.trainer import GRPOTrainer
from pivotrl.tasks import get_task

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("loop")
    sets = [
        f"run.storage_root={root}",
        "train.sft.steps=40",
        "reward.sft.steps=2",
        "train.sft.examples=400",
        "reward.sft.examples=20",
        "train.sft.batch_size=16",
        "reward.sft.batch_size=2",
        "task.prompts_per_iteration=4",
        "task.group_size=4",
        "task.eval_prompts=16",
        "task.options={max_size: 4}",
        "rollout.sampling.max_new_tokens=10",
        "reward.sampling.max_new_tokens=12",
        "train.micro_batch=5",
        "train.lr=0.01",
    ]
    cfg = load_config(None, PipelineConfig, sets)
    cfg.train.sft.shape = dict(TINY)
    cfg.reward.sft.shape = dict(TINY)
    boot = ensure_bootstrap(cfg, parallel=False, log=lambda *_: None)
    return cfg, boot


def test_stages_group_samples_and_differ_within_a_group(setup):
    cfg, boot = setup
    tok = build_tokenizer()
    task = get_task(cfg.task.name, cfg.task.options)
    engine = L.make_engine(L.load_policy(boot.policy_dir), cfg.rollout.engine)
    problems = L.train_problems(task, 3, run_seed=0, iteration=1)
    rollouts, timing = L.rollout_stage(
        engine, tok, problems, 4, cfg.rollout.sampling, run_seed=0, iteration=1
    )
    assert len(rollouts) == 12 and timing.tokens == sum(len(r.response_ids) for r in rollouts)
    assert all(len(r.logprobs) == len(r.response_ids) for r in rollouts)
    groups = {}
    for r in rollouts:
        groups.setdefault(r.group, []).append(tuple(r.response_ids))
    assert len(groups) == 3
    assert any(len(set(v)) > 1 for v in groups.values())  # each sample has its own sampling seed
    again, _ = L.rollout_stage(engine, tok, problems, 4, cfg.rollout.sampling, run_seed=0, iteration=1)
    assert [r.response_ids for r in again] == [r.response_ids for r in rollouts]  # reproducible


def test_reward_comes_from_the_judge_text_only(setup):
    """A judge that always says yes gives reward 1 to wrong answers: the verifier is never consulted."""
    cfg, boot = setup
    tok = build_tokenizer()
    task = get_task(cfg.task.name, cfg.task.options)
    engine = L.make_engine(L.load_policy(boot.policy_dir), cfg.rollout.engine)
    rollouts, _ = L.rollout_stage(
        engine, tok, L.train_problems(task, 2, 0, 1), 3, cfg.rollout.sampling, run_seed=0, iteration=1
    )
    for r in rollouts:
        r.text = "certainly wrong"
    yes = GenRMJudge(lambda prompts: [("ref x. verdict: yes", 5, "stop")] * len(prompts))
    judgments, timing = L.reward_stage(yes, rollouts)
    assert all(j.parsed for j in judgments)
    assert [r.reward for r in rollouts] == [1.0] * 6 and timing.tokens == 30
    junk = GenRMJudge(lambda prompts: [("@@@", 3, "length")] * len(prompts), default_reward=-0.5)
    L.reward_stage(junk, rollouts)
    assert [r.reward for r in rollouts] == [-0.5] * 6 and junk.counters.unparsed == 6


def test_train_stage_uses_group_advantages(setup):
    cfg, boot = setup
    tok = build_tokenizer()
    task = get_task(cfg.task.name, cfg.task.options)
    policy = L.load_policy(boot.policy_dir)
    engine = L.make_engine(L.load_policy(boot.policy_dir), cfg.rollout.engine)
    rollouts, _ = L.rollout_stage(
        engine, tok, L.train_problems(task, 2, 0, 1), 4, cfg.rollout.sampling, run_seed=0, iteration=1
    )
    for i, r in enumerate(rollouts):
        r.reward = float(i % 2)
    samples = L.train_samples(rollouts)
    assert sum(s.advantage for s in samples) == pytest.approx(0.0, abs=1e-6)
    trainer = GRPOTrainer(policy, pad_id=tok.pad_token_id, lr=1e-2, micro_batch=3)
    stats, timing = L.train_stage(trainer, rollouts)
    assert not stats.skipped and stats.version == 1 and timing.tokens == stats.tokens > 0
    # on-policy: the engine's log-probs match the trainer's forward, so the first step's KL is ~0
    assert stats.kl_old < 1e-4


def test_run_loop_logs_every_stage_and_publishes_versions(setup, tmp_path):
    cfg, boot = setup
    seen = []
    res = L.run_loop(
        cfg,
        boot.policy_dir,
        boot.judge_dir,
        iterations=2,
        on_iteration=seen.append,
        save_dir=tmp_path / "out",
    )
    assert [h.iteration for h in res.history] == [1, 2] and seen == res.history
    h = res.history[-1]
    assert h.version == 2 and h.heldout_accuracy is not None
    assert h.rollout_tokens_per_s > 0 and h.reward_tokens_per_s > 0 and h.train_tokens_per_s > 0
    assert h.critique_len_max > 0 and h.response_len_max > 0
    assert res.curve[0][0] == 0 and res.curve[-1][0] == 2
    assert (tmp_path / "out" / "policy" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "loop.json").is_file()
    assert L.load_policy(tmp_path / "out" / "policy").config.hidden_size == TINY["hidden_size"]
    assert 0 <= h.unparsed <= cfg.task.prompts_per_iteration * cfg.task.group_size


def test_response_budget_is_per_prompt_and_capped():
    task = get_task("sort", {"max_size": 10})
    p = task.make([3, 9, 1, 3], uid="x")
    assert L.prompt_items(p.prompt) == 4
    assert L.response_budget(p, cap=24) == 24  # off by default: the fixed cap
    assert L.response_budget(p, cap=24, per_item=2, slack=2) == 10
    assert L.response_budget(p, cap=8, per_item=2, slack=2) == 8
    assert len(p.answer) + 1 <= L.response_budget(p, cap=24, per_item=2, slack=2)  # a right answer fits


def test_budgeted_rollouts_stop_at_their_budget_and_truncation_earns_the_minimum(setup):
    cfg, boot = setup
    tok = build_tokenizer()
    task = get_task(cfg.task.name, cfg.task.options)
    engine = L.make_engine(L.load_policy(boot.policy_dir), cfg.rollout.engine)
    problems = L.train_problems(task, 3, 0, 1)
    rollouts, _ = L.rollout_stage(
        engine,
        tok,
        problems,
        3,
        cfg.rollout.sampling,
        run_seed=0,
        iteration=1,
        budget_per_item=1,
        budget_slack=0,
    )
    for r in rollouts:
        assert len(r.response_ids) <= L.prompt_items(r.problem.prompt)
    rollouts[0].finish_reason, rollouts[1].finish_reason = "length", "stop"
    yes = GenRMJudge(lambda prompts: [("verdict: yes", 3, "stop")] * len(prompts))
    judgments, _ = L.reward_stage(yes, rollouts[:2], truncated_reward=-1.0)
    assert [r.reward for r in rollouts[:2]] == [-1.0, 1.0] and judgments[0].reward == -1.0
    L.reward_stage(yes, rollouts[:2])  # without the option the judge's verdict stands
    assert [r.reward for r in rollouts[:2]] == [1.0, 1.0]


def test_train_stage_minibatches_take_one_step_per_slice(setup):
    cfg, boot = setup
    tok = build_tokenizer()
    task = get_task(cfg.task.name, cfg.task.options)
    engine = L.make_engine(L.load_policy(boot.policy_dir), cfg.rollout.engine)
    rollouts, _ = L.rollout_stage(
        engine, tok, L.train_problems(task, 2, 0, 1), 4, cfg.rollout.sampling, run_seed=0, iteration=1
    )
    for i, r in enumerate(rollouts):
        r.reward = float(i % 2)
    trainer = GRPOTrainer(L.load_policy(boot.policy_dir), pad_id=tok.pad_token_id, lr=1e-2, micro_batch=3)
    stats, timing = L.train_stage(trainer, rollouts, minibatches=2)
    assert trainer.version == 2 and stats.version == 2
    assert timing.tokens == sum(len(r.response_ids) for r in rollouts if r.response_ids)
