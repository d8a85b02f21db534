"""benchmarks.gpu_smoke: the CPU skip path, the part isolation, and each part's logic on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_smoke
from benchmarks import gpu_smoke_parts as parts

ROOT = Path(__file__).resolve().parents[1]


def test_without_cuda_it_exits_0_with_skipped_and_a_reason(tmp_path):
    out = tmp_path / "smoke.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device even on a GPU box
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_smoke", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["skipped"] is True and "CUDA" in report["reason"]
    assert report["could_not_run"]


def test_one_failing_part_does_not_lose_the_others(tmp_path, monkeypatch):
    def broken(device, work):
        raise RuntimeError("boom")

    def fine(device, work):
        return {"ok": True, "train_step_ok": True}

    monkeypatch.setattr(gpu_smoke, "PARTS", [("engine", broken, 10.0), ("train", fine, 10.0)])
    report = gpu_smoke.run("cpu", tmp_path)
    assert report["parts"]["engine"]["error"] == "RuntimeError: boom"
    assert report["train_step_ok"] is True and report["failed_parts"] == ["engine"]
    assert report["engine_ratio_vs_hf_generate"] is None
    for key in ("abort_resume_identical", "pipeline_iterations", "could_not_run", "environment"):
        assert key in report
    assert any("multi-GPU" in c for c in report["could_not_run"])


def test_out_of_budget_parts_are_reported_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_smoke, "BUDGET_S", 1.0)
    monkeypatch.setattr(gpu_smoke, "PARTS", [("pipeline", lambda d, w: {"ok": True}, 100.0)])
    report = gpu_smoke.run("cpu", tmp_path)
    assert report["parts"]["pipeline"]["ok"] is False and "pipeline: out of time" in report["could_not_run"]


def test_engine_part_on_cpu(tmp_path):
    r = parts.engine_vs_hf("cpu", tmp_path, size="debug", n=4, new=8)
    assert r["ok"] and r["engine_ratio_vs_hf_generate"] > 0 and r["hf_generate_tokens_per_s"] > 0


def test_abort_resume_part_on_cpu(tmp_path):
    r = parts.abort_resume("cpu", tmp_path)
    assert all(n > 16 for n in r["sequence_lengths"].values())  # past the initial cache
    assert r["abort_resume_identical"] is True


def test_gps_and_train_parts_on_cpu(tmp_path):
    g = parts.gps_device_tier("cpu", tmp_path)
    assert g["ok"] and g["hit_served_from_tier"] and g["oversized_not_cached"]
    t = parts.train_step("cpu", tmp_path)
    assert t["train_step_ok"] and t["weights_changed"]
    tg = parts.train_group_step("cpu", tmp_path)
    assert tg["ok"] and tg["backend"] == "gloo" and tg["readback_equal"], tg


@pytest.mark.slow
def test_pipeline_part_on_cpu(tmp_path):
    r = parts.pipeline("cpu", tmp_path, iterations=1)
    assert r["ok"] and r["pipeline_iterations"] == 1 and r["pipeline_shifts"] >= 1
