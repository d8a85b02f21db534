"""`benchmarks.sim random`'s search overrides reach each draw's static search (the deeper baseline)."""

from __future__ import annotations

from benchmarks.sim import _random_one


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
