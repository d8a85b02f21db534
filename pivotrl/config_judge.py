"""The `reward.judge` section: how a generative judge is prompted and how its verdict is read.

Why typed: a verdict parser is the one place a reward is made from text, so a pattern without its named
group or a score range upside down must be an error when the config loads, not a run of default rewards.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pivotrl.config_base import Section


class RegexVerdict(Section):
    """A verdict word found by a regex: its named group's text (case-folded) looked up in `rewards`; the
    last match in the judgment wins (a judge may quote the format before it answers)."""

    kind: Literal["regex"] = "regex"
    pattern: str = Field(..., min_length=1)
    group: str = "verdict"
    rewards: dict[str, float] = Field(..., min_length=1)

    @field_validator("rewards", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: Any) -> Any:
        """YAML reads a bare yes/no/true/on as a boolean: say so rather than "should be a string"."""
        if isinstance(value, dict):
            for key in value:
                if isinstance(key, bool):
                    raise ValueError(f"key {key} is a YAML boolean; quote the word, e.g. 'yes': 1.0")
        return value

    @model_validator(mode="after")
    def _check(self) -> RegexVerdict:
        check_pattern(self.pattern, self.group)
        return self


class ScoreVerdict(Section):
    """A numeric score found by a regex and mapped linearly from `range` to [0, 1]; a score outside the
    range is unparseable (never clamped: a judge on a different scale must be noticed)."""

    kind: Literal["score"] = "score"
    pattern: str = r"score\s*[:=]\s*(?P<score>-?\d+(?:\.\d+)?)"
    group: str = "score"
    range: tuple[float, float] = (0.0, 10.0)

    @model_validator(mode="after")
    def _check(self) -> ScoreVerdict:
        check_pattern(self.pattern, self.group)
        if not self.range[0] < self.range[1]:
            raise ValueError(f"range {list(self.range)}: the low end must be below the high end")
        return self


def check_pattern(pattern: str, group: str) -> None:
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"pattern {pattern!r}: not a regex ({exc})") from None
    if group not in compiled.groupindex:
        raise ValueError(f"pattern {pattern!r}: has no named group (?P<{group}>...)")


class JudgeConfig(Section):
    """How the judge is prompted and how its verdict is read. Defaults: the built-in tagged template of
    the synthetic tasks and its `verdict: yes|no` parser."""

    template: str | None = Field(
        None,
        description="a prompt with {prompt} {response} {reference}, inline or a file path; None: built-in "
        "(tagged for the synthetic tasks, a plain problem/reference/response prompt for a dataset)",
    )
    system_prompt: str | None = Field(None, description="a system message (needs a chat template)")
    chat_template: Literal["auto", "none"] = Field(
        "auto", description="auto: render with the judge tokenizer's chat template when it has one"
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra variables of the chat template, e.g. {enable_thinking: true}"
    )
    verdict: RegexVerdict | ScoreVerdict | None = Field(
        None, discriminator="kind", description="None: the built-in `verdict: yes|no` / `score: x` parser"
    )
