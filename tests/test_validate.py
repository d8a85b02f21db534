"""`pivotrl-pipeline validate CONFIG`: exit 0 with the rendered prompts and token counts on a good config,
exit 2 with one line on a bad one; never reads weights (the model directories here have none)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pivotrl.cli import main
from tests.tasks.chat_tokenizers import qwen_style_dir

EXAMPLE = Path(__file__).resolve().parents[1] / "configs/examples/jsonl-math.yaml"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A Hugging Face directory with config.json and a chat tokenizer but no weights at all."""
    d = qwen_style_dir(tmp_path_factory.mktemp("ckpt"))
    assert not list(d.glob("*.safetensors")) and not list(d.glob("*.bin"))
    return d


def dataset(tmp_path: Path, extra: list[str] = ()) -> Path:
    f = tmp_path / "d.jsonl"
    rows = [
        json.dumps({"uid": f"u{i}", "prompt": f"What is {i} + 2?", "answer": str(i + 2)}) for i in range(40)
    ]
    f.write_text("\n".join([*rows, *extra]) + "\n")
    return f


def run(capsys, *argv: str) -> tuple[int, str, list[str]]:
    rc = main(["validate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err.strip().splitlines()


def real_job(tmp_path: Path, checkpoint: Path, data: Path) -> list[str]:
    return [
        str(EXAMPLE),
        "--set",
        f"run.storage_root={tmp_path}",
        "--set",
        f"task.dataset={data}",
        "--set",
        "task.generate=null",
        "--set",
        f"models.policy.path={checkpoint}",
        "--set",
        f"models.genrm.path={checkpoint}",
        "--set",
        "reward.judge.system_prompt='You grade answers.'",
    ]


def test_a_good_config_prints_the_prompts_and_token_counts_without_weights(tmp_path, checkpoint, capsys):
    rc, out, err = run(capsys, *real_job(tmp_path, checkpoint, dataset(tmp_path)))
    assert rc == 0 and err == [], err
    assert "40 rows (0 bad rows skipped); train" in out and "held-out" in out
    assert f"models.policy: {checkpoint}: qwen2" in out and "with a chat template" in out
    assert "--- rollout prompt, uid" in out and "<|im_start|>system\nEnd with answer: N.<|im_end|>" in out
    assert "<|im_start|>system\nYou grade answers.<|im_end|>\n<|im_start|>user\nProblem: What is" in out
    assert re.search(r"tokens over \d+ rows: rollout prompt ≤ \d+ \(\+32 new\), judge prompt ≤ \d+", out)
    assert out.rstrip().endswith("ok")


def test_the_worked_example_validates_before_its_models_exist(tmp_path, capsys):
    data = tmp_path / "arith.jsonl"
    rc, out, err = run(
        capsys, str(EXAMPLE), "--set", f"run.storage_root={tmp_path}", "--set", f"task.dataset={data}"
    )
    assert rc == 0 and err == [], err
    assert data.is_file() and "2400 rows" in out and "bootstrap model (not built yet)" in out
    assert "<bos>S: End with answer: N.\nU: " in out
    assert not (tmp_path / "models").exists()  # nothing was trained


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ["--set", "task.on_bad_row=error", "BADROW"],
            "d.jsonl:41: field 'answer' must be a non-empty string",
        ),
        (
            ["--set", "models.policy.path=/no/such/model"],
            "models.policy.path: /no/such/model is not a Hugging",
        ),
        (["--set", "rollout.sampling.max_new_tokens=500"], "rollout.sampling.max_new_tokens: prompt"),
        (["--set", "reward.judge.template=missing.txt"], "reward.judge.template: 'missing.txt' is neither"),
        (["--set", "task.verifier=fuzzy"], "task.verifier: Input should be"),
    ],
)
def test_a_bad_config_is_one_line_and_exit_2(tmp_path, checkpoint, capsys, change, message):
    bad_row = "BADROW" in change
    data = dataset(tmp_path, ['{"uid": "x", "prompt": "p"}'] if bad_row else [])
    argv = [*real_job(tmp_path, checkpoint, data), *[c for c in change if c != "BADROW"]]
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and len(err) == 1 and message in err[0], err


def test_an_overlong_row_anywhere_in_the_file_fails_validate_and_the_run_before_any_model(
    tmp_path, checkpoint, capsys
):
    """The rows scanned for the longest prompts are the longest rows, not the first ones: a prompt over the
    policy's context in the last row of a file longer than `SCAN_ROWS` is found by `validate`, and by
    `submit` before its bootstrap or model load (exit 2, one line naming the row)."""
    from pivotrl.validate import SCAN_ROWS

    long_row = json.dumps({"uid": "too-long", "prompt": "x" * 40_000, "answer": "1"})
    data = tmp_path / "d.jsonl"
    rows = [json.dumps({"uid": f"u{i}", "prompt": f"What is {i} + 2?", "answer": str(i + 2)})
            for i in range(SCAN_ROWS + 50)]
    data.write_text("\n".join([*rows, long_row]) + "\n")
    job = real_job(tmp_path, checkpoint, data)
    rc, _, err = run(capsys, *job)
    assert rc == 2 and len(err) == 1 and "exceed the" in err[0] and "(row uid too-long" in err[0], err
    assert main(["submit", *job]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "(row uid too-long" in err[-1] and "Traceback" not in "\n".join(err), err
    assert not (tmp_path / "models").exists()
