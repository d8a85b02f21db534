"""core's staleness bound: when an iteration may start and train, checked against its definition."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.core.staleness import InFlight, StalenessBound


def test_on_policy_waits_for_the_previous_iteration_to_train():
    bound = StalenessBound(0)
    assert bound.may_start(InFlight(0, 0, True))
    assert not bound.may_start(InFlight(3, 2, True))  # iteration 2 generated but has not trained
    assert bound.may_start(InFlight(3, 3, False))


def test_one_stale_iteration_starts_when_the_previous_one_finished_generating():
    bound = StalenessBound(1)
    assert not bound.may_start(InFlight(3, 2, False))  # iteration 2 still generating
    assert bound.may_start(InFlight(3, 2, True))
    assert not bound.may_start(InFlight(3, 1, True))  # would lag two iterations


def test_negative_staleness_is_refused():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessBound(-1)


@settings(max_examples=500, derandomize=True, deadline=None)
@given(k=st.integers(0, 3), moves=st.lists(st.sampled_from(["start", "generate", "train"]), max_size=60))
def test_a_driver_that_obeys_the_bound_never_lags_more_than_k(k, moves):
    """Drive a model of the pipeline: iterations start when the bound allows, finish generating in order
    and train in order. The lag of each started iteration (iterations not trained when it starts) stays
    within k, at most k+1 are in flight, and training is never out of order."""
    bound = StalenessBound(k)
    started = generated = trained = 0
    for move in moves:
        if move == "start" and bound.may_start(InFlight(started, trained, generated == started)):
            assert started - trained <= k
            started += 1
            assert started - trained <= bound.window()
        elif move == "generate" and generated < started:
            generated += 1
        elif move == "train" and trained < generated and bound.may_train(trained, trained):
            trained += 1
    assert trained <= generated <= started


@given(k=st.integers(0, 3), j=st.integers(0, 50), t=st.integers(0, 50), done=st.booleans())
def test_more_training_never_forbids_a_start(k, j, t, done):
    bound = StalenessBound(k)
    if bound.may_start(InFlight(j, t, done)):
        assert bound.may_start(InFlight(j, t + 1, done))
    assert bound.may_train(j, t) == (t >= j)
