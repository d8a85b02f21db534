"""core.locality: nearest-holder order, fetch tiers, the fetch-time model and φ preferring weight holders."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.core.dispatcher import dispatch_all
from pivotrl.core.locality import (
    FetchTier,
    FetchTimeModel,
    Holder,
    Holdings,
    Locality,
    Tier,
    fetch_tier,
    nearest_holders,
)
from pivotrl.core.planner import plan
from pivotrl.core.shiftcost import ShiftCostModel
from pivotrl.core.types import Role, ShiftTimings
from tests.core.helpers import active_state, config, seq

NODES = ["a", "b", "c"]
WORKERS = [("a", "a1"), ("a", "a2"), ("b", "b1"), ("b", "b2"), ("c", "c1"), ("a", ""), ("b", "")]
holders_st = st.lists(  # a worker lives on one node; "" is a node-tier copy
    st.builds(lambda nw, t: Holder(nw[0], nw[1], t), st.sampled_from(WORKERS), st.sampled_from(Tier)),
    max_size=12,
)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(holders_st, st.sampled_from(NODES), st.sets(st.sampled_from(["a1", "a2", "b1", "b2", "c1"])))
def test_nearest_holders_same_node_first_and_no_excluded(hs, node, exclude) -> None:
    got = nearest_holders(hs, node, exclude)
    assert all(h.worker and h.worker not in exclude for h in got)
    assert len({h.worker for h in got}) == len(got)  # one entry per worker
    assert {h.worker for h in got} == {h.worker for h in hs if h.worker and h.worker not in exclude}
    same = [h.node == node for h in got]
    assert same == sorted(same, reverse=True)  # every same-node holder before any other-node one
    assert got == nearest_holders(list(reversed(hs)), node, exclude)  # order-independent: callers agree


def test_nearest_holder_prefers_faster_tier_on_same_node() -> None:
    hs = [Holder("a", "w2", Tier.PERSISTENT), Holder("b", "w9", Tier.DEVICE), Holder("a", "w1", Tier.HOST)]
    assert [h.worker for h in nearest_holders(hs, "a")] == ["w1", "w2", "w9"]
    assert [h.worker for h in nearest_holders(hs, "b")] == ["w9", "w1", "w2"]


def test_fetch_tier_cases() -> None:
    node_host = Holder("a", "", Tier.HOST)
    dev_w1 = Holder("a", "w1", Tier.DEVICE)
    remote = Holder("b", "", Tier.PERSISTENT)
    assert fetch_tier("w1", "a", [dev_w1, node_host]) is FetchTier.DEVICE
    assert fetch_tier("w2", "a", [dev_w1, node_host]) is FetchTier.HOST
    assert fetch_tier("w2", "a", [dev_w1]) is FetchTier.PEER_NODE
    assert fetch_tier("w2", "a", [Holder("a", "", Tier.PERSISTENT)]) is FetchTier.PERSISTENT
    assert fetch_tier("w2", "a", [remote]) is FetchTier.PEER_REMOTE
    assert fetch_tier("w2", "a", [remote], object_store=True) is FetchTier.OBJECT_STORE
    assert fetch_tier("w2", "a", []) is None


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10**9), st.floats(1e-4, 10.0)), min_size=1, max_size=20))
def test_fetch_time_model_tracks_bandwidth(obs) -> None:
    m = FetchTimeModel(alpha=1.0)
    for nbytes, secs in obs:
        m.observe(FetchTier.PEER_REMOTE, nbytes, secs)
    nbytes, secs = obs[-1]
    assert m.seconds(FetchTier.PEER_REMOTE, nbytes) == pytest.approx(secs, rel=1e-9)
    m.observe(FetchTier.HOST, 0, 1.0)  # says nothing: ignored
    assert m.samples.get(FetchTier.HOST) is None


def test_holdings_sources_and_loss() -> None:
    h = Holdings()
    for w, n in [("w1", "a"), ("w2", "a"), ("w3", "b")]:
        h.join(w, n)
    h.add("policy", 3, Holder("a", "", Tier.PERSISTENT), nbytes=100)
    h.add("policy", 3, Holder("b", "w3", Tier.DEVICE))
    assert [s.worker for s in h.sources("policy", 3)] == ["w1", "w2", "w3"]
    h.lose("w3")
    assert [s.worker for s in h.sources("policy", 3)] == ["w1", "w2"]
    h.lose("w1")
    h.lose("w2")
    assert h.sources("policy", 3) == []  # node a's directory is still recorded, nobody can serve it now
    h.join("w5", "a")
    assert [s.worker for s in h.sources("policy", 3)] == ["w5"]
    h.drop("policy", [3], node="a")
    assert h.holders("policy", 3) == []


def _tail_state(holder_node: str):
    """Rollout: 4 replicas, 2 of them idle; reward: 1 replica with a deep queue (as in test_planner). Rollout
    devices 0 and 1 are on node a, 2 and 3 (and reward's) on node b; genrm's weights sit on `holder_node`.
    At most one device may shift, so the planner must pick one of the two idle, equally cheap donors."""
    cfg = config(horizon_s=10.0, cooldown_s=1.0, max_shift_fraction=0.2)
    stt = active_state(cfg, {Role.ROLLOUT: 4, Role.REWARD: 1})
    busy = sorted(stt.active(Role.ROLLOUT), key=lambda r: r.replica_id)
    for i in range(2):
        stt.admit(seq(f"r{i}", Role.ROLLOUT, max_new=2000, expected_new_tokens=1500), 0.0)
    for i in range(40):
        stt.admit(seq(f"j{i}", Role.REWARD, max_new=200, expected_new_tokens=150), 0.0)
    dispatch_all(stt)
    del busy
    costs = ShiftCostModel(prior_s=1.0)
    loc = Locality(role_models={Role.REWARD: "genrm"})
    idle = sorted((r for r in stt.active(Role.ROLLOUT) if r.n == 0), key=lambda r: r.replica_id)
    assert len(idle) == 2
    for d in stt.device_role:
        loc.holdings.join(d, "b")
    loc.holdings.join(idle[0].devices[0], "a")  # the first idle donor (by id) is alone on node a
    loc.holdings.add("genrm", 0, Holder(holder_node, "", Tier.HOST), nbytes=2 * 10**9)
    costs.locality = loc
    return stt, costs, idle


@pytest.mark.parametrize("holder_node", ["a", "b"])
def test_phi_prefers_the_donor_whose_node_holds_the_weights(holder_node) -> None:
    stt, costs, idle = _tail_state(holder_node)
    on_a, on_b = idle[0].devices, idle[1].devices
    holder, other = (on_a, on_b) if holder_node == "a" else (on_b, on_a)
    assert costs.fetch_delta(holder, Role.REWARD) < costs.fetch_delta(other, Role.REWARD)
    costs.observe(Role.ROLLOUT, Role.REWARD, ShiftTimings(fetch=1.0, load=0.5))
    assert costs.fetch_delta(holder, Role.REWARD) < 0 < costs.fetch_delta(other, Role.REWARD)
    res = plan(stt, costs, 100.0)
    assert res.to_role is Role.REWARD and res.chosen is not None
    chosen = {dev for d in res.donors if d.replica_id for dev in stt.replicas[d.replica_id].devices}
    assert chosen == set(holder)


def test_without_locality_ties_go_by_id() -> None:
    stt, costs, idle = _tail_state("b")
    costs.locality = None
    res = plan(stt, costs, 100.0)
    chosen = {dev for d in res.donors if d.replica_id for dev in stt.replicas[d.replica_id].devices}
    assert chosen == set(idle[0].devices)  # the control: without locality the first id wins
