"""Bounded storage: with `gps.keep_last` = K the store holds at most K policy versions plus the pinned
version 0 (the KL reference) at every iteration of a 20-iteration run, and its bytes on disk stay bounded."""

from __future__ import annotations

from pathlib import Path

from pivotrl.gps import ParameterStore
from pivotrl.loop import run_loop
from tests.tiny import tiny_bootstrap


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_keep_last_bounds_policy_versions_and_bytes_over_20_iterations(tmp_path):
    keep = 2
    sets = [
        "task.eval_prompts=0",
        "train.kl_coef=0.05",
        f"gps.keep_last={keep}",
        f"gps.root={tmp_path / 'gps'}",
    ]
    cfg, boot = tiny_bootstrap(tmp_path / "boot", sets)
    seen: list[list[int]] = []
    sizes: list[int] = []

    def check(res, row) -> None:
        with ParameterStore(cfg.gps.root, device_tier_bytes=0) as store:
            seen.append(store.versions(cfg.models.policy.name))
        sizes.append(disk_bytes(tmp_path / "gps" / cfg.models.policy.name))

    res = run_loop(cfg, boot.policy_dir, boot.judge_dir, iterations=20, on_iteration=check)
    assert len(res.history) == 20
    last = res.history[-1]["version"]
    assert last >= 15  # the policy really moved on (a skipped step publishes nothing)
    assert all(len(v) <= keep + 1 and v[0] == 0 for v in seen), seen
    assert seen[-1] == [0, last - 1, last]
    with ParameterStore(cfg.gps.root, device_tier_bytes=0) as store:
        assert store.pinned(cfg.models.policy.name) == [0]
        one = store.manifest(cfg.models.policy.name, last).nbytes
    # every version has the same tensors: K + 1 of them, plus manifests and zarr metadata
    assert max(sizes) <= (keep + 1) * one * 1.2 + 64 * 1024, (max(sizes), one)
    assert sizes[-1] < 20 * one / 4  # far below what 20 kept versions would take
