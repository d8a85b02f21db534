"""The runtime's `IterationPlan` (`IterationMeter.iteration_plan`) marks the run's last iteration, so core
charges no trip back for a device lent downstream in it (`planner.return_trip_s`)."""

from __future__ import annotations

from types import SimpleNamespace

from pivotrl.runtime.metrics import IterationMeter


def _cfg(iterations: int) -> SimpleNamespace:
    return SimpleNamespace(run=SimpleNamespace(iterations=iterations), task=SimpleNamespace(group_size=4),
                           rollout=SimpleNamespace(sampling=SimpleNamespace(max_new_tokens=24)),
                           reward=SimpleNamespace(sampling=SimpleNamespace(max_new_tokens=64)))


def test_only_the_configured_last_iteration_is_marked_last() -> None:
    meter = IterationMeter(session=None, log=lambda _msg: None)
    samples = [SimpleNamespace(prompt_ids=[1, 2, 3])] * 8
    for n in (1, 3, 5):
        plans = [meter.iteration_plan(it, samples, _cfg(n)) for it in range(n)]
        assert [p.last_iteration for p in plans] == [it == n - 1 for it in range(n)]
        assert all(p.rollout_seqs == 8 and p.group_size == 4 for p in plans)
