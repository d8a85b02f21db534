"""A run on a local cluster gives its driver the cores its device workers leave (at least one), for the
whole run, and gives the caller its own thread count back afterwards."""

from __future__ import annotations

import torch

from pivotrl.runtime.cluster import default_workers, driver_threads
from tests.tiny import tiny_bootstrap


def test_the_driver_leaves_the_local_workers_their_cores(tmp_path):
    from pivotrl.run import run_pipeline

    sets = ["run.iterations=2", "task.eval_prompts=0", "cluster.dashboard_address=null"]
    cfg, boot = tiny_bootstrap(tmp_path / "boot", sets)
    cfg.models.policy.path, cfg.models.genrm.path = str(boot.policy_dir), str(boot.judge_dir)
    before = torch.get_num_threads()
    caller = default_workers() + 5  # never what the run should pick
    seen: list[int] = []
    try:
        torch.set_num_threads(caller)
        run_pipeline(cfg, mode="shiftable", workers=2, log=lambda *_: None, progress=False,
                     evaluate_policy=False, save_final=False,
                     on_iteration=lambda res, row: seen.append(torch.get_num_threads()))
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert seen == [driver_threads(default_workers(), 2, cfg.cluster.torch_threads)] * 2
    assert after == caller
