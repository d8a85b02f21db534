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

import math
import random
from dataclasses import dataclass

from pivotrl.tasks.base import Problem, normalize


@dataclass(frozen=True)
class LengthDistribution:
    """Clipped log-normal over problem sizes: median `median`, spread `sigma` (of the log)."""

    median: float = 3.0
    sigma: float = 1.0
    min_size: int = 1
    max_size: int = 64

    def draw(self, rng: random.Random) -> int:
        size = round(math.exp(rng.gauss(math.log(self.median), self.sigma)))
        return max(self.min_size, min(self.max_size, size))


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
