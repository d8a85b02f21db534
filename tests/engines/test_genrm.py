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
