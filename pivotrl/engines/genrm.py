"""Generative reward model: an LLM judge that *writes* a critique and a verdict, parsed from its text.

Why generative: the judge's critiques are long and their length varies with the problem, which makes the
reward stage expensive and long-tailed — the load that role shifting exists to absorb. Our judge first
re-derives the reference answer item by item, marking each item of the response against it (the
critique's length grows with the problem size), and then writes ``verdict: yes`` or ``verdict: no``.
A GPU-scale judge (Qwen3-30B-A3B) uses the same template idea with a longer natural-language critique.

A user's judge (a real checkpoint on a real dataset) is shown a `PromptTemplate` instead — any text with
``{prompt}`` ``{response}`` ``{reference}`` — and its verdict is read by a configured `RegexParser` (a named
group mapped to rewards) or `ScoreParser` (a numeric score range mapped to [0, 1]). A thinking judge's
``<think>…</think>`` is skipped first (`strip_think`): a verdict it mulls over is not its verdict.

The parser never raises: unparseable text gets a configurable default reward and is counted, because a
judge that rambles must not crash an RL run.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pivotrl.errors import UserError
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


# ----------------------------------------------------------------------------------------------------
# A user's judge: a placeholder template and a configured verdict parser
# ----------------------------------------------------------------------------------------------------

PLACEHOLDERS = ("{prompt}", "{response}", "{reference}")


@dataclass(frozen=True)
class PromptTemplate:
    """A judge prompt with ``{prompt}`` ``{response}`` ``{reference}`` placeholders. Only those three are
    replaced (no `str.format`), so a template may quote JSON or LaTeX braces as they are."""

    text: str

    def __post_init__(self) -> None:
        if "{response}" not in self.text:
            raise UserError("reward.judge.template: has no {response} placeholder (the judge must see it)")

    def fill(self, prompt: str, response: str, reference: str) -> str:
        values = {"{prompt}": prompt, "{response}": response, "{reference}": reference}
        pattern = re.compile("|".join(re.escape(k) for k in PLACEHOLDERS))
        return pattern.sub(lambda m: values[m.group()], self.text)  # one pass: a value is never re-filled


def load_template(value: str) -> PromptTemplate:
    """`reward.judge.template`: a template with placeholders inline, or the path of a file holding one."""
    if not any(k in value for k in PLACEHOLDERS):
        p = Path(value)
        if "\n" in value or not p.is_file():
            raise UserError(
                f"reward.judge.template: {value[:60]!r} is neither a file nor a template with "
                "{prompt} {response} {reference} placeholders"
            )
        try:
            value = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"reward.judge.template: {p}: cannot read ({exc})") from None
    return PromptTemplate(value)


def strip_think(text: str) -> str | None:
    """The judgment after a thinking judge's ``</think>``; None while it is still thinking (an opened,
    never closed ``<think>``: a truncated judge has given no verdict, whatever its thoughts say)."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        return None
    return text


class VerdictParser(Protocol):
    def parse(self, text: str) -> float | None: ...


@dataclass(frozen=True)
class BuiltinParser:
    """Today's `parse_verdict`: ``verdict: yes|no``, else ``score: x``."""

    def parse(self, text: str) -> float | None:
        return parse_verdict(text)


@dataclass(frozen=True)
class RegexParser:
    """The last match of `pattern`; its `group` (case-folded, stripped) looked up in `rewards`."""

    pattern: str
    group: str
    rewards: Mapping[str, float]

    def parse(self, text: str) -> float | None:
        matches = list(re.finditer(self.pattern, text))
        if not matches:
            return None
        word = (matches[-1].group(self.group) or "").strip().lower()
        table = {k.strip().lower(): float(v) for k, v in self.rewards.items()}
        return table.get(word)


@dataclass(frozen=True)
class ScoreParser:
    """The last match of `pattern`; its `group` as a number in [low, high] mapped linearly to [0, 1]. A
    score outside the range is None (unparseable), not clamped."""

    pattern: str
    group: str
    low: float
    high: float

    def parse(self, text: str) -> float | None:
        matches = list(re.finditer(self.pattern, text))
        if not matches:
            return None
        try:
            value = float(matches[-1].group(self.group))
        except (TypeError, ValueError):
            return None
        if not self.low <= value <= self.high:
            return None
        return (value - self.low) / (self.high - self.low)


def make_parser(verdict: Any) -> VerdictParser:
    """The parser of a `reward.judge.verdict` section (`RegexVerdict`, `ScoreVerdict` or None)."""
    if verdict is None:
        return BuiltinParser()
    if verdict.kind == "regex":
        return RegexParser(verdict.pattern, verdict.group, dict(verdict.rewards))
    return ScoreParser(verdict.pattern, verdict.group, float(verdict.range[0]), float(verdict.range[1]))


def read_judgment(parser: VerdictParser, text: str) -> float | None:
    """A judgment's reward: `<think>` skipped, then `parser`; None when unparseable. Never raises."""
    if not isinstance(text, str) or not text:
        return None
    shown = strip_think(text)
    return None if shown is None else parser.parse(shown)


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
        self,
        generate: GenerateFn,
        template: JudgeTemplate | None = None,
        default_reward: float = 0.0,
        parser: VerdictParser | None = None,
    ) -> None:
        self.generate = generate
        self.template = template or JudgeTemplate()
        self.default_reward = default_reward
        self.parser = parser or BuiltinParser()
        self.counters = JudgeCounters()

    def prompts(self, problems: Sequence[Problem], responses: Sequence[str]) -> list[str]:
        return [self.template.prompt(p.prompt, r) for p, r in zip(problems, responses, strict=True)]

    def score_texts(
        self, texts: Sequence[str], tokens: Sequence[int], finish: Sequence[str]
    ) -> list[Judgment]:
        """Parse already generated judge texts (the runtime generates them on reward replicas)."""
        out = []
        for text, n, fin in zip(texts, tokens, finish, strict=True):
            value = read_judgment(self.parser, text)
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
