"""The one place where the simulator's config becomes a `pivotrl.core.Controller`.

Everything the controller is told comes from what a real runtime would know before measuring: the cost
profile's nominal step-time line as the *prior* of each role's throughput model (core then fits it online
from the simulated `on_step` samples), capacities, prefill rates, and the workload's expected lengths for
`IterationPlan`. True lengths stay hidden in the simulator (sequence payloads are never read by core).
"""

from __future__ import annotations

from pivotrl.core import Controller, ControllerConfig, IterationPlan, Role, RoleSpec, make_policy
from pivotrl.core.stage import TAIL_FRACTIONS
from pivotrl.sim.config import SimConfig
from pivotrl.sim.costs import barrier_time, shift_time
from pivotrl.sim.workload import length_profile, mean_length, mean_position


def expected(cfg: SimConfig) -> dict[str, float]:
    wl = cfg.workload
    prompt, resp = mean_length(wl.prompt_len), mean_length(wl.response_len)
    crit = mean_length(wl.critique_len)
    return {"prompt": prompt, "response": resp, "critique": crit,
            "judge_prompt": prompt + resp + wl.judge_template_tokens, "train_item": prompt + resp}


def controller_config(cfg: SimConfig) -> ControllerConfig:
    c, e = cfg.cost, expected(cfg)
    # a decoded token's mean context: its prompt and the tokens generated before it (`mean_position`)
    roll_ctx = e["prompt"] + mean_position(cfg.workload.response_len)
    rew_ctx = e["judge_prompt"] + mean_position(cfg.workload.critique_len)
    # The barrier as core's prior knows it, fixed + shared / m: what a runtime knows from its model size and
    # optimizer layout. Exact for the sharded and the driver-owned barrier from m = 2 on (`barrier_time`).
    b2, b4 = barrier_time(cfg, 2), barrier_time(cfg, 4)
    shared = max(0.0, 4.0 * (b2 - b4))
    fixed = max(0.0, b2 - shared / 2.0)
    roles = {
        Role.ROLLOUT: RoleSpec(
            devices_per_replica=c.rollout.devices_per_replica, max_seqs=c.rollout.max_batch,
            kv_tokens=c.rollout.kv_tokens, prior_step_a_s=c.rollout.decode.a_s,
            prior_step_b_s=c.rollout.decode.b_s + c.rollout.decode.c_s * roll_ctx,
            tokens_per_seq_step=1.0, prefill_tokens_per_s=c.rollout.prefill_tokens_per_s,
            step_context_s=c.rollout.decode.c_s, context_ref_tokens=roll_ctx),
        Role.REWARD: RoleSpec(
            devices_per_replica=c.reward.devices_per_replica, max_seqs=c.reward.max_batch,
            kv_tokens=c.reward.kv_tokens, prior_step_a_s=c.reward.decode.a_s,
            prior_step_b_s=c.reward.decode.b_s + c.reward.decode.c_s * rew_ctx,
            tokens_per_seq_step=1.0, prefill_tokens_per_s=c.reward.prefill_tokens_per_s,
            step_context_s=c.reward.decode.c_s, context_ref_tokens=rew_ctx),
        Role.TRAIN: RoleSpec(
            devices_per_replica=c.train.devices_per_replica, max_seqs=c.train.micro_batch_seqs,
            kv_tokens=1 << 40, prior_step_a_s=1e-3,
            prior_step_b_s=1.0 / (c.train.tokens_per_s_per_device * c.train.devices_per_replica),
            tokens_per_seq_step=e["train_item"],
            prefill_tokens_per_s=c.train.tokens_per_s_per_device * c.train.devices_per_replica,
            sync_fixed_s=fixed, sync_shared_s=shared, whole_batches=True,
            dp_efficiency_per_doubling=c.train.dp_efficiency_per_doubling),
    }
    shift_prior = sum(shift_time(c, r).total for r in ("rollout", "reward", "train")) / 3.0
    s = cfg.scheduler
    return ControllerConfig(roles=roles, horizon_s=s.horizon_s, hysteresis=s.hysteresis,
                            cooldown_s=s.cooldown_s, cooldown_shift_multiple=s.cooldown_shift_multiple,
                            shift_prior_s=shift_prior, kv_reserve=s.kv_reserve,
                            prior_weight=s.prior_weight, max_staleness=cfg.workload.max_staleness)


def build_controller(cfg: SimConfig, mode: str, split: dict[str, int] | None = None) -> Controller:
    """`split`: devices per role (disaggregated), or per role *group* for `grouped`, a group named by its
    roles joined with "+" in the order it time-shares them (e.g. {"rollout+train": 1, "reward": 1})."""
    if mode == "disaggregated":
        policy = make_policy(mode, static_split=split)
    elif mode == "grouped":
        policy = make_policy(mode, groups=[(tuple(k.split("+")), n) for k, n in (split or {}).items()])
    else:
        policy = make_policy(mode)
    devices = [f"d{i}" for i in range(cfg.cluster.devices)]
    return Controller(policy, devices=devices, config=controller_config(cfg))


def iteration_plan(cfg: SimConfig, iteration: int, iterations: int | None = None) -> IterationPlan:
    """The plan core gets: expected lengths (means, tails, the longest of the iteration's count) from the
    configured distributions, as a runtime would know them from its history; never the drawn lengths.
    `iterations`: the run's length (the workload's by default), so core knows its last iteration."""
    wl, e = cfg.workload, expected(cfg)
    n = wl.prompts_per_iteration * wl.group_size
    ro_tail, ro_max = length_profile(wl.response_len, n, TAIL_FRACTIONS)
    rw_tail, rw_max = length_profile(wl.critique_len, n, TAIL_FRACTIONS)
    return IterationPlan(iteration, rollout_seqs=n,
                         group_size=wl.group_size, rollout_tokens_per_seq=e["response"],
                         reward_tokens_per_rollout=e["critique"],
                         train_tokens_per_group=wl.group_size * e["train_item"],
                         rollout_prompt_tokens=e["prompt"], reward_prompt_tokens=e["judge_prompt"],
                         rollout_tokens_tail=ro_tail, reward_tokens_tail=rw_tail,
                         rollout_tokens_longest=ro_max, reward_tokens_longest=rw_max,
                         last_iteration=iteration == (iterations or wl.iterations) - 1)
