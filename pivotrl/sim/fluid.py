"""The fluid bound: every device busy at its role's peak efficiency throughout, no tails, no shift cost.

Each role's work is converted to device-seconds at the role's *peak* per-device rate (decode at the largest
batch the KV cache allows, prefill at its rate, training at single-replica tokens/s), summed over roles and
divided by the device count. The per-iteration optimizer step + publish is serial in every paradigm
(on-policy), so it is added once per iteration. No real schedule can beat this.
"""

from __future__ import annotations

import numpy as np

from pivotrl.sim.config import ROLES, SimConfig
from pivotrl.sim.costs import peak_decode_tps_per_device
from pivotrl.sim.workload import SeqSpec, iteration_sequences, mean_length


def _work(cfg: SimConfig, prompt: np.ndarray, resp: np.ndarray, crit: np.ndarray) -> dict[str, float]:
    c = cfg.cost
    tmpl = cfg.workload.judge_template_tokens
    roll_ctx = float(np.mean(prompt + 0.5 * resp))
    judge = prompt + resp + tmpl
    rew_ctx = float(np.mean(judge + 0.5 * crit))
    roll = (resp.sum() / peak_decode_tps_per_device(c.rollout, roll_ctx)
            + prompt.sum() / c.rollout.prefill_tokens_per_s * c.rollout.devices_per_replica)
    rew = (crit.sum() / peak_decode_tps_per_device(c.reward, rew_ctx)
           + judge.sum() / c.reward.prefill_tokens_per_s * c.reward.devices_per_replica)
    train = (prompt + resp).sum() / c.train.tokens_per_s_per_device
    return {"rollout": float(roll), "reward": float(rew), "train": float(train)}


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


def fluid_bound(cfg: SimConfig, seqs_per_iter: list[list[SeqSpec]] | None = None) -> dict[str, float]:
    """Fluid-bound makespan and tokens/s per device for the run's actual sequences."""
    wl = cfg.workload
    if seqs_per_iter is None:
        seqs_per_iter = [iteration_sequences(wl, k, cfg.seed) for k in range(wl.iterations)]
    n_dev = cfg.cluster.devices
    serial = cfg.cost.iteration.optimizer_step_s + cfg.cost.iteration.publish_s
    total_time, total_tokens = 0.0, 0.0
    per_role = dict.fromkeys(ROLES, 0.0)
    for seqs in seqs_per_iter:
        prompt = np.array([s.prompt_len for s in seqs], dtype=float)
        resp = np.array([s.response_len for s in seqs], dtype=float)
        crit = np.array([s.critique_len for s in seqs], dtype=float)
        w = _work(cfg, prompt, resp, crit)
        for r in ROLES:
            per_role[r] += w[r]
        total_time += sum(w.values()) / n_dev + serial
        total_tokens += float((prompt + resp).sum())
    return {
        "makespan_s": total_time,
        "tokens_per_s_per_device": total_tokens / total_time / n_dev,
        "work_device_s": per_role,
    }


def expected_lengths(cfg: SimConfig) -> dict[str, float]:
    wl = cfg.workload
    return {"prompt": mean_length(wl.prompt_len), "response": mean_length(wl.response_len),
            "critique": mean_length(wl.critique_len)}
