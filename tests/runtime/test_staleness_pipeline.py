"""Bounded staleness in the driver: with k = 1 the next iteration's rollouts start before the current one has
trained, steps stay in iteration order, every sample trains once, and the recorded staleness is exact."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.config import PipelineConfig
from pivotrl.engines.checkpoints import build_tokenizer
from pivotrl.grpo import minibatch_slices
from pivotrl.pipeline import Pipeline, StageContext, default_stages, run_iterations
from pivotrl.runtime.messages import Collected
from pivotrl.tasks import get_task
from tests.runtime.test_pipeline import InlineSession


class TimelineSession(InlineSession):
    """An `InlineSession` that records, in one timeline with the optimizer steps, which iteration each
    submitted item belongs to, and hands back `per_collect` results at a time (devices trickle)."""

    def __init__(self, task, tok, timeline: list, per_collect: int) -> None:
        super().__init__(task, tok, per_collect=per_collect)
        self.timeline = timeline
        self.plans: list[int] = []

    def submit(self, requests):
        for r in requests:
            self.timeline.append(("submit", r.role, r.iteration, r.payload.get("version")))
        super().submit(requests)

    def begin_iteration(self, plan):
        self.plans.append(plan.iteration)

    def state(self):
        return {"workers": {}, "tokens": {}, "plan_s": 0.0, "plans": 0}

    def collect(self, wait_s=0.0):
        out = super().collect()
        for r in out.results:  # ids are "r<iteration>:<uid>:<k>/<stage>"
            self.timeline.append(("result", r.id.rpartition("/")[2], int(r.id[1:].split(":")[0])))
        return Collected(out.results, out.grads, [], self.state())


class CountingUpdater:
    def __init__(self, timeline: list) -> None:
        self.timeline, self.version, self.last_stats = timeline, 0, {}

    def slices(self, n):
        return minibatch_slices(n, 1)

    def apply(self, grads, iteration):
        self.timeline.append(("apply", iteration, sum(len(g.items) for g in grads)))
        self.version += 1
        return self.version


def _run(k: int, iterations: int = 4, per_collect: int = 5, **kwargs):
    tok = build_tokenizer()
    task = get_task("sort", {"median": 3, "max_size": 6})
    cfg = PipelineConfig.model_validate(
        {"task": {"group_size": 2, "prompts_per_iteration": 3}, "run": {"max_staleness": k}}
    )
    timeline: list = []
    sess = TimelineSession(task, tok, timeline, per_collect)
    ctx = StageContext(tokenizer=tok, task=task, cfg=cfg)
    pipe = Pipeline(default_stages(), ctx, sess, CountingUpdater(timeline), poll_s=0.0)
    rows = run_iterations(pipe, iterations=iterations, log=lambda _: None, max_staleness=k, **kwargs)
    return rows, timeline, sess


def _first_rollout(timeline, it):
    return next(i for i, e in enumerate(timeline) if e[:3] == ("submit", "rollout", it))


def _apply(timeline, it):
    return next(i for i, e in enumerate(timeline) if e[:2] == ("apply", it))


def test_on_policy_rollouts_wait_for_the_previous_step():
    rows, timeline, _ = _run(0)
    for it in range(1, 4):
        assert _first_rollout(timeline, it) > _apply(timeline, it - 1)
    assert all(r["staleness_max"] == 0 for r in rows)


@pytest.mark.parametrize("per_collect", [1, 5, 1000])
def test_one_stale_iteration_overlaps_the_previous_tail(per_collect):
    rows, timeline, sess = _run(1, per_collect=per_collect)
    applies = [e[1] for e in timeline if e[0] == "apply"]
    assert applies == [0, 1, 2, 3]  # optimizer steps in iteration order
    # every sample with a response (even group index: 3 per iteration) trains once, nothing left unflushed
    assert all(e[2] == 3 for e in timeline if e[0] == "apply") and not sess.accumulated
    overlapped = [it for it in range(1, 4) if _first_rollout(timeline, it) < _apply(timeline, it - 1)]
    assert overlapped == [1, 2, 3]
    for it in range(1, 4):  # never more than one iteration of lag: it starts after it-2 has trained
        if it >= 2:
            assert _first_rollout(timeline, it) > _apply(timeline, it - 2)
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["staleness_max"] == 0
    assert all(r["staleness_max"] == 1 and r["staleness_mean"] == 1 for r in rows[1:])
    # the rollouts of iteration it were requested at version it-1 (the latest trained when it started)
    versions = {e[2]: e[3] for e in timeline if e[:2] == ("submit", "rollout")}
    assert versions == {0: 0, 1: 0, 2: 1, 3: 2}


def test_the_next_iteration_waits_until_the_previous_finished_generating():
    _, timeline, _ = _run(1, per_collect=1)
    for it in range(1, 4):
        last_rollout_done = max(i for i, e in enumerate(timeline) if e == ("result", "rollout", it - 1))
        assert _first_rollout(timeline, it) > last_rollout_done


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(0, 2),
    iterations=st.integers(1, 5),
    per_collect=st.sampled_from([1, 5, 1000]),
    budget=st.floats(0.5, 6.0),
    steps=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=8),
    commit=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=8),
)
def test_a_run_ended_by_its_time_budget_is_evaluated_after_its_last_iteration(
    k, iterations, per_collect, budget, steps, commit
):
    """Time passes in an iteration (each clock reading after the start) and in its checkpoint commit
    (`on_iteration`); wherever the budget runs out, the run's last iteration is evaluated, no iteration
    starts after one that completed past the budget with nothing else in flight, and none is skipped."""
    now = [0.0]
    readings = [0]

    def clock() -> float:
        readings[0] += 1
        if readings[0] > 1:
            now[0] += steps[readings[0] % len(steps)] / 10
        return now[0]

    def on_iteration(res, row) -> None:
        now[0] += commit[res.iteration % len(commit)]

    evaluated: list[int] = []

    def evaluate(it: int, divert) -> float:
        evaluated.append(it)
        return 50.0

    rows, _, _ = _run(
        k, iterations, per_collect, time_budget_s=budget, clock=clock, on_iteration=on_iteration,
        evaluate_fn=evaluate,
    )
    assert [r["iteration"] for r in rows] == list(range(len(rows)))
    assert evaluated == [rows[-1]["iteration"]] and "heldout_accuracy" in rows[-1]
    if k == 0:  # on-policy: a completion past the budget is the last one
        assert all(r["elapsed_s"] < budget for r in rows[:-1])
        assert len(rows) == iterations or now[0] >= budget


def test_a_run_whose_devices_go_quiet_says_so_with_the_schedulers_state_and_finishes():
    """The session hands nothing back for its first 12 collects while the clock moves 100 s per reading:
    the driver logs the stall (with the scheduler's items), once per `run.stall_warn_s`, and completes."""
    tok = build_tokenizer()
    task = get_task("sort", {"median": 3, "max_size": 6})
    cfg = PipelineConfig.model_validate(
        {"task": {"group_size": 2, "prompts_per_iteration": 3}, "run": {"stall_warn_s": 300}})

    class Quiet(TimelineSession):
        quiet = 12

        def collect(self, wait_s=0.0):
            if self.quiet:
                self.quiet -= 1
                return Collected([], [], [], self.state())
            return super().collect(wait_s)

        def state(self):
            return {**super().state(), "items": {"rollout": {"running": 6}}}

    now = [0.0]

    def clock() -> float:
        now[0] += 100.0
        return now[0]

    lines: list[str] = []
    sess = Quiet(task, tok, [], 5)
    pipe = Pipeline(default_stages(), StageContext(tokenizer=tok, task=task, cfg=cfg), sess,
                    CountingUpdater([]), poll_s=0.0)
    rows = run_iterations(pipe, iterations=2, log=lines.append, clock=clock)
    warned = [ln for ln in lines if ln.startswith("no output from the devices")]
    assert len(rows) == 2 and 3 <= len(warned) <= 4
    assert all("scheduler holds rollout: 6 running" in ln for ln in warned)


def test_each_row_carries_the_drivers_cpu_since_the_previous_completion() -> None:
    """`driver_cpu_s` (what `benchmarks.fidelity` reads the control plane's cores from): never negative,
    and the rows together hold no more than the process spent over the run, nor less than its later rows."""
    import time

    before = time.process_time()
    rows, _, _ = _run(0, iterations=3)
    spent = time.process_time() - before
    cpu = [row["driver_cpu_s"] for row in rows]
    assert len(cpu) == 3 and min(cpu) >= 0.0 and sum(cpu[1:]) > 0.0
    assert sum(cpu) <= spent + 1e-6
