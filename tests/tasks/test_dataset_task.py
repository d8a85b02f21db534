"""Dataset tasks: wiring through the task factory, bad rows, the held-out split, epoch-wise draws."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from pivotrl import grpo
from pivotrl.config import load_config
from pivotrl.errors import UserError
from pivotrl.tasks import DatasetTask, build_task, load_dataset_task
from pivotrl.tasks.arith import word_problems, write_jsonl
from pivotrl.tasks.dataset_task import held_out_by_uid


def write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def rows(n: int, start: int = 0) -> list[dict]:
    return [
        {"uid": f"u{i}", "prompt": f"what is {i}+1?", "answer": str(i + 1), "src": "t"}
        for i in range(start, n)
    ]


def task_of(tmp_path, sets: list[str]):
    return build_task(load_config(None, overrides=sets).task)


def test_task_dataset_is_wired_through_the_factory_with_metadata(tmp_path):
    f = write(tmp_path / "d.jsonl", rows(50))
    task = task_of(tmp_path, [f"task.dataset={f}", "task.verifier=math"])
    assert isinstance(task, DatasetTask) and task.stats.rows == 50 and task.stats.train == 50
    p = task.train[0]
    assert (p.uid, p.prompt, p.answer, p.meta) == ("u0", "what is 0+1?", "1", {"src": "t"})
    assert task.verify(p, "so the answer is 1.") and not task.verify(p, "answer: 2")
    assert grpo.held_out_problems(task, 10) == []  # no held-out split asked for: nothing to measure


def test_bad_rows_error_naming_file_and_line_or_are_skipped_and_counted(tmp_path):
    f = write(tmp_path / "d.jsonl", [*rows(3), '{"prompt": "x"}', "not json", rows(1)[0]])
    with pytest.raises(UserError, match=r"d\.jsonl:4: field 'answer'"):
        task_of(tmp_path, [f"task.dataset={f}"])
    task = task_of(tmp_path, [f"task.dataset={f}", "task.on_bad_row=skip"])
    assert task.stats.rows == 3 and task.stats.skipped == 3  # missing field, invalid JSON, repeated uid
    assert "d.jsonl:6: duplicate uid 'u0'" in task.stats.skipped_examples[2]
    assert "3 bad rows skipped" in task.stats.line()


def test_a_repeated_uid_is_a_bad_row(tmp_path):
    f = write(tmp_path / "d.jsonl", [*rows(2), rows(2)[1]])
    with pytest.raises(UserError, match=r"d\.jsonl:3: duplicate uid 'u1'"):
        task_of(tmp_path, [f"task.dataset={f}"])


def test_split_by_uid_is_deterministic_disjoint_and_order_free(tmp_path):
    data = rows(2000)
    a = load_dataset_task(write(tmp_path / "a.jsonl", data), eval_fraction=0.1)
    b = load_dataset_task(write(tmp_path / "b.jsonl", data[::-1] + rows(2100, 2000)), eval_fraction=0.1)
    held_a, train_a = {p.uid for p in a.held_out}, {p.uid for p in a.train}
    assert not held_a & train_a and len(held_a) + len(train_a) == 2000
    assert 150 < len(held_a) < 250  # ≈ 10 %
    held_b = {p.uid for p in b.held_out}
    assert held_a <= held_b and not held_b & {p.uid for p in b.train}  # reordering/appending keeps the split
    assert all(held_out_by_uid(u, 0.1) for u in held_a)


def test_eval_dataset_rows_are_never_trained_on(tmp_path):
    train = write(tmp_path / "t.jsonl", rows(30))
    ev = write(tmp_path / "e.jsonl", rows(35, 25))  # u25..u29 are in both files
    task = task_of(tmp_path, [f"task.dataset={train}", f"task.eval_dataset={ev}", "task.verifier=exact"])
    assert {p.uid for p in task.held_out} == {f"u{i}" for i in range(25, 35)}
    assert {p.uid for p in task.train} == {f"u{i}" for i in range(25)}
    assert task.stats.overlap_dropped == 5 and "5 train rows dropped" in task.stats.line()
    assert [p.uid for p in grpo.held_out_problems(task, 4)] == ["u25", "u26", "u27", "u28"]


def test_verifier_none_measures_nothing(tmp_path):
    f = write(tmp_path / "d.jsonl", rows(40))
    task = task_of(tmp_path, [f"task.dataset={f}", "task.verifier=none", "task.eval_fraction=0.5"])
    assert not task.measurable and task.held_out and grpo.held_out_problems(task, 10) == []


def test_prompts_are_drawn_without_replacement_per_epoch_deterministically(tmp_path):
    task = load_dataset_task(write(tmp_path / "d.jsonl", rows(10)))
    n = 4  # 10 rows, 4 per iteration: epochs straddle iterations
    draws = [grpo.train_problems(task, n, run_seed=7, iteration=i) for i in range(5)]
    stream = [p.uid for d in draws for p in d]
    assert Counter(stream[:10]) == Counter(f"u{i}" for i in range(10))  # epoch 0: each row once
    assert Counter(stream[10:20]) == Counter(f"u{i}" for i in range(10))  # epoch 1: each row once
    assert stream[:10] != stream[10:20]  # a fresh order per epoch
    assert [p.uid for p in grpo.train_problems(task, n, 7, 3)] == [p.uid for p in draws[3]]  # (seed, it)
    assert [p.uid for p in grpo.train_problems(task, n, 8, 0)] != [p.uid for p in draws[0]]
    assert task.epochs(n, 4) == pytest.approx(2.0)


def test_generator_writes_the_example_dataset_on_first_use(tmp_path):
    f = tmp_path / "sub" / "arith.jsonl"
    sets = [f"task.dataset={f}", "task.generate=arith-word-problems", "task.eval_fraction=0.1"]
    task = task_of(tmp_path, [*sets, "task.verifier=math"])
    assert f.is_file() and task.stats.rows == 2400 and task.stats.held_out > 150
    assert all(task.verify(p, p.meta["solution"]) for p in task.train[:200])
    assert word_problems(50, seed=1) == word_problems(50, seed=1) != word_problems(50, seed=2)
    assert all(r["prompt"].isascii() for r in word_problems(500))
    assert write_jsonl(tmp_path / "again.jsonl", 2400).read_bytes() == f.read_bytes()  # deterministic


def test_a_missing_dataset_is_one_line(tmp_path):
    with pytest.raises(UserError, match="dataset file not found"):
        task_of(tmp_path, [f"task.dataset={tmp_path / 'none.jsonl'}"])


def test_a_row_that_is_not_utf8_is_one_bad_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"".join((json.dumps(r) + "\n").encode() for r in rows(2)) + b'{"prompt": "\xff"}\n')
    with pytest.raises(UserError, match=r"d\.jsonl:3: not UTF-8"):
        task_of(tmp_path, [f"task.dataset={path}"])
    task = task_of(tmp_path, [f"task.dataset={path}", "task.on_bad_row=skip"])
    assert task.stats.rows == 2 and task.stats.skipped == 1
