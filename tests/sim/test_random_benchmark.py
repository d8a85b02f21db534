"""`benchmarks.sim random`'s search overrides reach each draw's static search (the deeper baseline)."""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.sim import _at_least_one, _random_one, in_order


def test_a_wider_search_is_the_one_the_draw_runs() -> None:
    """Draw 29 has 81 splits, above the exhaustive limit: its baseline comes from the model-ranked search,
    whose width the flags set."""
    quick = _random_one(29, True)
    wide = _random_one(29, True, {"top_k": 4, "max_simulations": 14})
    assert quick["static_search"]["method"] == "model top-3 + hill-climb (at most 12 simulated)"
    assert wide["static_search"]["method"] == "model top-4 + hill-climb (at most 14 simulated)"
    assert quick["static_search"]["splits_simulated"] <= 12
    assert wide["static_search"]["splits_simulated"] <= 14
    assert wide["tokens_per_s_per_device"]["shiftable"] == quick["tokens_per_s_per_device"]["shiftable"]


@given(st.one_of(st.integers(-10**6, 10**6).map(str), st.text(max_size=8)))
def test_a_search_width_is_an_integer_of_at_least_one(text: str) -> None:
    try:
        expected = int(text)
    except ValueError:
        expected = None
    if expected is not None and expected >= 1:
        assert _at_least_one(text) == expected
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            _at_least_one(text)


def _fail_or_wait(i: int) -> int:
    if i == 0:
        raise ValueError("draw 0 broke")
    time.sleep(0.2)   # stands in for a draw's simulation
    return i


def test_a_failed_item_stops_the_run_and_cancels_the_items_not_started() -> None:
    """One worker: item 0 fails while the next are queued; the run raises item 0's error at once, and
    the other 29 items (0.2 s each) do not all run first."""
    with ProcessPoolExecutor(max_workers=1) as pool:
        futs = {f"seed {i}": pool.submit(_fail_or_wait, i) for i in range(30)}
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match="draw 0 broke"):
            list(in_order(pool, futs))
    assert time.perf_counter() - t0 < 3.0   # not 30 × 0.2 s
    ran = [f for f in futs.values() if f.done() and not f.cancelled()]   # the rest wait or are cancelled
    assert len(ran) <= 5
