"""The randomized workload generator: deterministic in its seed, every shape, within the stated ranges."""

from __future__ import annotations

import pytest

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


def test_the_model_prices_the_first_complete_groups_as_the_simulator_runs_them() -> None:
    """Draw 29 (groups of 16, long-tailed multimodal lengths) on 4/4/31: the rollout's slots hold a fifth
    of the items, admitted first in, first out. The model's first complete group (`groups_complete`) comes
    within a quarter of the simulator's first train item; every member started at 0 (the view it replaced)
    priced it 50 % late."""
    import numpy as np

    from pivotrl.core.makespan import groups_complete
    from pivotrl.core.types import Role
    from pivotrl.sim.compare import model_stages

    cfg, _ = draw_config(29, quick=True)
    split = {"rollout": 4, "reward": 4, "train": 31}
    st = model_stages(cfg)
    assert st is not None
    ro, rw, tr = st[Role.ROLLOUT], st[Role.REWARD], st[Role.TRAIN]
    m_ro, m_rw = (np.asarray([float(split[r] // st[Role(r)].g)]) for r in ("rollout", "reward"))
    up = ro.emissions(m_ro)
    horizon = rw.after(up, m_rw, 1.0 / ro.seqs)
    first = 1.0 - tr.group / ro.seqs      # all groups but one still incomplete
    (predicted,) = groups_complete(ro, rw, m_ro, m_rw, tr.group, (first,), up, horizon)
    all_at_zero = rw.after(up, m_rw, 1.0 - (1.0 - first) ** (1.0 / tr.group))
    run = simulate(cfg, "disaggregated", split, iterations=1, record=True)
    measured = run.summary()["iterations"][0]
    train_end = measured["rollout_s"] + measured["reward_tail_s"] + measured["train_tail_s"]
    first_train_item = train_end - measured["train_span_s"]
    assert float(predicted[0]) == pytest.approx(first_train_item, rel=0.25)
    assert abs(float(all_at_zero[0]) / first_train_item - 1.0) > 0.25
