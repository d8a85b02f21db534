"""The model's exhaustive static search stays cheap where every split's makespan is set by the lengths' tail.

Why: `ranked` prices splits in full in the order of a cheap lower bound and stops once the best full
price is below the next bound. On random draw 31 (757 devices, heavy-tailed lengths) the bound sits a
few percent under the full price on most of its 285k splits, so an exact search priced 175k of them in
full, 10 s at every iteration start; at most `MAX_FULL_SPLITS` are priced now.
"""

from __future__ import annotations

import numpy as np
import pytest

from pivotrl.core import makespan
from pivotrl.core.makespan import MAX_FULL_SPLITS, ranked, static_makespans
from pivotrl.core.types import PIPELINE, Role
from pivotrl.sim.compare import model_stages
from pivotrl.sim.randomized import draw_config


def test_a_flat_search_prices_at_most_max_full_splits_and_takes_the_best_of_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, _ = draw_config(31, quick=True)
    st = model_stages(cfg)
    assert st is not None
    n = cfg.cluster.devices
    g = {r: st[r].g for r in PIPELINE}
    a, b = np.meshgrid(np.arange(1, n // g[Role.ROLLOUT] + 1), np.arange(1, n // g[Role.REWARD] + 1),
                       indexing="ij")
    c = (n - a * g[Role.ROLLOUT] - b * g[Role.REWARD]) // g[Role.TRAIN]
    ok = c >= 1
    reps = {r: x[ok].astype(float) for r, x in zip(PIPELINE, (a, b, c))}
    bound = static_makespans(st, reps, last_end=False)
    priced: list[int] = []
    real = makespan.static_makespans

    def counting(st_: dict[Role, object], reps_: dict[Role, np.ndarray], last_end: bool = True,
                 beat: float = np.inf) -> np.ndarray:
        if last_end:
            priced.append(int(np.size(reps_[Role.ROLLOUT])))
        return real(st_, reps_, last_end, beat)

    monkeypatch.setattr(makespan, "static_makespans", counting)
    (i, t), = ranked(st, reps, 1)
    assert sum(priced) <= MAX_FULL_SPLITS
    assert int((bound < t).sum()) > MAX_FULL_SPLITS   # an exact search would have priced more
    first = np.argsort(bound, kind="stable")[:MAX_FULL_SPLITS]
    assert i in set(first.tolist())
    assert t == pytest.approx(float(real(st, {r: v[first] for r, v in reps.items()}).min()), rel=1e-9)
