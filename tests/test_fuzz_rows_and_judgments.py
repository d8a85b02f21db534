"""Hostile dataset rows and judge texts through the public entry points (hypothesis).

A dataset file of any bytes either loads (its good rows; with `on_bad_row: skip` the bad ones counted), or
fails with one `UserError` line naming the file — never another exception — and the file is unchanged.
A judge's text of any content gives a reward in [0, 1] or None (unparseable: the default reward, counted);
never an exception and never a value outside [0, 1], for every kind of verdict parser."""

from __future__ import annotations

import hashlib
import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pivotrl.config import load_config
from pivotrl.engines.genrm import make_parser, read_judgment
from pivotrl.errors import UserError
from pivotrl.tasks import build_task

SETTINGS = settings(max_examples=200, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(allow_nan=True),
                   st.text(max_size=30), st.lists(st.integers(), max_size=3),
                   st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
FIELDS = st.sampled_from(["uid", "prompt", "answer", "meta", "src", "", "prompt\n", "id"])
GOOD = {"uid": "g0", "prompt": "what is 1+1?", "answer": "2"}


def row_text(row: object) -> bytes:
    return json.dumps(row).encode() if not isinstance(row, bytes) else row


ROWS = st.one_of(
    st.dictionaries(FIELDS, VALUES, max_size=5),
    st.fixed_dictionaries({"uid": VALUES, "prompt": VALUES, "answer": VALUES}),
    st.binary(max_size=40),
    st.sampled_from([b"\xff\xfe{}", b'{"uid": "x", "prompt": "\xc3", "answer": "1"}', b"[]", b"null",
                     b'{"uid": "g0", "prompt": "p", "answer": "a"}', b"{" * 50, b"\x00", b"   "]),
).map(row_text)


@SETTINGS
@given(lines=st.lists(ROWS, max_size=6), skip=st.booleans())
def test_any_dataset_rows_load_or_fail_in_one_line_naming_the_file(lines, skip, tmp_path):
    path = tmp_path / "rows.jsonl"
    raw = b"\n".join([json.dumps(GOOD).encode(), *lines]) + b"\n"
    path.write_bytes(raw)
    digest = hashlib.sha256(raw).hexdigest()
    sets = [f"task.dataset={path}", f"task.on_bad_row={'skip' if skip else 'error'}"]
    try:
        task = build_task(load_config(None, overrides=sets).task)
    except UserError as exc:
        msg = str(exc).strip()
        assert "\n" not in msg and "rows.jsonl" in msg, msg
    else:
        st_ = task.stats
        assert st_.rows >= 1 and st_.rows + st_.skipped <= raw.count(b"\n")  # a row per line at most
        if not skip:
            assert st_.skipped == 0
        for p in task.train:
            assert isinstance(p.prompt, str) and p.prompt and isinstance(p.answer, str)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


PARSERS = [
    [],
    ["reward.judge.verdict={kind: score, range: [1, 9]}"],
    ["reward.judge.verdict={kind: score, range: [-5, 5]}"],
    ["reward.judge.verdict={kind: regex, pattern: '(?i)verdict:\\s*(?P<verdict>\\w+)', "
     "rewards: {correct: 1.0, incorrect: 0.0, half: 0.5}}"],
]
TEXTS = st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(["verdict:", " yes", " no", "score:", " 7", " 1e309", " -3", " nan", " inf",
                              "<think>", "</think>", "correct", " incorrect", "\n", "9999999", " 5.5",
                              "score=", "half", "\x00", "VERDICT: YES"]), max_size=12).map("".join),
)


@settings(max_examples=400, derandomize=True, deadline=None)
@given(which=st.integers(0, len(PARSERS) - 1), text=TEXTS)
def test_any_judge_text_is_a_reward_in_range_or_unparseable(which, text):
    cfg = load_config(None, overrides=PARSERS[which])
    value = read_judgment(make_parser(cfg.reward.judge.verdict), text)
    assert value is None or (isinstance(value, float) and math.isfinite(value) and 0.0 <= value <= 1.0), value
