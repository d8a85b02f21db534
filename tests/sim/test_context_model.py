"""Core's iteration model against the simulator where decode steps slow with context.

Why: the simulator's decode step costs a + b·batch + c·context, and a decoded token's context is its
prompt plus the tokens before it, far past half the mean length where lengths vary. Core prices that
context (`RoleSpec.step_context_s`, `pivotrl.core.iteration.at_context`); priced at half the mean, the
model ended random draw 36's rollouts 9 s (12 %) early and ranked its splits the wrong way round.
"""

from __future__ import annotations

import numpy as np
import pytest

from pivotrl.core.makespan import static_makespans
from pivotrl.core.types import PIPELINE, Role
from pivotrl.sim.compare import model_stages, simulate
from pivotrl.sim.randomized import draw_config
from pivotrl.sim.workload import draw_lengths, mean_position


def test_a_long_tailed_draws_static_makespans_and_their_order_follow_the_simulator() -> None:
    """The rollouts' end, which the context prices, within 4 % (3.3 % with 12 rollout devices); the
    whole split within 10 % and the splits ranked as the simulator ranks them. The whole split ran within
    3 % while a group's completion was its typical member plus `group_lag`: that lag's 17 s (the longest
    of two judgements of a long tail) offset the judge stage ending 3 s early here, where the late
    judgements are of the longest rollouts (`docs/decisions.md`, "A group completes no later than its
    members would independently")."""
    cfg, draw = draw_config(36, quick=True)
    assert draw.shape == "unimodal" and cfg.workload.response_len.sigma > 0.8  # a long tail
    st = model_stages(cfg)
    assert st is not None
    splits = ({"rollout": 9, "reward": 5, "train": 21}, {"rollout": 10, "reward": 5, "train": 20},
              {"rollout": 12, "reward": 5, "train": 18})
    model, sim = [], []
    for split in splits:
        reps = {r: np.asarray([float(split[str(r)] // st[r].g)]) for r in PIPELINE}
        model.append(float(static_makespans(st, reps)[0]))
        ran = simulate(cfg, "disaggregated", split, iterations=1, record=False).iterations[0]
        sim.append(ran["total_s"])
        rollouts_end = float(st[Role.ROLLOUT].timing(reps[Role.ROLLOUT])[1][0])
        assert rollouts_end == pytest.approx(ran["rollout_s"], rel=0.04)
    for m, s in zip(model, sim):
        assert m == pytest.approx(s, rel=0.10)
    assert int(np.argmin(model)) == int(np.argmin(sim))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_mean_position_is_the_mean_context_a_decoded_token_sees(seed: int) -> None:
    """Counted token by token over 2,000 drawn items: the tokens generated before each decoded token,
    averaged; `mean_position` gives it from the distribution (by sampling), past half the mean length."""
    cfg, _ = draw_config(seed, quick=True)
    dist = cfg.workload.response_len
    x = draw_lengths(dist, 2000, np.random.default_rng(seed)).astype(int)
    counted = float(np.concatenate([np.arange(n) for n in x]).mean())
    assert mean_position(dist) == pytest.approx(counted, rel=0.1)
    assert mean_position(dist) >= 0.5 * (float(x.mean()) - 1.0) * 0.9
