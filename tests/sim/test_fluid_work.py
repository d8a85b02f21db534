"""The fluid bound's decode work (`fluid.decode_device_s`) against the simulator's own replicas."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.sim.config import DecodeCost, GenRoleCost
from pivotrl.sim.fluid import decode_device_s
from pivotrl.sim.replicas import GenReplica

lengths = st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 6000)), min_size=1, max_size=40)


def _cost(max_batch: int, devices: int = 1, kv_tokens: int = 10**9) -> GenRoleCost:
    return GenRoleCost(decode=DecodeCost(a_s=0.007, b_s=2.5e-5, c_s=2.3e-8), prefill_tokens_per_s=1e15,
                       weights_gb=0.0, max_batch=max_batch, kv_tokens=kv_tokens, devices_per_replica=devices)


def _decode_on_one_replica(cost: GenRoleCost, seqs: list[tuple[int, int]]) -> float:
    """Device-seconds a simulated replica spends decoding `seqs` (context, tokens), admitting the next
    waiting sequence whenever a row frees up and the KV cache admits it (the replica's prefill is made
    free)."""
    rep = GenReplica("r", "rollout", tuple(f"d{i}" for i in range(cost.devices_per_replica)), cost)
    waiting = list(enumerate(seqs))
    now = 0.0
    while waiting or rep.running:
        while waiting and rep.can_admit(waiting[0][1][0]):
            i, (context, tokens) = waiting.pop(0)
            rep.admit(now, f"s{i}", prompt=context, generated=0, target=tokens)
        now = rep.next_finish_time()
        assert math.isfinite(now)
        rep.advance(now)
        rep.pop_finished()
    return rep.busy_time * cost.devices_per_replica


@settings(max_examples=60, deadline=None)
@given(seqs=lengths, devices=st.integers(1, 2))
def test_one_row_at_a_time_the_bound_is_the_replicas_own_time(seqs: list[tuple[int, int]],
                                                               devices: int) -> None:
    """At batch 1 nothing is shared: the bound must equal the simulated time, each token at its own context.
    A bound priced at the mean context over sequences misses this whenever lengths differ."""
    cost = _cost(max_batch=1, devices=devices)
    context = np.array([c for c, _ in seqs], dtype=float)
    tokens = np.array([n for _, n in seqs], dtype=float)
    simulated = _decode_on_one_replica(cost, seqs)
    assert decode_device_s(cost, context, tokens) == pytest.approx(simulated, rel=1e-6)


@settings(max_examples=100, deadline=None)
@given(seqs=lengths, max_batch=st.integers(1, 64), kv_tokens=st.sampled_from([3000, 5000, 20000, 10**9]))
def test_no_batching_of_the_same_work_beats_the_bound(seqs: list[tuple[int, int]], max_batch: int,
                                                      kv_tokens: int) -> None:
    """Whatever the batch cap and however tight the KV cache (down to one longest prompt)."""
    cost = _cost(max_batch=max_batch, kv_tokens=kv_tokens)
    context = np.array([c for c, _ in seqs], dtype=float)
    tokens = np.array([n for _, n in seqs], dtype=float)
    assert decode_device_s(cost, context, tokens) <= _decode_on_one_replica(cost, seqs) * (1 + 1e-9)


def test_a_full_batch_of_equal_sequences_meets_the_bound() -> None:
    """Where every step runs at the largest batch, the bound is reached: it is tight, not only valid."""
    cost = _cost(max_batch=16)
    seqs = [(200, 1000)] * 16
    bound = decode_device_s(cost, np.full(16, 200.0), np.full(16, 1000.0))
    assert bound == pytest.approx(_decode_on_one_replica(cost, seqs), rel=1e-9)
