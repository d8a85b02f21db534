"""Prompt rendering: ours against `transformers`' `apply_chat_template` on the same tokenizer; the judge
template; today's raw prompts and tagged judge template unchanged for the synthetic tasks."""

from __future__ import annotations

import pytest

from pivotrl.config import load_config
from pivotrl.engines.checkpoints import TINY_CHAT_TEMPLATE, build_tokenizer, load_tokenizer, save_hf
from pivotrl.engines.genrm import JudgeTemplate
from pivotrl.engines.prompts import PromptRenderer
from pivotrl.errors import UserError
from pivotrl.tasks import Problem
from tests.tasks.chat_tokenizers import qwen_style_dir

PROBLEM = Problem("u1", "Ana has 12 apples and gets 7 more. How many apples does Ana have now?", "19")
TEMPLATE = "Problem: {prompt}\nReference: {reference}\nResponse: {response}\nIs the final answer right?"


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    return load_tokenizer(qwen_style_dir(tmp_path_factory.mktemp("qwen")))


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    """The tiny models' tokenizer after a save/load round trip (its chat template is kept)."""
    from pivotrl.engines.checkpoints import init_state_dict, make_config

    config = make_config("debug")
    d = save_hf(
        init_state_dict(config), config, build_tokenizer(TINY_CHAT_TEMPLATE), tmp_path_factory.mktemp("t")
    )
    tok = load_tokenizer(d)
    assert tok.chat_template == TINY_CHAT_TEMPLATE
    return tok


def reference_ids(tok, user: str, system: str | None = None, **kwargs) -> list[int]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    out = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
    )
    return list(out["input_ids"])


def renderer(sets: list[str], policy_tok, judge_tok) -> PromptRenderer:
    return PromptRenderer.from_config(load_config(None, overrides=sets), policy_tok, judge_tok)


@pytest.mark.parametrize("which", ["tiny", "qwen"])
@pytest.mark.parametrize("system", [None, "End with answer: N."])
def test_rollout_prompt_equals_apply_chat_template(which, system, tiny_tok, qwen_tok):
    tok = tiny_tok if which == "tiny" else qwen_tok
    sets = [f"rollout.system_prompt='{system}'"] if system else []
    r = renderer(sets, tok, tok)
    ids = r.rollout_ids(PROBLEM)
    assert ids == reference_ids(tok, PROBLEM.prompt, system)
    assert tok.decode(ids, skip_special_tokens=False) == r.rollout_text(PROBLEM)
    assert ids.count(tok.bos_token_id) == (1 if which == "tiny" else 0)  # the template's own, never doubled


def test_template_variables_reach_the_chat_template(qwen_tok):
    r = renderer(["rollout.chat_template_kwargs={enable_thinking: false}"], qwen_tok, qwen_tok)
    ids = r.rollout_ids(PROBLEM)
    assert ids == reference_ids(qwen_tok, PROBLEM.prompt, enable_thinking=False)
    assert r.rollout_text(PROBLEM).endswith("<think>\n\n</think>\n\n")


def test_judge_prompt_is_the_template_in_the_judge_tokenizers_chat_template(tiny_tok, qwen_tok):
    inline = '"' + TEMPLATE.replace("\n", "\\n") + '"'  # a YAML double-quoted string, as --set takes it
    sets = [f"reward.judge.template={inline}", "reward.judge.system_prompt='You grade answers.'"]
    r = renderer(sets, tiny_tok, qwen_tok)
    user = TEMPLATE.replace("{prompt}", PROBLEM.prompt).replace("{reference}", "19")
    user = user.replace("{response}", "x = 19")
    assert r.judge_ids(PROBLEM, "x = 19") == reference_ids(qwen_tok, user, "You grade answers.")
    assert r.rollout_ids(PROBLEM) == reference_ids(tiny_tok, PROBLEM.prompt)  # each model its own tokenizer


def test_judge_template_from_a_file_fills_placeholders_once(tmp_path, tiny_tok):
    f = tmp_path / "judge.txt"
    f.write_text('Q: {prompt}\nGold: {reference}\nGot: {response}\nJSON like {"verdict": "yes"} please')
    r = renderer([f"reward.judge.template={f}"], tiny_tok, tiny_tok)
    text = r.judge_text(PROBLEM, "I say {reference}")
    assert 'Got: I say {reference}\nJSON like {"verdict": "yes"} please' in text  # never re-filled
    assert "Gold: 19\n" in text and text.startswith("<bos>U: Q: Ana has 12")


def test_synthetic_tasks_keep_raw_prompts_and_the_tagged_judge_template():
    tok = build_tokenizer()  # the bootstrap models of the synthetic tasks: no chat template
    r = renderer([], tok, tok)
    p = Problem("s", "sort 3 1 2=", "1 2 3")
    assert r.rollout_ids(p) == list(tok(p.prompt)["input_ids"])
    assert r.judge_ids(p, "1 2 3") == list(tok(JudgeTemplate().prompt(p.prompt, "1 2 3"))["input_ids"])
    assert r.read("a1= b2= c3= d-= verdict: yes") == 1.0


def test_chat_template_none_and_misplaced_system_prompts(tiny_tok):
    r = renderer(["rollout.chat_template=none"], tiny_tok, tiny_tok)
    assert r.rollout_ids(PROBLEM) == list(tiny_tok(PROBLEM.prompt)["input_ids"])
    with pytest.raises(
        UserError, match=r"rollout\.system_prompt: needs a chat template \(chat_template is none"
    ):
        renderer(["rollout.chat_template=none", "rollout.system_prompt=hi"], tiny_tok, tiny_tok)
    with pytest.raises(UserError, match=r"reward\.judge\.system_prompt: .*has no chat template"):
        renderer(["reward.judge.system_prompt=hi"], tiny_tok, build_tokenizer())
    with pytest.raises(UserError, match=r"reward\.judge\.template: .*neither a file nor a template"):
        renderer(["reward.judge.template=no-such-file.txt"], tiny_tok, tiny_tok)
    with pytest.raises(UserError, match=r"no \{response\} placeholder"):
        renderer(["reward.judge.template='{prompt} only'"], tiny_tok, tiny_tok)
