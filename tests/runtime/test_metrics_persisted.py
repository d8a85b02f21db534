"""Per-sample lists in a metrics row stay in memory: summaries and checkpoints get the row without them."""

from __future__ import annotations

from pivotrl.runtime.metrics import IN_MEMORY_ONLY, persisted


def test_persisted_rows_drop_per_sample_lists_and_keep_everything_else():
    row = {"iteration": 3, "seconds": 1.5, "device_time": {"w": {"train": 0.2}},
           "lengths": {"response": list(range(8192))}}
    out = persisted(row)
    assert out == {"iteration": 3, "seconds": 1.5, "device_time": {"w": {"train": 0.2}}}
    assert "lengths" in row and set(IN_MEMORY_ONLY) == {"lengths"}  # the caller's row is left as it was
