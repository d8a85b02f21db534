"""Core's iteration model, before anything is measured, against the simulator on a judge-bound draw.

Why: the last judgement is the longest of n items, and its length varies from draw to draw by a fifth
either way. Where train's backlog ends a few seconds before the expected last judgement, the iteration
waits for train in every draw whose judge stage ends early. Priced as the later of the two expectations,
train's share looked free on random draw 349: the model gave train 18 devices and rollout 62, which ran
7 % slower than 44 rollout and 36 train devices (`docs/decisions.md`, "The last judgement's length is
random").
"""

from __future__ import annotations

import numpy as np

from pivotrl.core.iteration import stages
from pivotrl.core.makespan import static_makespans
from pivotrl.core.types import PIPELINE
from pivotrl.sim.compare import simulate
from pivotrl.sim.driver import build_controller, iteration_plan
from pivotrl.sim.randomized import draw_config


def test_before_any_measurement_the_model_ranks_a_judge_bound_draws_splits_as_the_simulator() -> None:
    cfg, draw = draw_config(349, quick=True)
    assert draw.group_size == 32 and draw.devices == 146
    ctl = build_controller(cfg, "disaggregated")
    ctl.state.plan = iteration_plan(cfg, 0)
    st = stages(ctl.state, ctl.shift_costs, None)  # the priors: configured distributions, no profile
    assert st is not None
    splits = ({"rollout": 62, "reward": 66, "train": 18}, {"rollout": 44, "reward": 66, "train": 36})
    model, sim = [], []
    for split in splits:
        reps = {r: np.asarray([float(split[str(r)] // st[r].g)]) for r in PIPELINE}
        model.append(float(static_makespans(st, reps)[0]))
        sim.append(simulate(cfg, "disaggregated", split, iterations=1, record=False).iterations[0]["total_s"])
    assert sim[1] < sim[0] * 0.95  # the simulator's order, by a clear margin
    assert model[1] < model[0]
