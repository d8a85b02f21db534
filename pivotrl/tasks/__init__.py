"""Tasks: problem families with ground-truth verifiers (synthetic, or a user's JSONL/parquet dataset)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pivotrl.errors import UserError
from pivotrl.tasks.base import ExactMatchTask, Problem, Task, normalize
from pivotrl.tasks.dataset_task import DatasetStats, DatasetTask, load_dataset_task
from pivotrl.tasks.datasets import LoadedDataset, load_dataset
from pivotrl.tasks.synthetic import LengthDistribution, SortTask, SumTask, length_distribution

SYNTHETIC = {"sort": SortTask, "sum": SumTask}

__all__ = [
    "SYNTHETIC",
    "DatasetStats",
    "DatasetTask",
    "ExactMatchTask",
    "LengthDistribution",
    "LoadedDataset",
    "Problem",
    "SortTask",
    "SumTask",
    "Task",
    "build_task",
    "get_task",
    "length_distribution",
    "load_dataset",
    "load_dataset_task",
    "normalize",
]


def get_task(name: str, options: dict[str, Any] | None = None) -> Task:
    """A synthetic task by name; `options` may set the length distribution (median, sigma, min/max_size).
    A bad option is a `UserError` naming it (`task.options.<option>`)."""
    if name not in SYNTHETIC:
        raise UserError(f"task.name: unknown task {name!r}; choose from {sorted(SYNTHETIC)}")
    try:
        lengths = length_distribution(dict(options or {}))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return SYNTHETIC[name](lengths)


def build_task(task_cfg: Any) -> Task:
    """The task of a config's `task` section: its dataset (generated first when `task.generate` names a
    built-in generator and the file is missing), or the synthetic task `task.name`."""
    if task_cfg.dataset is None:
        return get_task(task_cfg.name, task_cfg.options)
    path = Path(task_cfg.dataset)
    if task_cfg.generate is not None and not path.exists():
        from pivotrl.tasks.arith import GENERATORS

        GENERATORS[task_cfg.generate](path)
    return load_dataset_task(
        path,
        on_bad_row=task_cfg.on_bad_row,
        eval_path=task_cfg.eval_dataset,
        eval_fraction=task_cfg.eval_fraction,
        verifier=task_cfg.verifier,
        name=task_cfg.name,
    )
