"""Kill-and-resume end to end (slow): the driver SIGKILLed at named fault points and at random moments, each
time resumed with `submit --resume latest`; the final run trains every iteration once and ends with a
policy bit-identical to an uninterrupted run's (`--workers 1`)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_kill_and_resume_ends_bit_identical(tmp_path):
    from benchmarks import resume

    out = tmp_path / "resume.json"
    rc = resume.main(["--quick", "--storage", str(tmp_path / "bench"), "--json", str(out), "--seed", "1"])
    r = json.loads(out.read_text())
    assert rc == 0 and r["resumed_ok"]
    assert r["kills"] >= 5
    assert r["iterations_repeated"] == 0 and r["iterations_skipped"] == 0
    assert r["final_policy_bit_identical"], r["final_policy_max_abs_diff"]


@pytest.mark.slow
def test_kill_and_resume_with_two_workers_ends_within_fp_tolerance(tmp_path):
    """Two replicas' gradient sums may be reduced in another order after a resume: equal within 1e-5."""
    from benchmarks import resume

    out = tmp_path / "resume2.json"
    rc = resume.main(["--quick", "--storage", str(tmp_path / "bench"), "--json", str(out), "--seed", "2",
                      "--workers", "2", "--tolerance", "1e-5"])
    r = json.loads(out.read_text())
    assert rc == 0 and r["resumed_ok"] and r["kills"] >= 5
    assert r["iterations_repeated"] == 0 and r["iterations_skipped"] == 0
    assert r["final_policy_within_tolerance"], r["final_policy_max_abs_diff"]


@pytest.mark.slow
def test_kill_and_resume_with_one_stale_iteration_ends_bit_identical(tmp_path):
    """`run.max_staleness: 1`: a checkpoint is committed while the next iteration generates, and a kill
    finds two iterations in flight; the resumed run regenerates the uncommitted one at the same version."""
    from benchmarks import resume

    out = tmp_path / "resume-k1.json"
    rc = resume.main(["--quick", "--storage", str(tmp_path / "bench"), "--json", str(out), "--seed", "3",
                      "--max-staleness", "1"])
    r = json.loads(out.read_text())
    assert rc == 0 and r["resumed_ok"] and r["kills"] >= 5 and r["max_staleness"] == 1
    assert r["iterations_repeated"] == 0 and r["iterations_skipped"] == 0
    assert r["final_policy_bit_identical"], r["final_policy_max_abs_diff"]
