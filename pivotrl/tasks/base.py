"""What a task is: problems with a reference answer and a ground-truth verifier.

The verifier is used to *measure* (held-out accuracy) and to build the GenRM's synthetic training
judgments; during RL the policy is rewarded by the generative judge only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer. `uid` is stable across runs for the same seed."""

    uid: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


def normalize(text: str) -> str:
    """Canonical form for exact-match checks: collapse whitespace, strip both ends."""
    return " ".join(text.split())


class Task(Protocol):
    """A problem family. `sample` is deterministic in (n, seed)."""

    name: str

    def sample(self, n: int, seed: int) -> list[Problem]: ...

    def verify(self, problem: Problem, response: str) -> bool: ...


class ExactMatchTask:
    """Problems from a dataset file: a response is correct when it equals the answer after `normalize`."""

    def __init__(self, problems: list[Problem], name: str = "dataset") -> None:
        if not problems:
            raise ValueError("a dataset task needs at least one problem")
        self.name = name
        self.problems = problems

    def sample(self, n: int, seed: int) -> list[Problem]:
        import random

        rng = random.Random(seed)
        return [self.problems[rng.randrange(len(self.problems))] for _ in range(n)]

    def verify(self, problem: Problem, response: str) -> bool:
        return normalize(response) == normalize(problem.answer)
