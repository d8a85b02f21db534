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
