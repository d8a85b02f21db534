"""The stall watch: a run whose devices send nothing back says so, once per `run.stall_warn_s`, with what
the scheduler holds; output or the driver's own work restarts the count."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.stall import StallWatch, describe_state, session_describer


def _watch(after: float | None, lines: list[str]) -> StallWatch:
    return StallWatch(after, lines.append, lambda: "state", since=0.0)


def test_it_warns_after_the_quiet_time_then_once_per_period_and_output_restarts_it() -> None:
    lines: list[str] = []
    w = _watch(10.0, lines)
    assert not w.round(9.9, False)
    assert w.round(10.0, False) and "for 10 s" in lines[-1] and lines[-1].endswith("state")
    assert not w.round(19.0, False)  # not again within the period
    assert w.round(20.5, False) and "for 20 s" in lines[-1]
    assert not w.round(21.0, True)  # output: the count starts again
    assert not w.round(30.0, False)
    assert w.round(31.0, False) and "for 10 s" in lines[-1]
    assert len(lines) == 3


def test_none_never_warns() -> None:
    lines: list[str] = []
    w = _watch(None, lines)
    assert not any(w.round(t, False) for t in (1.0, 1e3, 1e6)) and lines == []


@settings(max_examples=200, deadline=None)
@given(after=st.floats(0.5, 50.0),
       rounds=st.lists(st.tuples(st.floats(0.0, 20.0), st.booleans(), st.booleans()), max_size=60))
def test_warnings_match_a_reference_over_random_rounds(after, rounds) -> None:
    """Against a direct statement of the rule: a round without output warns when the time since the last
    output or restart, and since the last warning, are both at least `after`."""
    lines: list[str] = []
    w = _watch(after, lines)
    now, quiet_from, last_warn = 0.0, 0.0, None
    for dt, output, restart in rounds:
        now += dt
        if restart:
            w.restart(now)
            quiet_from, last_warn = now, None
            continue
        want = (not output and now - quiet_from >= after
                and (last_warn is None or now - last_warn >= after))
        assert w.round(now, output) == want
        if output:
            quiet_from, last_warn = now, None
        elif want:
            last_warn = now
    assert len(lines) == sum(1 for ln in lines if ln.startswith("no output from the devices for "))


def test_the_state_line_names_each_roles_items_and_each_worker() -> None:
    state = {"items": {"reward": {"running": 63}, "train": {"accumulated": 432, "waiting": 2}},
             "workers": {"tcp://a": {"name": "0", "role": "reward", "status": "ready"},
                         "tcp://b": {"name": "1", "role": None, "status": "shifting"}}}
    assert describe_state(state) == ("scheduler holds reward: 63 running; train: 432 accumulated, 2 waiting; "
                                     "workers: 0 reward ready, 1 idle shifting")
    assert describe_state({}) == "scheduler holds none; workers: none"


def test_a_session_that_cannot_report_does_not_end_the_run() -> None:
    class Broken:
        def state(self):
            raise ConnectionError("scheduler gone")

    assert "unavailable (ConnectionError: scheduler gone)" in session_describer(Broken())()
    assert "no scheduler state" in session_describer(object())()
