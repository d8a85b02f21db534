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
