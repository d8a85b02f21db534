"""The fluid bound: every device busy at its role's peak efficiency throughout, no tails, no shift cost.

Each role's work is converted to device-seconds at the role's *peak* per-device rate (decode at the largest
batch the KV cache allows, each token paying for its own context; prefill at its rate; training at
single-replica tokens/s), summed over roles and divided by the device count. The per-iteration train sync
(gradient reduction, optimizer step, publish) is added once per iteration at its cheapest (`least_sync_s`):
on-policy it is serial in every paradigm; with staleness the next iteration may overlap it, so only its
device-time counts. Where the control plane shares the devices' cores (`cost.control_cores`), every device
busy still works at the slowed rate (`shared_core_slowdown`): the cluster never holds more than that, idle
cores or not. No real schedule can beat this.
"""

from __future__ import annotations

import numpy as np

from pivotrl.sim.config import ROLES, GenRoleCost, SimConfig
from pivotrl.sim.costs import barrier_time, shared_core_slowdown
from pivotrl.sim.workload import SeqSpec, iteration_sequences, mean_length


def decode_device_s(cost: GenRoleCost, context: np.ndarray, tokens: np.ndarray) -> float:
    """The least device-seconds to decode ``tokens[i]`` tokens after a context of ``context[i]``.

    A step at batch B costs ``a + b*B + c*(its rows' contexts)``. Every step's ``a`` is shared by at most the
    largest batch a replica can hold, every token pays ``b``, and every token pays ``c`` for its *own*
    context: the i-th sequence's tokens together ``c * (context[i]*n + n*n/2)`` for n tokens, as the
    simulator integrates it. Why not a mean context times the tokens: a long sequence decodes many tokens
    at a long context, so a decoded token sits (1 + cv²) times as far into its response, on average, as
    the mean over sequences says, and a bound priced at the latter undercounts work every schedule pays.

    The largest batch is ``max_batch``, or fewer where the KV cache cannot admit that many of the
    shortest contexts (a replica admits a row while its rows' contexts and the new one fit). Capping it at
    the KV cache over a *mean* context let a replica of short prompts run more rows than the bound allowed,
    and beat it."""
    d = cost.decode
    shortest = float(context.min()) if context.size else 1.0
    batch = max(1, min(cost.max_batch, int(cost.kv_tokens // max(shortest, 1.0))))
    context_work = float((tokens * (context + 0.5 * tokens)).sum())
    return (float(tokens.sum()) * (d.a_s / batch + d.b_s) + d.c_s * context_work) * cost.devices_per_replica


def _work(cfg: SimConfig, prompt: np.ndarray, resp: np.ndarray, crit: np.ndarray) -> dict[str, float]:
    c = cfg.cost
    judge = prompt + resp + cfg.workload.judge_template_tokens
    roll = (decode_device_s(c.rollout, prompt, resp)
            + prompt.sum() / c.rollout.prefill_tokens_per_s * c.rollout.devices_per_replica)
    rew = (decode_device_s(c.reward, judge, crit)
           + judge.sum() / c.reward.prefill_tokens_per_s * c.reward.devices_per_replica)
    train = (prompt + resp).sum() / c.train.tokens_per_s_per_device
    return {"rollout": float(roll), "reward": float(rew), "train": float(train)}


def cluster_seconds(cfg: SimConfig, work_device_s: float) -> float:
    """The least time the whole cluster takes for `work_device_s`: every device busy, each at the shared
    cores' slowdown (with k busy the cluster works at k / slowdown(k), which never falls as k grows)."""
    n = cfg.cluster.devices
    return work_device_s * shared_core_slowdown(n, n, cfg.cost.control_cores) / n


def work_per_iteration(cfg: SimConfig, n: int = 20000) -> dict[str, float]:
    """Expected device-seconds per role for one iteration (from the distributions, by sampling)."""
    wl = cfg.workload
    rng = np.random.default_rng(cfg.seed + 777)
    from pivotrl.sim.workload import draw_lengths

    prompt = draw_lengths(wl.prompt_len, n, rng).astype(float)
    resp = draw_lengths(wl.response_len, n, rng).astype(float)
    crit = draw_lengths(wl.critique_len, n, rng).astype(float)
    scale = wl.prompts_per_iteration * wl.group_size / n
    return {k: v * scale for k, v in _work(cfg, prompt, resp, crit).items()}


def least_sync_s(cfg: SimConfig) -> float:
    """The least per-iteration sync any schedule pays, in seconds of the whole cluster: the cheapest
    barrier over every train replica count (a sharded optimizer's is cheaper with more ranks: charging
    the one-rank step, 3 s on the H100 profile against 0.5 s at 16 ranks, let shiftable "beat" the
    bound). With staleness >= 1 the barrier may overlap the next iteration: only the train devices are
    busy, so its device-seconds are spread over the cluster."""
    n = cfg.cluster.devices
    g = cfg.cost.train.devices_per_replica
    counts = range(1, max(n // g, 1) + 1)
    if cfg.workload.max_staleness > 0:
        return min(barrier_time(cfg, m) * m * g for m in counts) / n
    return min(barrier_time(cfg, m) for m in counts)


def fluid_bound(cfg: SimConfig, seqs_per_iter: list[list[SeqSpec]] | None = None) -> dict[str, float]:
    """Fluid-bound makespan and tokens/s per device for the run's actual sequences."""
    wl = cfg.workload
    if seqs_per_iter is None:
        seqs_per_iter = [iteration_sequences(wl, k, cfg.seed) for k in range(wl.iterations)]
    n_dev = cfg.cluster.devices
    serial = least_sync_s(cfg)
    total_time, total_tokens = 0.0, 0.0
    per_role = dict.fromkeys(ROLES, 0.0)
    for seqs in seqs_per_iter:
        prompt = np.array([s.prompt_len for s in seqs], dtype=float)
        resp = np.array([s.response_len for s in seqs], dtype=float)
        crit = np.array([s.critique_len for s in seqs], dtype=float)
        w = _work(cfg, prompt, resp, crit)
        for r in ROLES:
            per_role[r] += w[r]
        total_time += cluster_seconds(cfg, sum(w.values())) + serial
        total_tokens += float((prompt + resp).sum())
    return {
        "makespan_s": total_time,
        "tokens_per_s_per_device": total_tokens / total_time / n_dev,
        "work_device_s": per_role,
    }


def latency_bound(cfg: SimConfig, seqs_per_iter: list[list[SeqSpec]] | None = None) -> dict[str, float]:
    """A second lower bound on the makespan: per iteration, no schedule finishes before its slowest
    dependency chain - a sequence's rollout (prefill + decode alone on a replica, batch 1) then its critique,
    then the training of its group's largest item - plus the barrier. Combined with the fluid bound per
    iteration (max of the two) it says how much of the fluid bound's gap is tail latency no scheduler can
    hide. Optimistic: it ignores that the chain's replicas are shared."""
    wl, c = cfg.workload, cfg.cost
    if seqs_per_iter is None:
        seqs_per_iter = [iteration_sequences(wl, k, cfg.seed) for k in range(wl.iterations)]
    serial = least_sync_s(cfg)
    n_dev = cfg.cluster.devices
    total, tight, tokens = 0.0, 0.0, 0.0
    train_rate = c.train.tokens_per_s_per_device * c.train.devices_per_replica
    for seqs in seqs_per_iter:
        groups: dict[str, list[SeqSpec]] = {}
        for s in seqs:
            groups.setdefault(s.group_id, []).append(s)
        chain = 0.0
        for members in groups.values():
            judged = 0.0
            for s in members:
                roll = (s.prompt_len / c.rollout.prefill_tokens_per_s
                        + s.response_len * (c.rollout.decode.a_s + c.rollout.decode.b_s
                                            + c.rollout.decode.c_s * (s.prompt_len + s.response_len / 2)))
                judge = s.prompt_len + s.response_len + wl.judge_template_tokens
                rew = (judge / c.reward.prefill_tokens_per_s
                       + s.critique_len * (c.reward.decode.a_s + c.reward.decode.b_s
                                           + c.reward.decode.c_s * (judge + s.critique_len / 2)))
                judged = max(judged, roll + rew)
            # the group's items may train on several replicas in parallel: only the largest is serial
            train = max(s.prompt_len + s.response_len for s in members) / train_rate
            chain = max(chain, judged + train)
        prompt = np.array([s.prompt_len for s in seqs], dtype=float)
        resp = np.array([s.response_len for s in seqs], dtype=float)
        crit = np.array([s.critique_len for s in seqs], dtype=float)
        fluid_t = cluster_seconds(cfg, sum(_work(cfg, prompt, resp, crit).values()))
        total += chain + serial
        tight += max(chain, fluid_t) + serial
        tokens += float((prompt + resp).sum())
    return {"chain_makespan_s": total, "tight_makespan_s": tight,
            "tokens_per_s_per_device": tokens / tight / n_dev}


def expected_lengths(cfg: SimConfig) -> dict[str, float]:
    wl = cfg.workload
    return {"prompt": mean_length(wl.prompt_len), "response": mean_length(wl.response_len),
            "critique": mean_length(wl.critique_len)}
