"""A task made of a user's dataset: the train/held-out split, epoch-wise prompt draws, the verifier.

Why these rules:

* **Split by uid hash.** A row is held out when a hash of its uid falls below ``eval_fraction``: the split
  is the same on every machine and run, does not move when rows are appended or reordered, and no uid can
  be on both sides (uids are unique within a file: `load_dataset` rejects a repeat). With a separate
  ``eval_dataset`` any train row whose uid is also held out is dropped from training and counted.
* **Without replacement per epoch.** Iteration ``i`` takes draws ``i·n … i·n+n-1`` of a stream that is the
  concatenation of one permutation of the train rows per epoch, each keyed by (run seed, epoch): every row
  is seen once per epoch, and the draw is a function of (seed, iteration) only, whatever executes the run.
* **The verifier measures, never rewards** (``exact``, ``math``, or ``none`` when answers cannot be checked
  by rule: then held-out accuracy is not measured at all rather than reported as 0).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pivotrl.errors import UserError
from pivotrl.tasks.base import Problem
from pivotrl.tasks.datasets import load_dataset
from pivotrl.tasks.verifiers import VERIFIERS


def held_out_by_uid(uid: str, fraction: float) -> bool:
    """Whether `uid` is in the held-out share `fraction` (a stable 64-bit hash of the uid, not Python's)."""
    if fraction <= 0.0:
        return False
    h = int.from_bytes(hashlib.blake2b(uid.encode(), digest_size=8).digest(), "little")
    return h / 2.0**64 < fraction


@dataclass(frozen=True)
class DatasetStats:
    """What loading found, reported before a run starts (and by `pivotrl-pipeline validate`)."""

    path: str
    rows: int  # valid rows of task.dataset
    skipped: int  # bad rows skipped (on_bad_row=skip)
    eval_path: str | None
    eval_skipped: int
    train: int
    held_out: int
    overlap_dropped: int  # train rows dropped because their uid is held out (eval_dataset only)
    skipped_examples: tuple[str, ...] = ()

    def line(self) -> str:
        src = f"{self.eval_path} (eval_dataset)" if self.eval_path else "uid hash of task.dataset"
        extra = f", {self.overlap_dropped} train rows dropped as held out" if self.overlap_dropped else ""
        skipped = self.skipped + self.eval_skipped
        return (
            f"dataset {self.path}: {self.rows} rows ({skipped} bad rows skipped); "
            f"train {self.train}, held-out {self.held_out} from {src}{extra}"
        )


class DatasetTask:
    """Problems of a dataset file, split into train and held-out, with a rule-based verifier."""

    def __init__(
        self,
        train: list[Problem],
        held_out: list[Problem],
        verifier: Literal["exact", "math", "none"] = "exact",
        name: str = "dataset",
        stats: DatasetStats | None = None,
    ) -> None:
        if not train:
            raise UserError("task.dataset: no training rows left after the held-out split")
        self.name = name
        self.train = train
        self.held_out = held_out
        self.verifier = verifier
        self.measurable = verifier != "none"
        self.stats = stats

    def sample(self, n: int, seed: int) -> list[Problem]:
        """`n` train problems drawn with replacement (the bootstrap's SFT data)."""
        rng = random.Random(f"{self.name}:sample:{seed}")
        return [self.train[rng.randrange(len(self.train))] for _ in range(n)]

    def _order(self, run_seed: int, epoch: int) -> tuple[int, ...]:
        return _permutation(len(self.train), run_seed, epoch)

    def draw(self, n: int, run_seed: int, iteration: int) -> list[Problem]:
        """Iteration `iteration`'s `n` prompts: the next `n` of the epoch-wise permuted stream."""
        size = len(self.train)
        out = []
        for k in range(iteration * n, (iteration + 1) * n):
            epoch, pos = divmod(k, size)
            out.append(self.train[self._order(run_seed, epoch)[pos]])
        return out

    def epochs(self, n: int, iteration: int) -> float:
        """Epochs of the train split drawn once iteration `iteration` (0-based) has run."""
        return (iteration + 1) * n / len(self.train)

    def held_out_problems(self, n: int) -> list[Problem]:
        return self.held_out[:n]

    def verify(self, problem: Problem, response: str) -> bool:
        if not self.measurable:
            return False
        return VERIFIERS[self.verifier](response, problem.answer)


@lru_cache(maxsize=8)
def _permutation(size: int, run_seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(size))
    random.Random(f"epoch:{run_seed}:{epoch}").shuffle(order)
    return tuple(order)


def load_dataset_task(
    path: str | Path,
    *,
    on_bad_row: Literal["error", "skip"] = "error",
    eval_path: str | Path | None = None,
    eval_fraction: float = 0.0,
    verifier: Literal["exact", "math", "none"] | None = None,
    name: str = "dataset",
) -> DatasetTask:
    """Load `path` (and `eval_path`) and split them (see the module docstring)."""
    loaded = load_dataset(path, on_bad_row)
    if eval_path is not None:
        ev = load_dataset(eval_path, on_bad_row)
        held = ev.problems
        held_uids = {p.uid for p in held}
        train = [p for p in loaded.problems if p.uid not in held_uids]
        eval_skipped = ev.skipped
    else:
        held = [p for p in loaded.problems if held_out_by_uid(p.uid, eval_fraction)]
        train = [p for p in loaded.problems if not held_out_by_uid(p.uid, eval_fraction)]
        eval_skipped = 0
    stats = DatasetStats(
        path=str(path),
        rows=len(loaded.problems),
        skipped=loaded.skipped,
        eval_path=str(eval_path) if eval_path is not None else None,
        eval_skipped=eval_skipped,
        train=len(train),
        held_out=len(held),
        overlap_dropped=len(loaded.problems) - len(train) if eval_path is not None else 0,
        skipped_examples=tuple(loaded.skipped_examples),
    )
    return DatasetTask(train, held, verifier or "exact", name=name, stats=stats)
