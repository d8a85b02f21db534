"""The simulated train barrier follows the sharded train group: bucketed ring all-reduce over the link,
optimizer step and publish divided over the ranks, one manifest commit; the driver-owned model is kept."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from pivotrl.sim.config import IterationCost
from pivotrl.sim.costs import barrier_time


def _cfg(owner: str) -> Any:
    """Only `cost.iteration` is read by `barrier_time`."""
    it = IterationCost(optimizer_owner=owner, optimizer_step_s=2.0, publish_s=3.0, grad_allreduce_gb=14.0,
                       allreduce_gb_s=50.0, bucket_gb=0.5, collective_latency_s=0.01, commit_s=0.05)
    return SimpleNamespace(cost=SimpleNamespace(iteration=it))


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_sharded_barrier_is_the_formula(n: int) -> None:
    cfg = _cfg("sharded")
    scatter = (n - 1) / n * 14.0 / 50.0  # a reduce-scatter: each byte crosses the link once
    buckets = math.ceil(14.0 / 0.5) if n > 1 else 0
    assert barrier_time(cfg, n) == pytest.approx(scatter + buckets * 0.01 + 5.0 / n + 0.05)


def test_sharded_beats_driver_beyond_one_rank_and_matches_it_at_one() -> None:
    sharded, driver = _cfg("sharded"), _cfg("driver")
    assert barrier_time(sharded, 1) == pytest.approx(barrier_time(driver, 1) + 0.05)  # + the commit
    for n in (2, 4, 8):
        assert barrier_time(sharded, n) < barrier_time(driver, n)
    assert barrier_time(driver, 4) == pytest.approx(2.0 + 2 * 3 / 4 * 14.0 / 50.0 + 3.0)


@pytest.mark.parametrize("owner", ["sharded", "driver"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_the_control_planes_part_adds_once_whatever_the_owner_and_the_ranks(owner: str, n: int) -> None:
    cfg = _cfg(owner)
    before = barrier_time(cfg, n)
    cfg.cost.iteration = cfg.cost.iteration.model_copy(update={"control_s": 0.14})
    assert barrier_time(cfg, n) == pytest.approx(before + 0.14)
