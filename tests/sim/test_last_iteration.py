"""The simulator tells core which iteration is the run's last (`IterationPlan.last_iteration`): after it no
opening takes back a device lent downstream, so core charges no trip back (`planner.return_trip_s`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivotrl.sim.config import load_sim_config
from pivotrl.sim.engine import Simulator

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["cluster.devices=8", "workload.prompts_per_iteration=8", "workload.group_size=2"]


@pytest.mark.parametrize("configured,run", [(3, None), (3, 2), (1, None)])
def test_only_the_runs_last_iteration_is_marked_last(configured: int, run: int | None) -> None:
    paper = ROOT / "configs/sim/paper-32gpu.yaml"
    cfg = load_sim_config(paper, [*SMALL, f"workload.iterations={configured}"])
    sim = Simulator(cfg, "shiftable", iterations=run)
    plans = []
    begin = sim.ctl.begin_iteration

    def record(plan, now):
        plans.append(plan)
        return begin(plan, now)

    sim.ctl.begin_iteration = record
    assert sim.run().finished
    n = run or configured
    assert [p.iteration for p in plans] == list(range(n))
    assert [p.last_iteration for p in plans] == [i == n - 1 for i in range(n)]
