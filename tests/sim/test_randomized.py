"""The randomized workload generator: deterministic in its seed, every shape, within the stated ranges."""

from __future__ import annotations

from pivotrl.sim.compare import simulate
from pivotrl.sim.randomized import SHAPES, draw_config


def test_a_draw_is_a_pure_function_of_its_seed() -> None:
    a, da = draw_config(7, quick=True)
    b, db = draw_config(7, quick=True)
    assert a.model_dump() == b.model_dump() and da == db
    c, _ = draw_config(8, quick=True)
    assert c.model_dump() != a.model_dump()


def test_draws_cover_every_shape_and_stay_in_range() -> None:
    seen = set()
    for seed in range(24):
        cfg, d = draw_config(seed, quick=True)
        seen.add(d.shape)
        assert 8 <= cfg.cluster.devices <= 1024
        assert 2 <= cfg.workload.group_size <= 64
        assert cfg.workload.prompts_per_iteration * cfg.workload.group_size <= 6144
        assert d.shift in ("warm", "cold")
        for r in ("rollout", "reward", "train"):
            assert getattr(cfg.cost, r).devices_per_replica == d.devices_per_replica[r]
        if d.shape == "near_constant":
            assert cfg.workload.response_len.sigma <= 0.06
        if d.shape == "heavy_tail":
            assert cfg.workload.response_len.sigma >= 1.2
        if d.shape == "multimodal":
            assert cfg.workload.response_len.dist == "empirical"
    assert seen == set(SHAPES)


def test_a_small_draw_runs_every_paradigm_to_the_end() -> None:
    cfg, _ = draw_config(28, quick=True)   # 8 devices
    for mode in ("colocated", "shiftable"):
        r = simulate(cfg, mode, record=False, iterations=1)
        assert r.finished and r.conservation["conserved"]
