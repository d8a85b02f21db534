"""A device lent downstream pays for its trip back (`planner.return_trip_s`): a judge device moved to train
is taken back at the next iteration's opening on a split, and is missed there for the part of its trip after
half of the judge's items have arrived (`IterationChoice.half_work_s`)."""

from __future__ import annotations

import dataclasses
import math

from hypothesis import given
from hypothesis import strategies as st

from pivotrl.core import Role, ShiftTimings
from pivotrl.core.iteration import IterationChoice
from pivotrl.core.planner import plan, return_trip_s
from pivotrl.core.shiftable import Shiftable
from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.state import ClusterState
from pivotrl.core.views import role_views

from ._hyp import CI
from .test_tail import _judge_tail

SPLIT = {Role.ROLLOUT: 1, Role.REWARD: 5, Role.TRAIN: 1}


def _moves_a_judge_to_train(return_after: dict[Role, float] | None, trip_s: float = 3.0) -> bool:
    """The judge's tail with a deep train backlog: train is behind and an idle judge replica is the donor
    (its own φ is 0, and one more train replica gains ~0.6 device-seconds over the horizon)."""
    stt = _judge_tail(judged=2, longest=120.0, train_items=400)
    res = plan(stt, ShiftCostModel(prior_s=trip_s), 1.0, False, return_after)
    return res.chosen is not None and res.chosen.donors_per_role.get("reward", 0) > 0


def test_a_judge_device_lent_to_train_pays_for_the_part_of_its_trip_back_after_its_work_arrives() -> None:
    """Without an opening to return to, the idle judge replica moves (B = 0.60 device-seconds against a
    margin of 0.5). Where half of the judge's items arrive before its 3 s trip back ends, the part of the
    trip after them is charged: all 3 s, or 0.2 s, take B below the margin and it stays; 0.05 s does not.
    Where they arrive after the trip, it costs nothing."""
    assert _moves_a_judge_to_train(None)
    assert not _moves_a_judge_to_train({Role.REWARD: 0.0})
    assert not _moves_a_judge_to_train({Role.REWARD: 2.8})
    assert _moves_a_judge_to_train({Role.REWARD: 2.95})
    assert _moves_a_judge_to_train({Role.REWARD: 3.0})
    assert _moves_a_judge_to_train({Role.REWARD: 30.0})


def test_only_a_move_downstream_of_a_later_role_pays_a_return() -> None:
    stt = _judge_tail(judged=2, longest=120.0, train_items=400)
    views = role_views(stt, 10.0)
    costs = ShiftCostModel(prior_s=3.0)
    half = {Role.REWARD: 1.0, Role.TRAIN: 1.0}
    assert return_trip_s(views, Role.REWARD, Role.TRAIN, costs, half) == 2.0
    assert return_trip_s(views, Role.REWARD, Role.TRAIN, costs, None) == 0.0
    assert return_trip_s(views, Role.TRAIN, Role.REWARD, costs, half) == 0.0   # upstream: nothing undoes it
    assert return_trip_s(views, Role.REWARD, Role.ROLLOUT, costs, half) == 0.0
    assert return_trip_s(views, None, Role.TRAIN, costs, half) == 0.0   # a free device has no home role
    # the first stage keeps its own rule: its whole trip once it is done for the iteration (here it is)
    assert views[Role.ROLLOUT].done
    assert return_trip_s(views, Role.ROLLOUT, Role.TRAIN, costs, half) == 3.0
    assert return_trip_s(views, Role.ROLLOUT, Role.TRAIN, costs, None) == 3.0


@CI
@given(trip=st.floats(0.0, 1e4), half=st.floats(0.0, 1e4), later=st.floats(0.0, 1e4))
def test_the_return_charge_is_the_trip_past_half_the_work_and_falls_as_the_work_comes_later(
        trip: float, half: float, later: float) -> None:
    costs = ShiftCostModel(prior_s=1.0)
    costs.observe(Role.TRAIN, Role.REWARD, ShiftTimings(load=trip))
    stt = _judge_tail(judged=2, longest=120.0, train_items=400)
    views = role_views(stt, 10.0)
    trip_s = costs.duration(Role.TRAIN, Role.REWARD)
    now = return_trip_s(views, Role.REWARD, Role.TRAIN, costs, {Role.REWARD: half})
    then = return_trip_s(views, Role.REWARD, Role.TRAIN, costs, {Role.REWARD: half + later})
    assert now == max(trip_s - half, 0.0)
    assert 0.0 <= then <= now <= trip_s


