"""Generative reward model: an LLM judge that *writes* a critique and a verdict, parsed from its text.

Why generative: the judge's critiques are long and their length varies with the problem, which makes the
reward stage expensive and long-tailed — the load that role shifting exists to absorb. Our judge first
re-derives the reference answer item by item, marking each item of the response against it (the
critique's length grows with the problem size), and then writes ``verdict: yes`` or ``verdict: no``.
A GPU-scale judge (Qwen3-30B-A3B) uses the same template idea with a longer natural-language critique.

The parser never raises: unparseable text gets a configurable default reward and is counted, because a
judge that rambles must not crash an RL run.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pivotrl.tasks.base import Problem, normalize

_VERDICT = re.compile(r"verdict\s*[:=]\s*(yes|no|correct|incorrect|true|false|pass|fail)\b", re.IGNORECASE)
_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_POSITIVE = {"yes", "correct", "true", "pass"}


TAGS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class JudgeTemplate:
    """How a (prompt, response) pair is shown to the judge, and what a well-formed judgment looks like.

    The response is shown with its items tagged by position (``1 3 4 9`` → ``a1 b3 c4 d9``), the way judges
    are shown numbered lines or steps, so the critique can refer to items by tag. The judge then re-derives
    the reference item by item and marks each against the response's item with the same tag — ``=`` when
    they agree, ``x`` when not — and one more tag past the end (``-``) catches a response that runs long:

        sort 3 9 1 3=a1 b3 c9\n  →  a1= b3= c3x d9x e-= verdict: no

    The critique grows with the problem (≈ 4 characters per item), so judging is as long-tailed as the task.
    """

    separator: str = "\n"
    max_items: int = len(TAGS) - 1

    def items(self, text: str) -> list[str]:
        return text.split()[: self.max_items]

    def prompt(self, problem_prompt: str, response: str) -> str:
        shown = " ".join(f"{TAGS[i]}{w}" for i, w in enumerate(self.items(response)))
        return f"{problem_prompt}{shown}{self.separator}"

    def rationale(self, problem: Problem, response: str) -> str:
        """The critique a perfect judge writes before its verdict: reference items marked against the
        response's."""
        ref = normalize(problem.answer).split(" ")[: self.max_items]
        got = self.items(response)
        parts = []
        for k in range(len(ref) + 1):
            want = ref[k] if k < len(ref) else "-"
            have = got[k] if k < len(got) else "-"
            parts.append(f"{TAGS[k]}{want}{'=' if want == have else 'x'}")
        return " ".join(parts)

    def judgment(self, problem: Problem, response: str, correct: bool) -> str:
        """The full target text of a synthetic judgment; ``correct`` comes from the task's verifier."""
        return f"{self.rationale(problem, response)} verdict: {'yes' if correct else 'no'}"


def parse_verdict(text: str) -> float | None:
    """Reward in [0, 1] from a judge's text, or None when it says nothing parseable.

    The *last* ``verdict: yes|no`` wins (a judge may quote the format earlier); failing that, a last
    ``score: x`` in [0, 1] (or 0..10, rescaled). Anything else — empty, truncated, garbage — is None.
    """
    if not isinstance(text, str) or not text:
        return None
    verdicts = _VERDICT.findall(text)
    if verdicts:
        return 1.0 if verdicts[-1].lower() in _POSITIVE else 0.0
    scores = _SCORE.findall(text)
    if scores:
        try:
            value = float(scores[-1])
        except ValueError:
            return None
        if 0.0 <= value <= 1.0:
            return value
        if 1.0 < value <= 10.0:
            return value / 10.0
    return None


@dataclass
class Judgment:
    reward: float
    parsed: bool
    text: str
    tokens: int  # tokens the judge generated (the cost of this judgment)
    finish_reason: str = "stop"


@dataclass
class JudgeCounters:
    judged: int = 0
    unparsed: int = 0
    generated_tokens: int = 0
    examples_unparsed: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"judged": self.judged, "unparsed": self.unparsed, "generated_tokens": self.generated_tokens}


# (prompt_texts) -> list of (generated_text, n_tokens, finish_reason); provided by the loop from the engine.
GenerateFn = Callable[[Sequence[str]], list[tuple[str, int, str]]]


class GenRMJudge:
    """Template → generate with the judge's engine → parse. ``generate`` hides the engine so the runtime can
    batch, abort and resume judge sequences the same way as rollouts."""

    def __init__(
        self, generate: GenerateFn, template: JudgeTemplate | None = None, default_reward: float = 0.0
    ) -> None:
        self.generate = generate
        self.template = template or JudgeTemplate()
        self.default_reward = default_reward
        self.counters = JudgeCounters()

    def prompts(self, problems: Sequence[Problem], responses: Sequence[str]) -> list[str]:
        return [self.template.prompt(p.prompt, r) for p, r in zip(problems, responses, strict=True)]

    def score_texts(
        self, texts: Sequence[str], tokens: Sequence[int], finish: Sequence[str]
    ) -> list[Judgment]:
        """Parse already generated judge texts (the runtime generates them on reward replicas)."""
        out = []
        for text, n, fin in zip(texts, tokens, finish, strict=True):
            value = parse_verdict(text)
            self.counters.judged += 1
            self.counters.generated_tokens += int(n)
            if value is None:
                self.counters.unparsed += 1
                if len(self.counters.examples_unparsed) < 5:
                    self.counters.examples_unparsed.append(text[:80])
            out.append(
                Judgment(self.default_reward if value is None else value, value is not None, text, n, fin)
            )
        return out

    def judge(self, problems: Sequence[Problem], responses: Sequence[str]) -> list[Judgment]:
        gens = self.generate(self.prompts(problems, responses))
        return self.score_texts([g[0] for g in gens], [g[1] for g in gens], [g[2] for g in gens])
