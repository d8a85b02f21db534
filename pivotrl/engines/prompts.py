"""What the engines see: rollout and judge prompts rendered to token ids, and how a judgment is read.

Why one object: the rollout engine, the judge engine, the bootstrap's SFT data, held-out evaluation and
`pivotrl-pipeline validate` must show a model exactly the same ids for the same problem, or a model is
trained on one format and asked in another. A prompt goes through the tokenizer's chat template when it
has one (``chat_template: auto``) and is then encoded *without* adding special tokens (the template writes
its own ``<bos>``, as `transformers`' ``apply_chat_template(tokenize=True)`` does); without a template it
is encoded as plain text with the tokenizer's special tokens (today's synthetic tasks, unchanged).

The judge's user message is the config's ``reward.judge.template`` filled with ``{prompt}`` ``{response}``
``{reference}``; without one, the built-in tagged template for the synthetic tasks (unchanged) and
`DATASET_JUDGE_TEMPLATE` for a dataset.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from pivotrl.engines.checkpoints import char_ids, char_text, is_builtin_tokenizer
from pivotrl.engines.genrm import (
    BuiltinParser,
    JudgeTemplate,
    PromptTemplate,
    VerdictParser,
    load_template,
    make_parser,
    read_judgment,
)
from pivotrl.errors import UserError
from pivotrl.tasks.base import Problem

DATASET_JUDGE_TEMPLATE = (
    "Problem: {prompt}\nReference answer: {reference}\nResponse: {response}\n"
    "Is the response's final answer correct?"
)


@dataclass(frozen=True)
class ChatSide:
    """How one model's prompts are rendered: its tokenizer, whether its chat template is used, the system
    message and extra template variables."""

    tokenizer: Any
    chat: bool = False
    system_prompt: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def text(self, user: str) -> str:
        """The prompt text exactly as encoded (the chat template's output, or `user` itself)."""
        if not self.chat:
            return user
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": user})
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )

    @functools.cached_property
    def builtin(self) -> bool:
        """The tokenizer is the built-in character tokenizer's (`checkpoints.is_builtin_tokenizer`): ids
        and text are then a lookup per character. Why: the driver encodes every judge prompt and decodes
        every response, and the tokenizer's call cost it a tenth of its CPU in the demo's RL phase, CPU
        that the two devices' processes share on a small machine."""
        return is_builtin_tokenizer(self.tokenizer)

    def ids(self, user: str) -> list[int]:
        if not self.chat:
            if self.builtin:
                return char_ids([user], self.tokenizer, bos=True)[0]
            return list(self.tokenizer(user)["input_ids"])
        if self.builtin:
            return char_ids([self.text(user)], self.tokenizer, bos=False)[0]
        return list(self.tokenizer(self.text(user), add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        if self.builtin:
            return char_text(ids)
        eos = self.tokenizer.eos_token_id
        return self.tokenizer.decode([i for i in ids if i != eos], skip_special_tokens=True)


def chat_side(field_name: str, tokenizer: Any, mode: str, system: str | None, kwargs: dict) -> ChatSide:
    """A `ChatSide` from config values; a system prompt with no chat template to put it in is an error."""
    chat = mode == "auto" and bool(getattr(tokenizer, "chat_template", None))
    if system and not chat:
        why = "chat_template is none" if mode == "none" else "the tokenizer has no chat template"
        raise UserError(f"{field_name}.system_prompt: needs a chat template ({why})")
    if kwargs and not chat:
        raise UserError(f"{field_name}.chat_template_kwargs: needs a chat template")
    return ChatSide(tokenizer, chat, system, dict(kwargs))


@dataclass(frozen=True)
class PromptRenderer:
    """Rollout and judge prompts of a run, and its verdict parser."""

    policy: ChatSide
    judge: ChatSide
    template: JudgeTemplate | PromptTemplate = field(default_factory=JudgeTemplate)
    parser: VerdictParser = field(default_factory=BuiltinParser)

    @classmethod
    def from_config(cls, cfg: Any, policy_tokenizer: Any, judge_tokenizer: Any) -> PromptRenderer:
        ro, jd = cfg.rollout, cfg.reward.judge
        if jd.template is not None:
            template: JudgeTemplate | PromptTemplate = load_template(jd.template)
        elif cfg.task.dataset is not None:
            template = PromptTemplate(DATASET_JUDGE_TEMPLATE)
        else:
            template = JudgeTemplate()
        return cls(
            policy=chat_side(
                "rollout", policy_tokenizer, ro.chat_template, ro.system_prompt, ro.chat_template_kwargs
            ),
            judge=chat_side(
                "reward.judge", judge_tokenizer, jd.chat_template, jd.system_prompt, jd.chat_template_kwargs
            ),
            template=template,
            parser=make_parser(jd.verdict),
        )

    def judge_user(self, problem: Problem, response: str) -> str:
        if isinstance(self.template, JudgeTemplate):
            return self.template.prompt(problem.prompt, response)
        return self.template.fill(problem.prompt, response, problem.answer)

    def rollout_text(self, problem: Problem) -> str:
        return self.policy.text(problem.prompt)

    def rollout_ids(self, problem: Problem) -> list[int]:
        return self.policy.ids(problem.prompt)

    def judge_text(self, problem: Problem, response: str) -> str:
        return self.judge.text(self.judge_user(problem, response))

    def judge_ids(self, problem: Problem, response: str) -> list[int]:
        return self.judge.ids(self.judge_user(problem, response))

    def read(self, judgment: str) -> float | None:
        """The reward a judgment gives (``<think>`` skipped), None when unparseable."""
        return read_judgment(self.parser, judgment)
