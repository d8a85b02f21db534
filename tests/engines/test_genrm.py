"""GenRM: template, verdict parsing (robust to garbage), default reward and counters."""

from __future__ import annotations

import random
import string

import pytest

from pivotrl.engines.genrm import GenRMJudge, JudgeTemplate, parse_verdict
from pivotrl.tasks import Problem, get_task


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("a1= b3= c4= d-= verdict: yes", 1.0),
        ("ref 1 3 4 9. verdict: no", 0.0),
        ("ref 1 2. Verdict : YES", 1.0),
        ("verdict: yes ... on reflection verdict: no", 0.0),  # the last verdict wins
        ("the answer is incorrect. verdict=incorrect", 0.0),
        ("score: 0.75", 0.75),
        ("score: 8", 0.8),
        ("verdict: yesterday", None),  # a word boundary, not a prefix
        ("", None),
        ("ref 1 3 4", None),  # truncated before the verdict
        ("verdict:", None),
        ("score: 42", None),
    ],
)
def test_parse_verdict(text, want):
    assert parse_verdict(text) == want


def test_parse_never_raises_on_garbage():
    rng = random.Random(0)
    alphabet = string.printable + "verdict:yesno\x00\u00e9"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        value = parse_verdict(text)
        assert value is None or 0.0 <= value <= 1.0
    assert parse_verdict(None) is None  # type: ignore[arg-type]


def test_template_tags_items_and_the_critique_marks_each_one():
    t = JudgeTemplate()
    p = Problem("u", "sort 3 1 3=", "1 3 3")
    assert t.prompt(p.prompt, "1 3 3") == "sort 3 1 3=a1 b3 c3\n"
    assert t.prompt(p.prompt, " 1\n3   3 ") == "sort 3 1 3=a1 b3 c3\n"  # one line: never breaks the template
    assert t.judgment(p, "1 3 3", True) == "a1= b3= c3= d-= verdict: yes"
    assert t.judgment(p, "1 3", False) == "a1= b3= c3x d-= verdict: no"  # too short
    assert t.judgment(p, "1 3 3 9", False) == "a1= b3= c3= d-x verdict: no"  # runs long
    assert t.judgment(p, "3 1 3", False) == "a1x b3x c3= d-= verdict: no"
    assert parse_verdict(t.judgment(p, "x", False)) == 0.0
    long = JudgeTemplate(max_items=5)
    assert long.prompt("sort 1=", "1 " * 100) == "sort 1=a1 b1 c1 d1 e1\n"  # bounded


def test_rationale_length_grows_with_problem_size():
    """The critique re-derives the answer item by item, so the reward stage is as long-tailed as the task."""
    task = get_task("sort", {"median": 3, "sigma": 1.0, "max_size": 32})
    t = JudgeTemplate()
    problems = task.sample(400, seed=0)
    lengths = sorted(len(t.judgment(p, p.answer, True)) for p in problems)
    assert lengths[-1] >= 3 * lengths[len(lengths) // 2]


def test_garbage_judge_output_gets_default_reward_and_is_counted():
    outputs = iter(["ref 1 2. verdict: yes", "%%%%garbage", "", "ref 1 2. verdict: no", "verdict: maybe"])

    def fake_generate(prompts):
        return [(next(outputs), 7, "length") for _ in prompts]

    judge = GenRMJudge(fake_generate, default_reward=0.25)
    p = Problem("u", "sort 2 1=", "1 2")
    got = judge.judge([p] * 5, ["1 2", "2 1", "x", "1", "1 2"])
    assert [j.reward for j in got] == [1.0, 0.25, 0.25, 0.0, 0.25]
    assert [j.parsed for j in got] == [True, False, False, True, False]
    assert judge.counters.judged == 5 and judge.counters.unparsed == 3
    assert judge.counters.generated_tokens == 35
    assert judge.counters.examples_unparsed[0] == "%%%%garbage"


# ----------------------------------------------------------------------------------------------------
# A user's judge: template, configured verdict parsers, <think> stripping
# ----------------------------------------------------------------------------------------------------


def test_prompt_template_fills_the_three_placeholders_and_nothing_else():
    from pivotrl.engines.genrm import PromptTemplate
    from pivotrl.errors import UserError

    t = PromptTemplate("P={prompt} R={response} G={reference} {other} {{x}}")
    assert t.fill("p", "{prompt}", "g") == "P=p R={prompt} G=g {other} {{x}}"  # a value is never re-filled
    with pytest.raises(UserError, match=r"reward\.judge\.template: has no \{response\}"):
        PromptTemplate("{prompt} only")


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("The response is wrong. Verdict: INCORRECT", 0.0),
        ("verdict: correct", 1.0),
        ("Verdict: CORRECT ... on reflection Verdict: INCORRECT", 0.0),  # the last match wins
        ("Verdict: MAYBE", None),  # matched, but not a mapped word
        ("no verdict at all", None),
        ("", None),
    ],
)
def test_regex_verdict_maps_its_named_group_to_rewards(text, want):
    from pivotrl.engines.genrm import RegexParser, read_judgment

    parser = RegexParser(
        r"(?i)verdict:\s*(?P<verdict>correct|incorrect|maybe)", "verdict", {"CORRECT": 1.0, "incorrect": 0.0}
    )
    assert read_judgment(parser, text) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Score: 7", 0.75),
        ("score: 1", 0.0),
        ("score=9", 1.0),
        ("score: 3.5", 0.3125),
        ("score: 10", None),
        ("score: 0", None),
        ("score: -2", None),
        ("no score", None),
    ],
)
def test_score_range_maps_to_unit_interval_and_never_clamps(text, want):
    from pivotrl.engines.genrm import ScoreParser, read_judgment

    parser = ScoreParser(r"(?i)score\s*[:=]\s*(?P<score>-?\d+(?:\.\d+)?)", "score", 1.0, 9.0)
    assert read_judgment(parser, text) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("<think>verdict: no... hmm, verdict: yes?</think>\n\nverdict: no", 0.0),  # thoughts are skipped
        ("<think>\nverdict: yes\n</think>", None),  # thought a verdict, gave none
        ("<think>verdict: yes, writing more", None),  # truncated while thinking
        ("the prompt opened <think>; verdict: yes</think> verdict: yes", 1.0),
        ("reasoning without tags</think>verdict: yes", 1.0),  # template put <think> in the prompt
        ("verdict: yes", 1.0),  # no thinking at all
    ],
)
def test_a_thinking_judges_think_block_is_skipped_before_parsing(text, want):
    from pivotrl.engines.genrm import BuiltinParser, read_judgment

    assert read_judgment(BuiltinParser(), text) == want


def test_unparseable_judgments_with_a_configured_parser_get_the_default_and_are_counted():
    from pivotrl.config import load_config
    from pivotrl.engines.genrm import make_parser

    cfg = load_config(None, overrides=["reward.judge.verdict={kind: score, range: [0, 10]}"])
    outputs = iter(["<think>score: 10</think> score: 5", "score: 11", "<think>score: 3"])
    judge = GenRMJudge(
        lambda ps: [(next(outputs), 4, "stop") for _ in ps],
        default_reward=-1.0,
        parser=make_parser(cfg.reward.judge.verdict),
    )
    p = Problem("u", "q", "a")
    assert [j.reward for j in judge.judge([p] * 3, ["r"] * 3)] == [0.5, -1.0, -1.0]
    assert judge.counters.judged == 3 and judge.counters.unparsed == 2
