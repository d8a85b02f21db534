"""The node's host tier (/dev/shm) never holds more policy versions than the store keeps, at every iteration
of a 2-worker run whose workers fill it as they fetch; it is removed when the run ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivotrl.gps import ParameterStore
from pivotrl.run import HOST_TIER_PREFIX
from tests.tiny import tiny_bootstrap

SHM = Path("/dev/shm")


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm: the run has no host tier")
def test_host_tier_holds_no_more_versions_than_the_store(tmp_path):
    from pivotrl.run import run_pipeline

    sets = ["run.iterations=4", "task.eval_prompts=0", "gps.keep_last=1", "train.kl_coef=0.05",
            "cluster.dashboard_address=null", "scheduler.tick_s=0.05"]
    cfg, boot = tiny_bootstrap(tmp_path / "boot", sets)
    cfg.models.policy.path, cfg.models.genrm.path = str(boot.policy_dir), str(boot.judge_dir)
    seen: list[tuple[list[int], list[int]]] = []

    def run_dir() -> Path:
        (run,) = (Path(cfg.run.storage_root) / "runs").iterdir()
        return run

    def check(res, row) -> None:
        host_dir = SHM / f"{HOST_TIER_PREFIX}{run_dir().name}"  # this run's tier (other runs may be live)
        assert host_dir.is_dir()
        name = cfg.models.policy.name
        with ParameterStore(str(host_dir), device_tier_bytes=0) as host:
            in_host = host.versions(name)
        with ParameterStore(str(run_dir() / "gps"), device_tier_bytes=0) as store:
            kept = store.versions(name)
        seen.append((in_host, kept))

    res = run_pipeline(cfg, mode="shiftable", workers=2, log=lambda *_: None, progress=False,
                       evaluate_policy=False, on_iteration=check)
    assert len(res.iterations) == 4 and len(seen) == 4
    for in_host, kept in seen:
        assert set(in_host) <= set(kept), (in_host, kept)
        # the newest, the pinned version 0 (the KL reference) and the last checkpoint's (a resume's start)
        assert len(kept) <= cfg.gps.keep_last + 2
    assert max(v for _, kept in seen for v in kept) >= 3  # versions moved on, old ones were dropped
    assert not (SHM / f"{HOST_TIER_PREFIX}{run_dir().name}").exists()  # the run's tier is gone
