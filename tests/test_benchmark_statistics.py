"""The figures the benchmarks report: a throughput over a window of iterations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.paradigms import window_throughput


def test_alternating_iterations_are_weighed_by_their_time() -> None:
    """Short and long iterations alternate (staleness 1): three short of 13k tokens in 1 s and two long of
    32k in 2 s on 2 devices are 103k tokens in 7 s, 7,357 tokens/s/device, where the median of the
    per-iteration figures (6,500) picks a short one."""
    tokens = [13_000.0, 32_000.0, 13_000.0, 32_000.0, 13_000.0]
    seconds = [1.0, 2.0, 1.0, 2.0, 1.0]
    per_device = [t / s / 2 for t, s in zip(tokens, seconds, strict=True)]
    assert window_throughput(tokens, per_device) == pytest.approx(103_000 / 7 / 2)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.floats(1.0, 1e6), st.floats(0.01, 100.0)), min_size=1, max_size=30),
       devices=st.integers(1, 64))
def test_the_window_is_total_tokens_over_total_time_and_lies_between_its_iterations(
        rows: list[tuple[float, float]], devices: int) -> None:
    tokens = [t for t, _ in rows]
    per_device = [t / s / devices for t, s in rows]
    got = window_throughput(tokens, per_device)
    assert got == pytest.approx(sum(tokens) / sum(s for _, s in rows) / devices, rel=1e-9)
    assert min(per_device) * (1 - 1e-9) <= got <= max(per_device) * (1 + 1e-9)


def test_an_untimed_iteration_adds_neither_tokens_nor_time() -> None:
    assert window_throughput([100.0, 5_000.0], [0.0, 50.0]) == pytest.approx(50.0)
    assert window_throughput([100.0], [0.0]) == 0.0


class _Run:
    """A run's measured figures, as `benchmarks.fidelity` reads them (the first iteration is warm-up)."""

    def __init__(self, rows: list[dict]) -> None:
        warm_up = {"tokens_train": 10**9, "shifts": 999,
                   "device_time": {"d0": {"train": 1.0, "shifting": 99.0}}}
        self.iterations = [warm_up, *rows]


def _row(train_s: tuple[float, float], tokens: int, shifts: int = 0, shifting_s: float = 0.0) -> dict:
    return {"tokens_train": tokens, "shifts": shifts,
            "device_time": {"d0": {"train": train_s[0], "flush": 0.0, "shifting": shifting_s},
                            "d1": {"train": train_s[1], "shifting": 0.0}}}


def test_train_rate_is_trained_tokens_over_train_busy_seconds_after_warm_up() -> None:
    from benchmarks.fidelity import train_rate

    runs = [_Run([_row((1.0, 0.0), 5_000), _row((0.5, 0.5), 4_000)]), _Run([_row((2.0, 0.0), 9_000)])]
    assert train_rate(runs) == pytest.approx(18_000 / 4.0)
    assert train_rate([]) == 0.0


def test_shift_overhead_is_shifting_time_per_shift_beyond_its_phases() -> None:
    """Six shifts in 0.09 device-s are 15 ms each; with 4 ms of phases, 11 ms is the overhead. Never
    negative, 0 without shifts."""
    from benchmarks.fidelity import shift_overhead

    runs = [_Run([_row((0.0, 0.0), 0, shifts=4, shifting_s=0.06), _row((0.0, 0.0), 0, shifts=2,
                                                                      shifting_s=0.03)])]
    assert shift_overhead(runs, [0.004, 0.004]) == pytest.approx(0.011)
    assert shift_overhead(runs, [0.05]) == 0.0
    assert shift_overhead([_Run([_row((0.0, 0.0), 0)])], [0.004]) == 0.0


