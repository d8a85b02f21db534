"""The control plane sharing a CPU cluster's cores: `costs.shared_core_slowdown` and the simulator."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.sim.compare import compare, simulate
from pivotrl.sim.config import DecodeCost, GenRoleCost, TrainRoleCost, load_sim_config
from pivotrl.sim.costs import MAX_CORE_SHARE, shared_core_slowdown
from pivotrl.sim.fluid import fluid_bound
from pivotrl.sim.replicas import GenReplica, TrainReplica

CPU2 = Path(__file__).resolve().parents[2] / "configs/sim/cpu-2dev.yaml"
SHORT = ["workload.iterations=2"]


@settings(max_examples=300, deadline=None)
@given(devices=st.integers(1, 64), data=st.data(), cores=st.floats(0.0, 8.0))
def test_busy_devices_lose_what_the_idle_cores_cannot_hold(devices: int, data: st.DataObject,
                                                           cores: float) -> None:
    """The control plane takes the idle cores first; what is left comes evenly off the busy devices (at
    most `MAX_CORE_SHARE` of each), and more busy devices never make each faster."""
    busy = data.draw(st.integers(0, devices))
    f = shared_core_slowdown(busy, devices, cores)
    excess = cores - (devices - busy)
    assert f >= 1.0
    if busy == 0 or excess <= 0.0:
        assert f == 1.0
    else:
        assert busy * (1.0 - 1.0 / f) == pytest.approx(min(excess, MAX_CORE_SHARE * busy))
    if busy < devices:
        more = shared_core_slowdown(busy + 1, devices, cores)
        assert more >= f - 1e-12
        # ... yet the cluster never works less with one more device busy (the fluid bound's premise)
        assert (busy + 1) / more >= busy / f - 1e-9


def test_a_replica_slowed_mid_work_ends_its_remaining_work_that_much_later() -> None:
    """Half-way through a decode, twice the step time doubles the time left, and the tokens decoded by then
    are kept; a train micro-batch stretches the same way."""
    cost = GenRoleCost(decode=DecodeCost(a_s=0.001, b_s=0.0, c_s=0.0), prefill_tokens_per_s=1e12,
                       weights_gb=0.0)
    rep = GenReplica("r", "rollout", ("d0",), cost)
    rep.admit(0.0, "s", prompt=1, generated=0, target=100)
    end = rep.next_finish_time()
    assert end == pytest.approx(0.1, rel=1e-6)
    rep.set_slow(0.05, 2.0)
    assert rep.next_finish_time() == pytest.approx(0.05 + 2 * 0.05, rel=1e-6)
    assert rep.generated_of("s") == 50
    train = TrainReplica("t", "train", ("d1",), TrainRoleCost(tokens_per_s_per_device=1000.0, weights_gb=0.0))
    train.pending = [("a", 500)]
    train.start_next(0.0, 1000.0)
    train.set_slow(0.2, 1.5)
    assert train.batch_end == pytest.approx(0.2 + 1.5 * 0.3)
    train.set_slow(0.3, 1.0)
    assert train.batch_end == pytest.approx(0.3 + (0.65 - 0.3) / 1.5)


def test_on_one_core_every_piece_of_work_takes_the_control_planes_share_longer() -> None:
    """One device, always the only busy one: with a quarter of a core of control plane, each role's busy
    time is 4/3 of what it is without; the same sequences and tokens."""
    base = simulate(load_sim_config(CPU2, ["cluster.devices=1", *SHORT]), "colocated")
    slowed = simulate(load_sim_config(CPU2, ["cluster.devices=1", "cost.control_cores=0.25", *SHORT]),
                      "colocated")
    assert base.finished and slowed.finished and slowed.conservation["conserved"]
    assert slowed.conservation["train_tokens_done"] == base.conservation["train_tokens_done"]
    for role, busy in base.busy_device_s.items():
        assert slowed.busy_device_s[role] == pytest.approx(busy * 4.0 / 3.0, rel=0.005), role
    assert slowed.makespan_s > base.makespan_s


def test_two_cores_slow_only_while_both_are_busy() -> None:
    """Two devices and half a core of control plane: a device working alone is not slowed, so busy time
    grows by more than nothing and less than it would if both always worked at once (4/3)."""
    base = simulate(load_sim_config(CPU2, SHORT), "grouped", {"rollout+train": 1, "reward": 1})
    slowed = simulate(load_sim_config(CPU2, ["cost.control_cores=0.5", *SHORT]), "grouped",
                      {"rollout+train": 1, "reward": 1})
    assert slowed.finished and slowed.conservation["conserved"]
    before, after = sum(base.busy_device_s.values()), sum(slowed.busy_device_s.values())
    assert before * 1.001 < after < before * 4.0 / 3.0 * 0.999


def test_no_paradigm_beats_the_fluid_bound_of_shared_cores() -> None:
    """The fluid bound counts the slowdown of every device busy at once: still an upper bound."""
    rep = compare(load_sim_config(CPU2, ["cost.control_cores=0.5", *SHORT]))
    runs = rep.pop("_results")
    assert all(r.finished for r in runs.values())
    assert 0.0 < rep["fraction_of_fluid_bound"] <= 1.0
    bound = rep["fluid_bound"]["tokens_per_s_per_device"]
    assert all(r.tokens_per_s_per_device <= bound * (1 + 1e-9) for r in runs.values())


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), cores=st.floats(0.05, 1.9), k=st.integers(0, 1))
def test_any_control_plane_keeps_the_work_and_stays_under_its_bound(seed: int, cores: float, k: int) -> None:
    """Random seeds, control planes and staleness: every sequence and token is still done once, and
    shiftable stays under the fluid bound that counts the shared cores."""
    over = [f"seed={seed}", f"workload.max_staleness={k}", *SHORT]
    base = simulate(load_sim_config(CPU2, over), "shiftable")
    cfg = load_sim_config(CPU2, [f"cost.control_cores={cores}", *over])
    r = simulate(cfg, "shiftable")
    assert r.finished and r.conservation["conserved"], r.conservation
    assert r.conservation["train_tokens_done"] == base.conservation["train_tokens_done"]
    bound = fluid_bound(cfg)
    assert r.tokens_per_s_per_device <= bound["tokens_per_s_per_device"] * (1 + 1e-9)
