"""The opening's loan (`makespan.lent_split`) is priced before it is made (`makespan.loaned_makespan`).

Why: a replica holding a long rollout is idle only when that rollout ends, so on a cold draw with
long-tailed rollouts the devices lent to the first stage came home 25–35 s into the iteration, after a
10–13 s shift, and the first iteration ran 4–5 % slower than its own split (random draws 416 and 440).
"""

from __future__ import annotations

from pivotrl.sim.compare import simulate
from pivotrl.sim.randomized import draw_config


def test_a_cold_long_tailed_draw_opens_on_its_split_when_the_loan_would_come_home_late() -> None:
    """Random draw 416: 37 devices, lognormal responses, 13 s cold shifts. The best static split found
    (17 / 6 / 14) runs iteration 0 in 111.1 s; shiftable, which lent train's devices to the rollouts,
    ran it in 116.7 s. Priced, the loan comes home after the rollouts' tail, and shiftable opens on the
    split."""
    cfg, draw = draw_config(416, quick=True)
    assert draw.shift == "cold" and draw.shape == "unimodal"
    split = {"rollout": 17, "reward": 6, "train": 14}
    static = simulate(cfg, "disaggregated", split, iterations=1, record=False).iterations[0]["total_s"]
    shiftable = simulate(cfg, "shiftable", iterations=1, record=False).iterations[0]["total_s"]
    assert shiftable <= static * 1.01
