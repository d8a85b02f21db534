"""Synthetic task families with ground-truth verifiers and long-tailed response lengths.

Real RL post-training sees long-tailed response lengths (p99 ≈ 10× the median); that tail is what makes
static GPU splits idle, so our CPU-scale tasks reproduce it on purpose. Each family draws a *problem size*
from a clipped log-normal distribution, and the response length grows linearly with the size.

All text uses a small character alphabet (digits, a few letters, space, `=`, `+`, `:`), which the
character-level tokenizer in `pivotrl.engines.checkpoints` covers.

* ``sort``: ``"sort 3 9 1 4="`` → ``"1 3 4 9"``. Response ≈ 2 × size characters.
* ``sum``:  ``"sum 3 5 2="`` → ``"3 8 10"`` — running partial sums as the working, the last one the answer.
  Only the final number is checked, so a model may get the working wrong and the answer right.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, fields

from pivotrl.errors import FieldError
from pivotrl.tasks.base import Problem, normalize

#: The most items a synthetic problem may have: far beyond any context a model here has, and small
#: enough that sampling a problem can never exhaust memory.
MAX_ITEMS = 100_000


@dataclass(frozen=True)
class LengthDistribution:
    """Clipped log-normal over problem sizes: median `median`, spread `sigma` (of the log)."""

    median: float = 3.0
    sigma: float = 1.0
    min_size: int = 1
    max_size: int = 64

    def draw(self, rng: random.Random) -> int:
        log_size = rng.gauss(math.log(self.median), self.sigma)
        # clipped in log space first, so that no finite median or sigma can overflow `exp`: past these
        # margins the rounded size would be clipped to the same bound anyway
        if log_size > math.log(self.max_size) + 1.0:
            return self.max_size
        if log_size < math.log(self.min_size) - 1.0:
            return self.min_size
        return max(self.min_size, min(self.max_size, round(math.exp(log_size))))


def length_distribution(options: Mapping[str, object], field: str = "task.options") -> LengthDistribution:
    """The `LengthDistribution` a synthetic task's options describe.

    Raises `FieldError` (a ValueError) naming `field.<option>` for an unknown option, a value that is not a
    finite number, a median that is not positive, a negative sigma, or sizes outside 1 <= min_size <=
    max_size <= MAX_ITEMS: a config's options are user input, and each of those would otherwise surface
    much later as a traceback (a math domain error, an overflow) or a problem too large to sample."""
    names = [f.name for f in fields(LengthDistribution)]
    values: dict[str, float | int] = {}
    for key, value in options.items():
        if key not in names:
            raise FieldError(field, key, f"unknown option; choose from {', '.join(names)}")
        if isinstance(value, str):  # YAML 1.1 reads `1e3` as text; pydantic's number fields accept it too
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise FieldError(field, key, f"a finite number is wanted, got {value!r}")
        if key.endswith("_size"):
            if value != int(value) or not 1 <= value <= MAX_ITEMS:
                raise FieldError(field, key, f"a whole number of items from 1 to {MAX_ITEMS}, got {value!r}")
            value = int(value)
        elif key == "median" and value <= 0:
            raise FieldError(field, key, f"must be > 0, got {value!r}")
        elif key == "sigma" and value < 0:
            raise FieldError(field, key, f"must be >= 0, got {value!r}")
        values[key] = value
    dist = LengthDistribution(**values)  # type: ignore[arg-type]
    if dist.min_size > dist.max_size:
        raise FieldError(field, "min_size", f"{dist.min_size} is above max_size {dist.max_size}")
    return dist


class SortTask:
    """Sort a list of single digits in ascending order."""

    name = "sort"

    def __init__(self, lengths: LengthDistribution | None = None) -> None:
        self.lengths = lengths or LengthDistribution()

    def make(self, digits: list[int], uid: str) -> Problem:
        prompt = "sort " + " ".join(map(str, digits)) + "="
        answer = " ".join(map(str, sorted(digits)))
        return Problem(uid=uid, prompt=prompt, answer=answer, meta={"size": len(digits)})

    def sample(self, n: int, seed: int) -> list[Problem]:
        rng = random.Random(f"{self.name}:{seed}")
        out = []
        for i in range(n):
            size = self.lengths.draw(rng)
            out.append(self.make([rng.randrange(10) for _ in range(size)], uid=f"{self.name}-{seed}-{i}"))
        return out

    def verify(self, problem: Problem, response: str) -> bool:
        return normalize(response) == problem.answer


class SumTask:
    """Add a list of single digits, writing every running partial sum; the last number is the answer."""

    name = "sum"

    def __init__(self, lengths: LengthDistribution | None = None) -> None:
        self.lengths = lengths or LengthDistribution()

    def make(self, digits: list[int], uid: str) -> Problem:
        partial, sums = 0, []
        for d in digits:
            partial += d
            sums.append(partial)
        prompt = "sum " + " ".join(map(str, digits)) + "="
        return Problem(uid=uid, prompt=prompt, answer=" ".join(map(str, sums)), meta={"size": len(digits)})

    def sample(self, n: int, seed: int) -> list[Problem]:
        rng = random.Random(f"{self.name}:{seed}")
        out = []
        for i in range(n):
            digits = [rng.randrange(10) for _ in range(self.lengths.draw(rng))]
            out.append(self.make(digits, uid=f"{self.name}-{seed}-{i}"))
        return out

    def verify(self, problem: Problem, response: str) -> bool:
        words = normalize(response).split(" ")
        return bool(words) and words[-1] == problem.answer.split(" ")[-1]
