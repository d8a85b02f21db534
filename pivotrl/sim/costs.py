"""Cost models: how long decode steps, prefills, training micro-batches and role shifts take.

Decode is advanced analytically between events. With batch B fixed, step s costs
``a + b*B + c*(K + B*s)`` seconds (the context grows by B tokens per step), so the time to go from step
s0 to s0+x is ``alpha*x + beta*x*(x/2 + s0)``-style closed forms (alpha = a + b*B + c*K, beta = c*B), and the
inverse is a quadratic. That lets one event cover thousands of decode steps.
"""

from __future__ import annotations

import math

from pivotrl.core.types import ShiftTimings
from pivotrl.sim.config import CostProfile, GenRoleCost, SimConfig, TrainRoleCost


def decode_time(alpha: float, beta: float, s0: float, x: float) -> float:
    """Seconds to advance x (continuous) steps from step s0, where dt/ds = alpha + beta*s."""
    return x * (alpha + beta * s0) + 0.5 * beta * x * x


def decode_steps(alpha: float, beta: float, s0: float, dt: float) -> float:
    """Inverse of `decode_time`: steps advanced in dt seconds from step s0 (stable quadratic root)."""
    if dt <= 0:
        return 0.0
    slope = alpha + beta * s0
    if beta <= 0:
        return dt / slope if slope > 0 else math.inf
    return 2.0 * dt / (slope + math.sqrt(slope * slope + 2.0 * beta * dt))


def step_time(cost: GenRoleCost, batch: int, context_tokens: float) -> float:
    d = cost.decode
    return d.a_s + d.b_s * batch + d.c_s * context_tokens


def prefill_time(cost: GenRoleCost, tokens: float) -> float:
    return tokens / cost.prefill_tokens_per_s


#: The largest share of a busy device's core the control plane is taken to claim (`shared_core_slowdown`).
MAX_CORE_SHARE = 0.9


def shared_core_slowdown(busy: int, devices: int, control_cores: float) -> float:
    """How much slower each of `busy` devices works when the devices are a host's cores (a CPU cluster) and
    the control plane (scheduler, driver) needs `control_cores` of them: it runs on idle cores first and
    takes what is left evenly from the busy ones. 1 where the idle cores hold it, or nothing is busy.

    Why: on the 2-core cluster a decode step at batch 32 took 1.7-1.9 ms with the other core idle and
    2.2-2.4 ms with both at work, while the driver process ran 0.16-0.19 cores (docs/decisions.md, "The
    control plane shares the CPU cluster's cores")."""
    excess = control_cores - (devices - busy)
    if busy <= 0 or excess <= 0.0:
        return 1.0
    return 1.0 / (1.0 - min(excess / busy, MAX_CORE_SHARE))


def dp_efficiency(train: TrainRoleCost, replicas: int) -> float:
    """Data-parallel scaling: each doubling of train replicas keeps this fraction of per-device speed."""
    return train.dp_efficiency_per_doubling ** math.log2(max(replicas, 1))


def train_rate(train: TrainRoleCost, replicas: int) -> float:
    """Tokens/s of ONE train replica when `replicas` of them run data-parallel."""
    return train.tokens_per_s_per_device * train.devices_per_replica * dp_efficiency(train, replicas)


def role_cost(cost: CostProfile, role: str) -> GenRoleCost | TrainRoleCost:
    return getattr(cost, role)


def shift_time(cost: CostProfile, role: str, abort: bool = False) -> ShiftTimings:
    """One device taking up `role`: abort its work (when it had some), offload the old role, fetch weights
    from GPS, build the new role's engine."""
    rc = role_cost(cost, role)
    tier = cost.gps.tiers[cost.gps.fetch_tier]
    return ShiftTimings(
        abort=cost.abort_s if abort else 0.0,
        offload=cost.gps.offload_s,
        fetch=tier.latency_s + rc.weights_gb / tier.bandwidth_gb_s,
        load=rc.init_s,
    )


def barrier_time(cfg: SimConfig, train_replicas: int) -> float:
    """The train barrier: gradient all-reduce + optimizer step + publish of the new version.

    Sharded (`pivotrl.runtime.train_group`): the n train devices reduce-scatter in buckets, each bucket to
    the rank that owns its tensors ((n-1)/n of the bytes over the link, plus one collective latency per
    bucket; the clip's norms are one small all-reduce), each steps AdamW on its 1/n of the tensors and
    writes its 1/n of the version in parallel, then rank 0 commits the manifest. Driver: one process
    reduces (the ring all-reduce model, 2(n-1)/n, kept from before), steps and publishes the whole model.
    Either way the control plane adds its round trips and the driver's bookkeeping (`control_s`)."""
    it = cfg.cost.iteration
    n = max(train_replicas, 1)
    if it.optimizer_owner == "driver":
        ring_s = 2.0 * (n - 1) / n * it.grad_allreduce_gb / it.allreduce_gb_s if n > 1 else 0.0
        return it.optimizer_step_s + ring_s + it.publish_s + it.control_s
    scatter_s = (n - 1) / n * it.grad_allreduce_gb / it.allreduce_gb_s if n > 1 else 0.0
    buckets = math.ceil(it.grad_allreduce_gb / it.bucket_gb) if n > 1 else 0
    sharded_s = (it.optimizer_step_s + it.publish_s) / n + it.commit_s
    return scatter_s + buckets * it.collective_latency_s + sharded_s + it.control_s
