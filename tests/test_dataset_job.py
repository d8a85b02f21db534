"""A dataset job end to end on tiny models: the example's generated JSONL, bootstrap models whose tokenizers
carry a chat template, rollout and judge prompts rendered through them, a regex verdict, the math verifier
measuring (never rewarding), epochs in the metrics rows. The full worked example (`submit` on the real
config) is the slow test at the bottom."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pivotrl.engines.checkpoints import load_tokenizer
from pivotrl.engines.prompts import PromptRenderer
from pivotrl.loop import run_loop
from pivotrl.tasks import build_task
from tests.tiny import tiny_bootstrap

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = '"Q: {prompt}\\nGold: {reference}\\nGot: {response}\\nRight?"'
VERDICT = "{kind: regex, pattern: 'verdict: (?P<verdict>yes|no)', rewards: {'yes': 1, 'no': 0}}"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("job")
    sets = [
        "task.options={}",
        f"task.dataset={root / 'arith.jsonl'}",
        "task.generate=arith-word-problems",
        "task.eval_fraction=0.1",
        "task.verifier=math",
        "task.eval_prompts=8",
        "rollout.system_prompt='Answer: N.'",
        "rollout.sampling.max_new_tokens=16",
        f"reward.judge.template={TEMPLATE}",
        f"reward.judge.verdict={VERDICT}",
        "reward.sampling.max_new_tokens=16",
    ]
    return tiny_bootstrap(root, sets)


def test_a_dataset_job_runs_with_chat_templates_and_a_configured_judge(job):
    cfg, boot = job
    for d in (boot.policy_dir, boot.judge_dir):
        assert (Path(d) / "chat_template.jinja").is_file()  # the tokenizer carries its template
    tok = load_tokenizer(boot.policy_dir)
    renderer = PromptRenderer.from_config(cfg, tok, load_tokenizer(boot.judge_dir))
    task = build_task(cfg.task)
    held = {p.uid for p in task.held_out}
    seen = []
    res = run_loop(
        cfg, boot.policy_dir, boot.judge_dir, iterations=2, on_iteration=lambda it, row: seen.append(it)
    )
    rows = res.history
    assert [r["iteration"] for r in rows] == [0, 1]
    assert rows[1]["epochs"] == pytest.approx(2 * cfg.task.prompts_per_iteration / len(task.train))
    assert all(r["judged"] == 16 and 0 <= r["judge_unparsed"] <= 16 for r in rows)
    samples = [s for it in seen for s in it.samples]
    assert not {s.problem.uid for s in samples} & held  # held-out rows are never drawn for training
    for s in samples:
        assert s.prompt_ids == renderer.rollout_ids(s.problem)
        assert tok.decode(s.prompt_ids, skip_special_tokens=False).startswith("<bos>S: Answer: N.\nU: ")
        assert s.data["correct"] == task.verify(s.problem, s.response_text)  # measured, and only measured
        if s.data["judge_parsed"]:
            assert s.reward in (0.0, 1.0)
        else:
            assert s.reward == cfg.reward.default_reward
    assert 0.0 <= res.initial_accuracy <= 1.0


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a fresh bootstrap: ~170 s of CPU in two processes, more on a busy machine
def test_the_worked_example_submits_for_three_iterations(tmp_path):
    """The acceptance command on a fresh storage root (bootstrap included: ~100 s of CPU)."""
    cmd = [
        sys.executable,
        "-m",
        "pivotrl.cli",
        "submit",
        "configs/examples/jsonl-math.yaml",
        "--quiet",
        "--set",
        "run.iterations=3",
        "--set",
        f"run.storage_root={tmp_path}",
        "--set",
        f"task.dataset={tmp_path / 'arith.jsonl'}",
        "--set",
        "cluster.dashboard_address=null",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done in" in proc.stdout and "3 iterations" in proc.stdout
    assert "train 2" in proc.stdout and "held-out" in proc.stdout
