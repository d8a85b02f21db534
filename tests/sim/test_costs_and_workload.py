"""Cost-model maths and workload generation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.sim.config import LengthDist, WorkloadConfig
from pivotrl.sim.costs import decode_steps, decode_time
from pivotrl.sim.workload import draw_lengths, iteration_sequences, length_profile


@pytest.mark.parametrize("alpha,beta,s0,x", [(0.01, 0.0, 0.0, 100.0), (0.007, 3e-6, 50.0, 1234.5),
                                             (0.02, 1e-4, 0.0, 7.0)])
def test_decode_time_and_steps_are_inverse(alpha: float, beta: float, s0: float, x: float) -> None:
    t = decode_time(alpha, beta, s0, x)
    assert decode_steps(alpha, beta, s0, t) == pytest.approx(x, rel=1e-9)


def test_decode_time_matches_step_by_step_sum() -> None:
    # step s costs alpha + beta*s; the closed form integrates it (continuous steps): compare with a fine sum
    alpha, beta, n = 0.01, 2e-5, 500
    fine = sum(alpha + beta * (i + 0.5) for i in range(n))
    assert decode_time(alpha, beta, 0.0, n) == pytest.approx(fine, rel=1e-9)


def test_lengths_respect_bounds_and_median() -> None:
    rng = np.random.default_rng(0)
    d = LengthDist(dist="lognormal", median=1000, sigma=1.0, min=10, max=8192)
    x = draw_lengths(d, 200_000, rng)
    assert x.min() >= 10 and x.max() <= 8192
    assert np.median(x) == pytest.approx(1000, rel=0.03)
    assert np.percentile(x, 99) > 5 * np.median(x)  # long tail
    assert (draw_lengths(LengthDist(dist="constant", value=7), 10, rng) == 7).all()
    emp = draw_lengths(LengthDist(dist="empirical", samples=[3, 5]), 1000, rng)
    assert set(emp.tolist()) == {3, 5}


def test_iteration_sequences_are_deterministic_and_grouped() -> None:
    wl = WorkloadConfig(prompts_per_iteration=8, group_size=4)
    a, b = iteration_sequences(wl, 1, seed=3), iteration_sequences(wl, 1, seed=3)
    assert [(s.seq_id, s.response_len) for s in a] == [(s.seq_id, s.response_len) for s in b]
    assert len(a) == 32 and len({s.group_id for s in a}) == 8
    for g in {s.group_id for s in a}:
        assert len({s.prompt_len for s in a if s.group_id == g}) == 1  # one prompt per group
    c = iteration_sequences(wl, 2, seed=3)
    assert [s.response_len for s in a] != [s.response_len for s in c]
    assert not math.isnan(sum(s.critique_len for s in a))


@settings(max_examples=12, deadline=None)
@given(median=st.floats(20.0, 2000.0), sigma=st.floats(0.05, 1.2), n=st.integers(2, 4000),
       seed=st.integers(0, 10_000))
def test_the_priors_longest_item_is_the_expected_longest(
    median: float, sigma: float, n: int, seed: int
) -> None:
    """`length_profile`'s longest is the mean of the longest of n drawn items, never a low quantile of it
    (the 1 - 1/(n + 1) quantile is the longest's ~37th percentile: 10-20 % low on a lognormal tail)."""
    dist = LengthDist(dist="lognormal", median=median, sigma=sigma, min=1, max=1 << 20)
    _, longest = length_profile(dist, n, (0.5,))
    rng = np.random.default_rng(seed)
    trials = 400
    maxima = draw_lengths(dist, trials * n, rng).reshape(trials, n).max(axis=1).astype(float)
    se = maxima.std() / math.sqrt(trials)
    assert abs(longest - maxima.mean()) <= 5 * se + 0.01 * maxima.mean() + 1.0
