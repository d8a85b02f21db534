"""User errors at the command line: one line on stderr, exit 2, no traceback, nothing written."""

from __future__ import annotations

import pytest

from pivotrl import cli


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["submit"], "the following arguments are required: config"),
        (["submit", "x.yaml", "--workers", "abc"], "invalid int value: 'abc'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["submit", "missing.yaml"], "missing.yaml: config file not found"),
        (["submit", "missing.yaml", "--resume", "../up"], "missing.yaml: config file not found"),
        (["frobnicate"], "unknown command 'frobnicate'"),
    ],
)
def test_usage_and_input_errors_are_one_line(argv, expected, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # nothing created


def test_resume_of_a_run_that_is_not_there_names_it(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(f"run: {{storage_root: {tmp_path / 'st'}}}\n")
    assert cli.main(["submit", "c.yaml", "--resume", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--resume nope: no run nope" in err and err.count("\n") == 1
    assert not (tmp_path / "st").exists()


@pytest.mark.parametrize("command", ["submit", "bootstrap"])
def test_a_storage_root_that_cannot_be_created_fails_before_any_work(command, capsys, tmp_path, monkeypatch):
    """`submit` and `bootstrap` create the storage root first: one that cannot be (here under a file) is one
    line naming `run.storage_root`, before a bootstrap trains or a run starts (it was a traceback after
    minutes of training, or at the run directory's creation)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    (tmp_path / "c.yaml").write_text(f"run: {{storage_root: {tmp_path / 'afile' / 'root'}}}\n")
    assert cli.main([command, "c.yaml"]) == 2
    err = capsys.readouterr().err
    assert "run.storage_root: cannot create" in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "c.yaml"]


@pytest.mark.parametrize("command", ["validate", "submit", "bootstrap"])
@pytest.mark.parametrize("field, name", [("dataset", "yes"), ("dataset", "rows.parquet"),
                                         ("dataset", "a\\nb"), ("eval_dataset", "held.txt")])
def test_a_dataset_in_no_known_format_is_refused_before_a_generator_writes_it(
        command, field, name, capsys, tmp_path, monkeypatch):
    """A generated dataset is JSONL, and any dataset is JSONL or parquet: a name that is neither fails when
    the config loads (a fuzzed `task.dataset: yes` had the generator write 425 KB to ./yes, and then the
    loader refused the suffix)."""
    monkeypatch.chdir(tmp_path)
    extra = "eval_fraction: 0.0, " if field == "eval_dataset" else ""
    task = (f'{{name: arith, dataset: "rows.jsonl", {field}: "{name}", {extra}generate: arith-word-problems}}'
            if field != "dataset" else f'{{name: arith, dataset: "{name}", generate: arith-word-problems}}')
    (tmp_path / "c.yaml").write_text(f"run: {{storage_root: {tmp_path / 'st'}}}\ntask: {task}\n")
    assert cli.main([command, "c.yaml"]) == 2
    err = capsys.readouterr().err
    assert f"task.{field}" in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]  # nothing generated, no storage root


@pytest.mark.parametrize("command", ["validate", "submit", "bootstrap"])
@pytest.mark.parametrize("yaml_text, field", [
    ('rollout: {system_prompt: "End \\ud800 here"}', "rollout.system_prompt"),
    ('reward: {judge: {template: "{prompt} \\udfff {response}"}}', "reward.judge.template"),
    ('"ke\\ud800y": 1', "'ke\\ud800y'"),
])
def test_a_lone_surrogate_in_a_config_is_one_line_naming_its_field(command, yaml_text, field, capsys,
                                                                   tmp_path, monkeypatch):
    """YAML's escapes can write a lone surrogate, a str no tokenizer, hash or file encodes: it was a
    tokenizer's traceback in `validate`."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(f"run: {{storage_root: {tmp_path / 'st'}}}\n{yaml_text}\n")
    assert cli.main([command, "c.yaml"]) == 2
    err = capsys.readouterr().err
    assert f"{field}: not text (a lone surrogate" in err and err.count("\n") == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


@pytest.mark.parametrize("on_bad_row", ["error", "skip"])
def test_a_dataset_row_with_a_lone_surrogate_is_a_bad_row(on_bad_row, capsys, tmp_path, monkeypatch):
    """JSON's `\\ud800` escape is valid JSON and not text: the row is bad (file:line, or skipped), where it
    was a tokenizer's traceback."""
    import json

    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1), "uid": f"u{i}"} for i in range(40)]
    rows[3]["prompt"] = "What is \ud800 3+1?"
    rows[5]["uid"] = "u\udfff"
    rows[7]["solution"] = "3 + 1 = \ud801"  # metadata the bootstrap policy trains on
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.yaml").write_text(
        f"run: {{storage_root: {tmp_path / 'st'}}}\n"
        "task: {name: arith, dataset: d.jsonl, eval_fraction: 0.1, verifier: math,"
        f" on_bad_row: {on_bad_row}, prompts_per_iteration: 4, group_size: 2, eval_prompts: 4}}\n")
    code = cli.main(["validate", "c.yaml"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if on_bad_row == "error":
        assert code == 2 and "d.jsonl:4: field 'prompt' is not text" in err and err.count("\n") == 1, err
    else:
        assert code == 0, err
