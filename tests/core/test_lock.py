"""How long a device stays where it moved: the full cooldown after a first placement, the shorter of the
cooldown and a multiple of the shift's duration after a shift
(docs/decisions.md#a-lock-amortises-its-own-shift)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.core import Controller, IterationPlan, Role, ShiftTimings
from pivotrl.core.types import ControllerConfig

from .helpers import config, rollout_tail, seq

FEW = settings(max_examples=300, derandomize=True, deadline=None)


@FEW
@given(cooldown=st.floats(0, 100), multiple=st.floats(0, 10), a=st.floats(0, 60), b=st.floats(0, 60))
def test_the_lock_is_the_shorter_of_the_cooldown_and_the_amortised_shift(cooldown: float, multiple: float,
                                                                          a: float, b: float) -> None:
    cfg = ControllerConfig(cooldown_s=cooldown, cooldown_shift_multiple=multiple)
    lock = cfg.lock_after(a)
    assert 0.0 <= lock <= cooldown
    assert lock == (cooldown if multiple == 0 else min(cooldown, multiple * a))
    if a <= b:
        assert lock <= cfg.lock_after(b)  # a longer shift is never released sooner


def _placed(cooldown: float, multiple: float) -> tuple[Controller, list[str]]:
    ctl = Controller("shiftable", devices=["a", "b"],
                     config=config(cooldown_s=cooldown, cooldown_shift_multiple=multiple))
    ctl.begin_iteration(IterationPlan(0, rollout_seqs=4), 0.0)
    ctl.submit([seq(f"r{i}", Role.ROLLOUT) for i in range(4)], 0.0)
    dec = ctl.tick(0.0)
    assert dec is not None
    return ctl, [s.replica_id for s in dec.shifts]


def test_a_first_placement_keeps_the_whole_cooldown() -> None:
    """Placing a free device is no shift: it keeps the cooldown that protects decisions taken on a fit with
    no samples yet, whatever the multiple."""
    ctl, replicas = _placed(cooldown=10.0, multiple=3.0)
    for rid in replicas:
        ctl.on_shift_done(rid, 0.5, ShiftTimings(load=0.5))
    st = ctl.state
    assert all(st.locked(d, 10.4) for d in ("a", "b"))
    assert not any(st.locked(d, 10.6) for d in ("a", "b"))


def _shifted(multiple: float, shift_s: float) -> tuple[Controller, list[str]]:
    """5 devices placed 4 rollout + 1 reward at t = 0 (locked 10 s); at 10.5 s the rollout tail's idle
    replicas move to reward, and the shift takes `shift_s`. Returns the devices that shifted."""
    cfg = config(cooldown_s=10.0, cooldown_shift_multiple=multiple, horizon_s=10.0, shift_prior_s=1.0)
    ctl = rollout_tail(cfg)
    early = ctl.tick(5.0)
    assert early is None or not early.shifts  # still locked by the placement
    dec = ctl.tick(10.5)
    assert dec is not None and dec.shifts and all(sh.to_role is Role.REWARD for sh in dec.shifts)
    for sh in dec.shifts:
        ctl.on_shift_done(sh.replica_id, 10.5 + shift_s, ShiftTimings(load=shift_s))
    return ctl, [d for sh in dec.shifts for d in sh.devices]


def test_a_shift_locks_its_devices_for_a_multiple_of_its_duration() -> None:
    ctl, devices = _shifted(multiple=3.0, shift_s=1.0)   # landed at 11.5 s, locked 3 × 1 s
    assert all(ctl.state.locked(d, 14.4) for d in devices)
    assert not any(ctl.state.locked(d, 14.6) for d in devices)


def test_with_multiple_zero_every_shift_keeps_the_whole_cooldown() -> None:
    ctl, devices = _shifted(multiple=0.0, shift_s=1.0)
    assert all(ctl.state.locked(d, 21.4) for d in devices)
    assert not any(ctl.state.locked(d, 21.6) for d in devices)


def test_a_long_shift_is_capped_at_the_cooldown() -> None:
    ctl, devices = _shifted(multiple=3.0, shift_s=8.0)   # landed at 18.5 s; 3 × 8 s > 10 s
    assert all(ctl.state.locked(d, 28.4) for d in devices)
    assert not any(ctl.state.locked(d, 28.6) for d in devices)
