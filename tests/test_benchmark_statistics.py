"""The figures the benchmarks report: a throughput over a window of iterations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.paradigms import window_throughput


def test_alternating_iterations_are_weighed_by_their_time() -> None:
    """Short and long iterations alternate (staleness 1): three short of 13k tokens in 1 s and two long of
    32k in 2 s on 2 devices are 103k tokens in 7 s, 7,357 tokens/s/device, where the median of the
    per-iteration figures (6,500) picks a short one."""
    tokens = [13_000.0, 32_000.0, 13_000.0, 32_000.0, 13_000.0]
    seconds = [1.0, 2.0, 1.0, 2.0, 1.0]
    per_device = [t / s / 2 for t, s in zip(tokens, seconds, strict=True)]
    assert window_throughput(tokens, per_device) == pytest.approx(103_000 / 7 / 2)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.floats(1.0, 1e6), st.floats(0.01, 100.0)), min_size=1, max_size=30),
       devices=st.integers(1, 64))
def test_the_window_is_total_tokens_over_total_time_and_lies_between_its_iterations(
        rows: list[tuple[float, float]], devices: int) -> None:
    tokens = [t for t, _ in rows]
    per_device = [t / s / devices for t, s in rows]
    got = window_throughput(tokens, per_device)
    assert got == pytest.approx(sum(tokens) / sum(s for _, s in rows) / devices, rel=1e-9)
    assert min(per_device) * (1 - 1e-9) <= got <= max(per_device) * (1 + 1e-9)


def test_an_untimed_iteration_adds_neither_tokens_nor_time() -> None:
    assert window_throughput([100.0, 5_000.0], [0.0, 50.0]) == pytest.approx(50.0)
    assert window_throughput([100.0], [0.0]) == 0.0
