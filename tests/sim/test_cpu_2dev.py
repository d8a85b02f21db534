"""The 2-device CPU runtime case (issue 7) in simulation: 2 devices, 3 roles, the quickstart workload."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivotrl.sim.compare import all_groupings, all_splits, compare, simulate
from pivotrl.sim.config import load_sim_config

CPU2 = Path(__file__).resolve().parents[2] / "configs/sim/cpu-2dev.yaml"


def test_two_devices_get_static_groupings_not_splits() -> None:
    cfg = load_sim_config(CPU2)
    assert all_splits(cfg) == []
    groups = all_groupings(cfg)
    assert {"rollout+train": 1, "reward": 1} in groups and len(groups) == 3
    r = simulate(cfg, "grouped", {"rollout+train": 1, "reward": 1}, iterations=1)
    assert r.finished and r.conservation["conserved"]


@pytest.mark.parametrize("seed", [0, 1])
def test_shiftable_beats_colocated_and_the_best_static_grouping(seed: int) -> None:
    cfg = load_sim_config(CPU2, [f"seed={seed}", "workload.iterations=2"])
    rep = compare(cfg)
    runs = rep.pop("_results")
    assert all(r.finished and r.conservation["conserved"] for r in runs.values())
    assert rep["ratio_vs_colocated"] >= 1.0, rep["tokens_per_s_per_device"]
    assert rep["ratio_vs_best_static"] >= 1.0, rep["tokens_per_s_per_device"]
    # one device at a time: some shift decisions move a single device while the other keeps working
    shifts = runs["shiftable"].shifts
    per_decision: dict[int, int] = {}
    for s in shifts:
        per_decision[s["decision"]] = per_decision.get(s["decision"], 0) + len(s["devices"])
    assert 1 in per_decision.values()


def test_plan_cli_lists_groupings(capsys: pytest.CaptureFixture[str]) -> None:
    from pivotrl.cli import main

    assert main(["plan", str(CPU2), "--set", "workload.iterations=1"]) == 0
    out = capsys.readouterr().out
    assert "reward:1 | rollout+train:1" in out and "role groupings" in out


def test_driver_passes_the_profile_trust_to_core() -> None:
    from pivotrl.sim.driver import controller_config

    cfg = load_sim_config(CPU2)
    assert controller_config(cfg).prior_weight == cfg.scheduler.prior_weight == 1e9
    cfg = load_sim_config(CPU2, ["scheduler.prior_weight=2"])
    assert controller_config(cfg).prior_weight == 2.0


def test_driver_passes_the_shift_lock_multiple_to_core() -> None:
    from pivotrl.sim.driver import controller_config

    assert controller_config(load_sim_config(CPU2)).cooldown_shift_multiple == 3.0
    cfg = load_sim_config(CPU2, ["scheduler.cooldown_shift_multiple=0"])
    assert controller_config(cfg).cooldown_shift_multiple == 0.0
