"""`train.optimizer_owner: sharded` end to end: a real run on 2 device workers whose optimizer steps are
taken by the train group, against the same run with the driver-owned optimizer; the driver never loads
the policy (`PolicyUpdater.load` is made to fail), and the run's checkpoint names the store's versions."""

from __future__ import annotations

import pytest
import torch

from pivotrl.engines.checkpoints import load_state_dict
from tests.test_recipe_equivalence import max_diff, stages
from tests.tiny import tiny_bootstrap

SETS = ["run.iterations=2", "run.seed=3", "task.eval_prompts=0", "train.minibatches=2",
        "cluster.dashboard_address=null", "scheduler.tick_s=0.05"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg, boot = tiny_bootstrap(tmp_path_factory.mktemp("sharded"), SETS)
    cfg.models.policy.path, cfg.models.genrm.path = str(boot.policy_dir), str(boot.judge_dir)
    return cfg, boot


def _run(cfg):
    from pivotrl.run import run_pipeline

    return run_pipeline(cfg, mode="colocated", workers=2, stages=stages(), log=lambda *_: None,
                        progress=False, evaluate_policy=False)


@pytest.mark.timeout(1200)
def test_sharded_owner_runs_and_matches_the_driver_owner(setup, monkeypatch):
    from pivotrl import checkpoint
    from pivotrl.grpo import PolicyUpdater

    cfg, boot = setup
    driver = _run(cfg)
    sharded_cfg = cfg.model_copy(deep=True)
    sharded_cfg.train.optimizer_owner = "sharded"

    def no_driver_model(*a, **k):
        raise AssertionError("the driver loaded the policy")

    monkeypatch.setattr(PolicyUpdater, "load", classmethod(no_driver_model))
    sharded = _run(sharded_cfg)
    assert [r["iteration"] for r in sharded.iterations] == [0, 1]
    ckpt, state = checkpoint.load(checkpoint.latest(sharded.run_dir))
    assert state["trainer"] == {"sharded": True, "version": ckpt.policy_version} and ckpt.policy_version == 4
    a, b = load_state_dict(driver.final_policy), load_state_dict(sharded.final_policy)
    v0 = load_state_dict(boot.policy_dir)
    assert max_diff(b, v0) > 0.5 * cfg.train.lr  # it learnt something
    # the same recipe: the schedules differ (micro-batch order), so the sums are reassociated
    assert max_diff(a, b) <= 1e-2 * cfg.train.lr
    assert all(t.dtype == torch.float32 for t in b.values())