def test_shiftable_charges_the_return_on_policy_where_the_next_opening_is_a_split() -> None:
    """The policy hands the planner its choice's `half_work_s` on-policy; with staleness the next rollouts
    start on the devices they find, where colocated opens the next iteration every device goes to the
    first stage from wherever it is, and after the run's last iteration nothing opens: no trip back then."""
    def moved(max_staleness: int, opens_colocated: bool, last: bool = False) -> bool:
        stt = _judge_tail(judged=2, longest=120.0, train_items=400, max_staleness=max_staleness)
        assert stt.plan is not None
        stt.plan = dataclasses.replace(stt.plan, last_iteration=last)
        pol = Shiftable()
        pred = {"static": 20.0, "dynamic": 10.0, "colocated": 15.0 if opens_colocated else 30.0}
        pol.choice = IterationChoice("dynamic", pred, SPLIT, 1.0, half_work_s={Role.REWARD: 0.0})
        assert pol.choice.opens_colocated() is opens_colocated
        pol.plan(stt, ShiftCostModel(prior_s=3.0), 1.0)
        assert pol.last is not None and pol.last.to_role is Role.TRAIN
        return pol.last.chosen is not None
    assert not moved(0, False)
    assert moved(1, False)
    assert moved(0, True)
    assert moved(0, False, last=True)   # the run's last iteration: there is no opening to return to


def test_a_rollout_device_lent_before_the_rollouts_end_pays_its_trip_where_a_split_opens_next() -> None:
    """A rollout device lent downstream while the rollouts still run returns at the next opening on a
    split like one lent after they end: its whole trip. Without a split to return to (staleness, a
    colocated opening, the run's last iteration: `return_after` None) only a done first stage pays."""
    stt = _judge_tail(judged=2, longest=120.0, train_items=400)
    views = role_views(stt, 10.0)
    running = {**views, Role.ROLLOUT: dataclasses.replace(views[Role.ROLLOUT], done=False)}
    costs = ShiftCostModel(prior_s=3.0)
    half = {Role.REWARD: 1.0, Role.TRAIN: 1.0}
    for to in (Role.REWARD, Role.TRAIN):
        assert return_trip_s(running, Role.ROLLOUT, to, costs, half) == 3.0
        assert return_trip_s(running, Role.ROLLOUT, to, costs, None) == 0.0
        assert return_trip_s(views, Role.ROLLOUT, to, costs, None) == 3.0


def _idle_rollout_and_train_backlog(max_staleness: int = 0) -> ClusterState:
    """Every rollout done and its one device idle; two judge replicas each running an item near its end;
    train, one replica, holds 400 items: over the horizon one more train replica gains ~0.6 device-seconds,
    and only the rollout device is free to give."""
    return _judge_tail(judged=2, longest=120.0, train_items=400, max_staleness=max_staleness, idle_judges=0)


def test_a_lent_rollout_devices_trip_is_charged_over_the_first_stages_share_of_the_opening() -> None:
    """The next opening starts with the first stage short of the lent device for its trip back: the
    first stage, and every stage waiting on it, ends later by trip × lent / its devices, which the cluster
    pays whole. Its 0.05 s trip is charged 0.05 s per device where the first stage opens with every
    device, twice that with half of them; with a quarter or less, B falls under the 0.5 margin."""
    half = {Role.REWARD: 30.0, Role.TRAIN: 30.0}
    for share, moves in ((1.0, True), (0.5, True), (0.25, False), (0.1, False)):
        res = plan(_idle_rollout_and_train_backlog(), ShiftCostModel(prior_s=0.05), 1.0, False, half, None,
                   share)
        (cand,) = res.reasoning.candidates
        assert cand.donors_per_role == {"rollout": 1}
        assert math.isclose(cand.penalty, 0.05 / share)
        assert (res.chosen is not None) is moves
    views = role_views(_idle_rollout_and_train_backlog(), 10.0)
    costs = ShiftCostModel(prior_s=3.0)
    # only the first stage's trip is scaled: a judge device's charge is its own absence
    assert return_trip_s(views, Role.REWARD, Role.TRAIN, costs, half, 0.1) == 0.0
    assert return_trip_s(views, Role.REWARD, Role.TRAIN, costs, {Role.REWARD: 1.0}, 0.1) == 2.0
    assert return_trip_s(views, Role.ROLLOUT, Role.TRAIN, costs, half, 0.1) == 30.0


def test_shiftable_hands_the_planner_the_first_stages_share_of_the_split_it_opens_on() -> None:
    """On-policy with a split to open on, the policy passes that split's first-stage share: the rollout
    device that a split with the rollouts on every device would lend stays where the split gives them a
    tenth of the cluster. With staleness (no opening to return to) it is lent either way."""
    def lent(rollout_share: int, max_staleness: int = 0) -> bool:
        stt = _idle_rollout_and_train_backlog(max_staleness)
        n = len(stt.device_role)
        split = {Role.ROLLOUT: rollout_share, Role.REWARD: n - rollout_share - 1, Role.TRAIN: 1}
        pol = Shiftable()
        pred = {"static": 20.0, "dynamic": 10.0, "colocated": 30.0}
        pol.choice = IterationChoice("dynamic", pred, split, 1.0, half_work_s={Role.REWARD: 30.0,
                                                                               Role.TRAIN: 30.0})
        pol.plan(stt, ShiftCostModel(prior_s=0.05), 1.0)
        return pol.last is not None and pol.last.chosen is not None
    assert len(_idle_rollout_and_train_backlog().device_role) == 4
    assert lent(2)        # half of the devices: 0.1 s charged, B = 0.50 > 0.5 (0.501)
    assert not lent(1)    # a quarter: 0.2 s, B = 0.40
    assert lent(1, max_staleness=1)
