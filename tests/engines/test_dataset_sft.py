"""The bootstrap's SFT data for a dataset task: rendered prompts, verifier labels, a parser that reads
what the judge is taught to write, and a cache key that follows the data."""

from __future__ import annotations

import random

import pytest

from pivotrl.config import load_config
from pivotrl.engines import dataset_sft as ds
from pivotrl.engines.bootstrap import _settings, model_dir
from pivotrl.engines.prompts import PromptRenderer
from pivotrl.errors import UserError
from pivotrl.tasks import build_task
from pivotrl.tasks.arith import write_jsonl

VERDICT = "{kind: regex, pattern: 'verdict: (?P<verdict>yes|no)', rewards: {'yes': 1, 'no': 0}}"


def cfg_for(tmp_path, *sets):
    f = tmp_path / "arith.jsonl"
    if not f.exists():
        write_jsonl(f, rows=300)
    base = [
        f"run.storage_root={tmp_path}",
        f"task.dataset={f}",
        "task.verifier=math",
        "task.eval_fraction=0.1",
    ]
    return load_config(None, overrides=[*base, f"reward.judge.verdict={VERDICT}", *sets])


def test_corrupted_results_are_wrong_everywhere_they_are_stated():
    rng = random.Random(0)
    for good in ["12 + 7 = 19. answer: 19", "4 / 2 = 2. answer: 2", "19", "x = 3.5"]:
        bad = ds.corrupt_final(good, rng)
        stated = [
            w.strip(".") for w in bad.split("=", 1)[-1].split() if w.strip(".").replace(".", "").isdigit()
        ]
        assert bad != good and len(set(stated)) == 1, (good, bad)  # the working agrees with the answer


def test_judge_data_is_labelled_by_the_verifier_and_rendered_like_rl(tmp_path):
    cfg = cfg_for(tmp_path)
    task = build_task(cfg.task)
    _, tok = ds.sft_data(cfg, "policy", cfg.train.sft, seed=0)
    renderer = PromptRenderer.from_config(cfg, tok, tok)
    problems = task.sample(200, seed=1)
    data = ds.judge_data(task, renderer, problems, int(tok.eos_token_id), seed=3)
    verdicts = [tok.decode(t[:-1]).rsplit("verdict: ", 1)[1] for _, t in data]
    assert 0.35 < verdicts.count("yes") / len(verdicts) < 0.65
    for (prompt, _), p in zip(data[:50], problems[:50], strict=True):  # the ids RL will show the judge
        shown = tok.decode(prompt, skip_special_tokens=False)
        response = shown.split("\nResponse: ", 1)[1].split("\nIs the response", 1)[0]
        assert prompt == renderer.judge_ids(p, response)
    for (prompt, target), p in zip(data[:20], problems[:20], strict=True):
        assert tok.decode(prompt, skip_special_tokens=False).startswith("<bos>U: ")
        assert target[-1] == tok.eos_token_id and f"reference {p.answer}." in tok.decode(target[:-1])
    held = {p.uid for p in task.held_out}
    assert not {p.uid for p in problems} & held  # SFT never sees the held-out rows


def test_a_parser_that_cannot_read_the_bootstrap_judge_is_an_error(tmp_path):
    cfg = cfg_for(tmp_path, "reward.judge.verdict={kind: score, range: [0, 10]}")
    with pytest.raises(UserError, match=r"reward\.judge\.verdict: the bootstrap judge writes"):
        ds.sft_data(cfg, "genrm", cfg.reward.sft, seed=0)
    cfg = cfg_for(tmp_path, "task.verifier=none")
    with pytest.raises(UserError, match=r"task\.verifier: none gives the bootstrap judge nothing"):
        ds.sft_data(cfg, "genrm", cfg.reward.sft, seed=0)


def test_the_cache_key_follows_the_dataset_and_synthetic_keys_are_unchanged(tmp_path):
    cfg = cfg_for(tmp_path)
    before = model_dir(cfg, "genrm")
    (tmp_path / "arith.jsonl").write_text((tmp_path / "arith.jsonl").read_text().replace("Ana", "Ada"))
    assert model_dir(cfg, "genrm") != before
    assert model_dir(cfg_for(tmp_path, "rollout.system_prompt=hi"), "policy") != model_dir(cfg, "policy")
    synthetic = load_config(None, overrides=[f"run.storage_root={tmp_path}"])
    assert "dataset" not in _settings(synthetic, "policy") and "dataset" not in _settings(synthetic, "genrm")