def test_control_cores_are_the_drivers_cpu_beside_its_optimizer_step_over_the_window() -> None:
    """Rows 1-2 of each run are measured (0 is the warm-up, the last the cool-down); each row's CPU runs
    from the previous completion, so the warm-up's own CPU and the cool-down's are left out."""
    from benchmarks.fidelity import control_cores

    def run(cpu: list[float], apply: list[float], elapsed: list[float]) -> _Run:
        r = _Run([])
        r.iterations = [{"driver_cpu_s": c, "train_apply_s": a, "elapsed_s": e}
                        for c, a, e in zip(cpu, apply, elapsed, strict=True)]
        return r

    runs = [run([9.0, 0.5, 0.3, 9.0], [0.0, 0.1, 0.1, 0.0], [5.0, 7.0, 8.0, 20.0]),
            run([9.0, 0.6, 9.0], [0.0, 0.0, 0.0], [1.0, 3.0, 30.0])]
    assert control_cores(runs) == pytest.approx((0.4 + 0.2 + 0.6) / (2.0 + 1.0 + 2.0))
    assert control_cores([run([1.0, 2.0], [0.0, 0.0], [1.0, 2.0])]) == 0.0  # nothing measured
    old = _Run([_row((1.0, 0.0), 5), _row((1.0, 0.0), 5)])  # rows written before the driver's CPU
    assert control_cores([old]) == 0.0


@pytest.mark.parametrize("quick", [True, False])
def test_the_paradigms_window_is_whole_staleness_periods(quick: bool) -> None:
    """With staleness k, iterations alternate with period k + 1; a window of 5 at k = 1 read 1-3 % low."""
    from benchmarks.paradigms import STALENESS_RUN, measured_iterations

    assert measured_iterations(quick) % (STALENESS_RUN + 1) == 0


def test_an_odd_window_of_alternating_iterations_miscounts_and_a_whole_period_does_not() -> None:
    """A steady k = 1 pipeline: each completion-to-completion window alternates a short iteration (most of
    its tokens processed before it opens) and a long one. Over whole periods the window reads the steady
    rate; with one short window more it reads low, as the real rounds did."""
    short, long_ = (10_000.0, 1.0), (35_000.0, 2.75)
    steady = (short[0] + long_[0]) / (short[1] + long_[1]) / 2

    def window(rows: list[tuple[float, float]]) -> float:
        return window_throughput([t for t, _ in rows], [t / s / 2 for t, s in rows])

    assert window([short, long_] * 2) == pytest.approx(steady)
    assert window([short, long_] * 2 + [short]) < 0.99 * steady  # 0.980


def test_the_window_leaves_out_the_warm_up_and_the_cool_down_and_their_shifts() -> None:
    """The last iteration runs with nothing after it (no next rollouts in its tail), so it is not measured;
    nor are its shifts, which come last in the run's shift list."""
    from types import SimpleNamespace

    from benchmarks.paradigms import COOLDOWN, WARMUP, summarise, window_rows

    n = WARMUP + 4 + COOLDOWN

    def row(i: int) -> dict:
        return {"iteration": i, "tokens_per_s_per_device": 100.0 + i, "tokens_rollout": 10 * i,
                "tokens_reward": 0, "tokens_train": 0, "seconds": 1.0, "shifts": i,
                **{f"alloc_{k}": 0.2 for k in ("rollout", "reward", "train", "shifting", "idle")}}

    iterations = [row(i) for i in range(n)]
    assert [r["iteration"] for r in window_rows(iterations)] == list(range(WARMUP, n - COOLDOWN))
    assert [r["iteration"] for r in window_rows(iterations, lead=1)] == list(range(WARMUP - 1, n - COOLDOWN))
    shifts = [{"iteration": i, "timings": {}, "total": float(i)} for i in range(n) for _ in range(i)]
    out = summarise(SimpleNamespace(iterations=iterations, shifts=shifts, wall_s=1.0))
    measured = range(WARMUP, n - COOLDOWN)
    assert out["tokens_each"] == [10 * i for i in measured]
    assert out["shifts"] == sum(measured)
    assert out["mean_shift_s"]["total"] == pytest.approx(sum(i * i for i in measured) / sum(measured))


def _cfg() -> object:
    """The few fields of a pipeline config that `benchmarks.fidelity.profile` reads."""
    from types import SimpleNamespace as N

    engine = N(max_batch=8, kv_budget_tokens=4096)
    return N(task=N(prompts_per_iteration=2, group_size=2), run=N(iterations=4),
             rollout=N(engine=engine, sampling=N(max_new_tokens=32)),
             reward=N(engine=engine, sampling=N(max_new_tokens=16)),
             train=N(micro_batch=2, optimizer_owner="train"),
             scheduler=N(tick_s=0.05, horizon_s=1.0, hysteresis=0.05, cooldown_s=0.1))


