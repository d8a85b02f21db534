"""Tasks: problem families with ground-truth verifiers (synthetic or loaded from JSONL/parquet)."""

from __future__ import annotations

from typing import Any

from pivotrl.errors import UserError
from pivotrl.tasks.base import ExactMatchTask, Problem, Task, normalize
from pivotrl.tasks.datasets import LoadedDataset, load_dataset
from pivotrl.tasks.synthetic import LengthDistribution, SortTask, SumTask

SYNTHETIC = {"sort": SortTask, "sum": SumTask}

__all__ = [
    "SYNTHETIC",
    "ExactMatchTask",
    "LengthDistribution",
    "LoadedDataset",
    "Problem",
    "SortTask",
    "SumTask",
    "Task",
    "get_task",
    "load_dataset",
    "normalize",
]


def get_task(name: str, options: dict[str, Any] | None = None) -> Task:
    """A synthetic task by name; `options` may set the length distribution (median, sigma, min/max_size)."""
    if name not in SYNTHETIC:
        raise UserError(f"task.name: unknown task {name!r}; choose from {sorted(SYNTHETIC)}")
    options = dict(options or {})
    try:
        lengths = LengthDistribution(**options)
    except TypeError as exc:
        raise UserError(f"task.options: {exc}") from None
    return SYNTHETIC[name](lengths)
