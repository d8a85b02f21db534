import json

import numpy as np
import pytest

from pivotrl.errors import UserError
from pivotrl.tasks import SortTask, SumTask, get_task, load_dataset


@pytest.mark.parametrize("task", [SortTask(), SumTask()])
def test_reference_answers_verify_and_wrong_ones_do_not(task):
    for p in task.sample(200, seed=1):
        assert task.verify(p, p.answer)
        assert task.verify(p, "  " + p.answer + " ")
        assert not task.verify(p, p.answer + " 99999")
        assert not task.verify(p, "")


def test_sampling_is_deterministic_and_seed_dependent():
    t = SortTask()
    assert t.sample(50, seed=3) == t.sample(50, seed=3)
    assert t.sample(50, seed=3) != t.sample(50, seed=4)


@pytest.mark.parametrize("name", ["sort", "sum"])
def test_default_response_lengths_are_long_tailed(name):
    problems = get_task(name).sample(20_000, seed=0)
    lengths = np.array([len(p.answer) for p in problems])
    assert np.percentile(lengths, 99) / np.median(lengths) >= 5


def test_sum_checks_only_the_final_answer():
    t = SumTask()
    p = t.make([3, 5, 2], uid="x")
    assert p.answer == "3 8 10"
    assert t.verify(p, "3 9 10")
    assert not t.verify(p, "3 8 11")


def test_unknown_task_and_option_are_user_errors():
    with pytest.raises(UserError, match="task.name"):
        get_task("nope")
    with pytest.raises(UserError, match="task.options"):
        get_task("sort", {"medain": 3})


def test_jsonl_bad_row_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n" + '{"prompt": "a"}\n' + "{oops\n")
    with pytest.raises(UserError, match=r"d\.jsonl:2: field 'answer'"):
        load_dataset(f)
    loaded = load_dataset(f, on_bad_row="skip")
    assert len(loaded.problems) == 1 and loaded.skipped == 2
    assert "d.jsonl:3: invalid JSON" in loaded.skipped_examples[1]


def test_parquet_round_trip_and_bad_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["p1", "p2", ""], "answer": ["a1", "a2", "a3"]}), f)
    with pytest.raises(UserError, match="row 3: field 'prompt'"):
        load_dataset(f)
    loaded = load_dataset(f, on_bad_row="skip")
    assert [p.uid for p in loaded.problems] == ["d-1", "d-2"] and loaded.skipped == 1


def test_missing_and_unknown_format(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_dataset(tmp_path / "none.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="unknown dataset format"):
        load_dataset(tmp_path / "x.csv")