class _Measured(_Run):
    """A run whose every measured row steps at `speed` times the base costs (a = 0.01 s, b = 0.001 s,
    prefill 1,000 tokens/s, train 5,000 tokens per train-busy second), with one shift of `shift_s`."""

    def __init__(self, speed: float, shift_s: float, devices: int = 2) -> None:
        fits = {role: {"a_s": 0.01 * speed, "b_s": 0.001 * speed, "prefill_tokens_per_s": 1000.0 / speed}
                for role in ("rollout", "reward")}
        row = {"tokens_train": 5_000, "shifts": 1, "train_apply_s": 0.02 * speed, "train_steps": 1,
               "driver_cpu_s": 0.1, "elapsed_s": 0.0, "barrier_before_s": 0.05 * speed,
               "step_fits": fits,
               "lengths": {"prompt": [4, 5], "response": [10, 12], "judge_prompt": [20, 23], "judge": [3, 4]},
               "device_time": {"d0": {"train": speed * 0.5, "flush": 0.0, "shifting": shift_s},
                               "d1": {"train": speed * 0.5, "shifting": 0.0}}}
        super().__init__([])
        self.iterations = [{**row, "elapsed_s": float(i)} for i in range(4)]  # warm-up, 2 measured, cool-down
        self.shifts = [{"role": "rollout", "total": shift_s, "timings": {"fetch": 0.0, "load": shift_s}}]


def test_a_runs_own_profile_has_its_speeds_and_the_pooled_one_their_median() -> None:
    """Two configurations, one run each at the base speed and one run at 1.5x its costs. The pooled
    profile takes medians and rates over all the runs; the run's own profile has that run's step fits,
    prefill rate, shift time and barrier, and its configuration's train rate scaled by the run's speed
    against its configuration's runs."""
    from benchmarks.fidelity import profile

    fast, slow = _Measured(1.0, 0.2), _Measured(1.5, 0.4)
    other = _Measured(1.0, 0.2)
    by_config = {"colocated": [fast, slow], "static a|b": [other]}
    pooled = profile(_cfg(), by_config, ["colocated", "static a|b"])["cost"]
    own = profile(_cfg(), by_config, ["colocated", "static a|b"], own=("colocated", slow))["cost"]
    assert pooled["rollout"]["decode"]["a_s"] == pytest.approx(0.01)  # the median of 6 measured rows
    assert own["rollout"]["decode"]["a_s"] == pytest.approx(0.015)
    assert own["reward"]["decode"]["b_s"] == pytest.approx(0.0015)
    assert own["rollout"]["prefill_tokens_per_s"] == pytest.approx(1000 / 1.5)
    assert own["iteration"]["optimizer_step_s"] == pytest.approx(0.03)
    assert own["rollout"]["init_s"] > pooled["rollout"]["init_s"]
    # its steps ran beside the control plane already: no second slowdown for it
    assert pooled["control_cores"] > 0 and own["control_cores"] == 0.0
    # two measured rows a run: the static run trains at 5,000 tokens per busy second; colocated's runs
    # at 20,000 in 5 s together, the slow one 10,000 in 3 s: its own rate is the static one's x 3,333 / 4,000
    assert pooled["train"]["tokens_per_s_per_device"] == pytest.approx(5_000)
    assert own["train"]["tokens_per_s_per_device"] == pytest.approx(5_000 * (10_000 / 3.0) / (20_000 / 5.0))
    # the run's own profile is the pooled one where the run is the only one
    alone = {"colocated": [fast]}
    mine = profile(_cfg(), alone, ["colocated"], own=("colocated", fast))
    assert mine == {**profile(_cfg(), alone, ["colocated"]), "cost": {**mine["cost"]}}
    assert {**mine["cost"], "control_cores": 0.0} == {**profile(_cfg(), alone, ["colocated"])["cost"],
                                                     "control_cores": 0.0}


@settings(max_examples=100, deadline=None)
@given(a=st.floats(1e-4, 5e-3), b=st.floats(1e-5, 1e-3), per_token=st.floats(1e-6, 1e-4),
       batches=st.lists(st.integers(1, 64), min_size=2, max_size=40, unique=True))
