"""Bounded staleness in the simulator (`workload.max_staleness`): core's `StalenessBound` decides when an
iteration starts, train items wait for every earlier iteration, and nothing is lost."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pivotrl.sim.compare import all_splits, best_static, compare, simulate
from pivotrl.sim.config import load_sim_config

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "configs/sim/paper-32gpu.yaml"
SMALL = ["cluster.devices=8", "workload.prompts_per_iteration=16", "workload.group_size=4",
         "workload.iterations=3", "search.exhaustive_max_splits=8", "search.top_k=2",
         "search.max_simulations=4"]
MODES = [("colocated", None), ("shiftable", None), ("disaggregated", {"rollout": 2, "reward": 4, "train": 2})]


def _check_order(iters: list[dict[str, float]], k: int) -> None:
    """The staleness rule, read back from the stage times of every iteration."""
    for j in range(1, len(iters)):
        cur, prev = iters[j], iters[j - 1]
        start = cur["start_s"]
        assert start >= prev["start_s"] + prev["rollout_s"] - 1e-9  # j-1 finished generating first
        if j - k - 1 >= 0:  # every iteration before j-k had trained
            older = iters[j - k - 1]
            assert start >= older["start_s"] + older["total_s"] - 1e-9
        if k == 0:
            assert start == pytest.approx(prev["start_s"] + prev["total_s"])
        # optimizer steps in iteration order
        assert cur["start_s"] + cur["total_s"] >= prev["start_s"] + prev["total_s"] - 1e-9


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("mode,split", MODES)
def test_every_paradigm_conserves_work_and_keeps_the_bound(mode: str, split: dict[str, int] | None,
                                                           k: int) -> None:
    cfg = load_sim_config(PAPER, [*SMALL, f"workload.max_staleness={k}"])
    r = simulate(cfg, mode, split)
    assert r.finished and r.conservation["conserved"], r.conservation
    _check_order(r.iterations, k)


def test_staleness_overlaps_iterations_and_shortens_the_run() -> None:
    on = load_sim_config(PAPER, [*SMALL, "workload.max_staleness=0"])
    off = load_sim_config(PAPER, [*SMALL, "workload.max_staleness=1"])
    a, b = simulate(on, "disaggregated", MODES[2][1]), simulate(off, "disaggregated", MODES[2][1])
    # with k = 1 iteration 1 starts before iteration 0 has trained
    assert b.iterations[1]["start_s"] < b.iterations[0]["total_s"]
    assert b.makespan_s < a.makespan_s


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(0, 2), seed=st.integers(0, 10_000), devices=st.integers(3, 10),
       group=st.integers(1, 6), prompts=st.integers(1, 12), sigma=st.floats(0.0, 1.5))
def test_random_small_workloads_keep_the_rule(k: int, seed: int, devices: int, group: int, prompts: int,
                                              sigma: float) -> None:
    cfg = load_sim_config(PAPER, [
        f"cluster.devices={max(devices, 2)}", f"workload.prompts_per_iteration={prompts}",
        f"workload.group_size={group}", "workload.iterations=3", f"workload.max_staleness={k}",
        f"seed={seed}", f"workload.response_len.sigma={sigma}"])
    r = simulate(cfg, "shiftable", record=False)
    assert r.finished and r.conservation["conserved"], r.conservation
    _check_order(r.iterations, k)


def test_compare_reports_the_staleness_keys() -> None:
    cfg = load_sim_config(PAPER, [*SMALL, "workload.max_staleness=1"])
    rep = compare(cfg)
    tps = rep["tokens_per_s_per_device"]
    assert rep["max_staleness"] == 1
    assert rep["ratio_vs_best_static_same_staleness"] == pytest.approx(tps["shiftable"] / tps["best_static"])
    assert rep["ratio_vs_colocated_onpolicy"] == pytest.approx(tps["shiftable"] / tps["colocated_onpolicy"])
    # with staleness the critical-path bound no longer binds: the tighter bound is the fluid bound
    assert tps["tighter_bound"] == tps["fluid_bound"]
    assert rep["fraction_of_tighter_bound"] == pytest.approx(rep["fraction_of_fluid_bound"])
    assert "ratio_vs_colocated_onpolicy" not in compare(load_sim_config(PAPER, SMALL))


@pytest.mark.parametrize("k", [0, 1, 2])
def test_core_is_told_the_runs_staleness_bound(k: int) -> None:
    """The simulator's and the runtime's controller configs carry the bound
    (`ControllerConfig.max_staleness`): with k ≥ 1 the shiftable policy plans the rollouts' tail knowing
    the next rollouts start when these end."""
    from pivotrl.config import load_config
    from pivotrl.run import controller_config as runtime_config
    from pivotrl.sim.driver import controller_config as sim_config

    assert sim_config(load_sim_config(PAPER, [*SMALL, f"workload.max_staleness={k}"])).max_staleness == k
    run_cfg = load_config(ROOT / "configs/quickstart.yaml", overrides=[f"run.max_staleness={k}"])
    assert runtime_config(run_cfg).max_staleness == k


def test_a_negative_staleness_bound_is_refused_by_core() -> None:
    from pivotrl.core.types import ControllerConfig

    with pytest.raises(ValueError, match="max_staleness"):
        ControllerConfig(max_staleness=-1)


def test_the_static_baseline_is_the_best_split_over_the_whole_run() -> None:
    """With staleness a static split's throughput comes from the overlap of iterations, which one
    iteration cannot show: on 6 devices at k = 1 a one-iteration search keeps 2 / 2 / 2, and the whole run
    is faster on 3 / 2 / 1. The default search simulates every split on the whole run, so the baseline is
    the fastest split the runs are measured on."""
    over = ["cluster.devices=6", "workload.prompts_per_iteration=16", "workload.group_size=4",
            "workload.iterations=3", "workload.max_staleness=1"]
    cfg = load_sim_config(PAPER, over)
    final, search = best_static(cfg)
    assert search["method"] == "exhaustive"
    fastest = max(simulate(cfg, "disaggregated", s, record=False).tokens_per_s_per_device
                  for s in all_splits(cfg))
    assert final.tokens_per_s_per_device == pytest.approx(fastest)
    one, _ = best_static(load_sim_config(PAPER, [*over, "search.iterations=1"]))
    assert one.tokens_per_s_per_device < final.tokens_per_s_per_device


def test_with_staleness_the_next_rollouts_leave_the_older_iterations_split() -> None:
    """The paper reconstruction at k = 1: the next iteration's rollouts take from the older iteration's
    judge and train only what they hold above the iteration's split (`shiftable.stale_keeps`). Without
    that, iteration 1's rollouts took 15 devices from them and gave 12 back one by one: 95 replica shifts
    and 1.176x the static async split 7 / 12 / 13 (the best split of an exhaustive search); with it 65 and
    1.197x."""
    cfg = load_sim_config(PAPER, ["workload.max_staleness=1"])
    shiftable = simulate(cfg, "shiftable", record=False)
    static = simulate(cfg, "disaggregated", {"rollout": 7, "reward": 12, "train": 13}, record=False)
    assert shiftable.conservation["conserved"]
    assert len(shiftable.shifts) <= 75
    assert shiftable.tokens_per_s_per_device >= 1.19 * static.tokens_per_s_per_device