def test_the_profiles_step_line_runs_through_every_step_of_the_window(a, b, per_token, batches) -> None:
    """Rows carry the controller's cumulative `step_totals`. The warm-up's steps (before the window) and the
    cool-down's (after it) lie on another line; the window's lie on (a, b), one of them prefilling. The
    profile's rollout line and prefill rate are the window's, whatever core's last fit (`step_fits`) said."""
    from benchmarks.fidelity import profile, window_line
    from pivotrl.core.throughput import StepTotals

    totals = StepTotals()
    snaps = []
    for phase in ("warm-up", "measured", "measured", "cool-down"):
        for n in batches:
            if phase == "measured":
                totals.add(float(n), a + b * n)
            else:
                totals.add(float(n), 0.05 + 0.01 * n)
        if phase == "measured":
            totals.add(8.0, a + b * 8 + per_token * 500, 500)
        snaps.append({"rollout": totals.as_dict()})
    run = _Measured(1.0, 0.2)
    for row, snap in zip(run.iterations, snaps, strict=True):
        row["step_totals"] = snap
    line = window_line([run], "rollout")
    assert line is not None
    assert line[0] == pytest.approx(a, rel=1e-4) and line[1] == pytest.approx(b, rel=1e-4)
    assert line[2] == pytest.approx(1 / per_token, rel=1e-3)
    cost = profile(_cfg(), {"colocated": [run]}, ["colocated"], own=("colocated", run))["cost"]
    assert cost["rollout"]["decode"]["a_s"] == pytest.approx(a, rel=1e-4)
    assert cost["rollout"]["prefill_tokens_per_s"] == pytest.approx(1 / per_token, rel=1e-3)
    assert cost["reward"]["decode"]["a_s"] == pytest.approx(0.01)  # no totals for it: core's fits


def test_a_realizations_expected_ratio_is_against_the_best_median_and_hindsight_per_realization() -> None:
    from benchmarks.sim import realization_row

    splits = [{"rollout": 4, "reward": 2, "train": 2}, {"rollout": 2, "reward": 4, "train": 2}]
    # split A wins realizations 0 and 1 by luck, split B has the better median; shiftable is level with B
    runs = [{"colocated": 50.0, "shiftable": 100.0, "static": [104.0, 100.0]},
            {"colocated": 50.0, "shiftable": 100.0, "static": [103.0, 100.0]},
            {"colocated": 50.0, "shiftable": 100.0, "static": [90.0, 100.0]},
            {"colocated": 120.0, "shiftable": 100.0, "static": [91.0, 100.0]}]
    row = realization_row(7, splits, runs)
    assert row["best_expected_baseline"] == "2/4/2"
    assert row["expected_ratio"] == pytest.approx(1.0)
    assert row["hindsight_ratios"] == pytest.approx([100 / 104, 100 / 103, 1.0, 100 / 120])
    assert row["realizations_below_0.99"] == 3
    assert row["median_hindsight_ratio"] == pytest.approx((100 / 104 + 100 / 103) / 2)


@given(st.lists(st.tuples(st.floats(1, 1e4), st.floats(1, 1e4), st.floats(1, 1e4)), min_size=1, max_size=9))
@settings(max_examples=200, deadline=None)
def test_no_realization_baseline_is_below_any_fixed_plan(values: list[tuple[float, float, float]]) -> None:
    """Choosing the baseline after the lengths came out never makes shiftable look better than against the
    plan that is best in expectation, realization by realization."""
    from benchmarks.sim import realization_row

    runs = [{"colocated": c, "shiftable": s, "static": [a]} for s, c, a in values]
    row = realization_row(0, [{"rollout": 1, "reward": 1, "train": 1}], runs)
    best = row["best_expected_baseline"]
    for r, h in zip(runs, row["hindsight_ratios"]):
        fixed = r["colocated"] if best == "colocated" else r["static"][0]
        assert h <= r["shiftable"] / fixed + 1e-12


@pytest.mark.parametrize("text", ["a,b", "-1", "1,,2", "", "3,-4"])
def test_realization_seeds_are_non_negative_integers(text: str) -> None:
    import argparse

    from benchmarks.sim import _seed_list

    with pytest.raises(argparse.ArgumentTypeError):
        _seed_list(text)
    assert _seed_list("0,17,428") == [0, 17, 428]
