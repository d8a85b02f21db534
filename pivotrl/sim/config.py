"""Typed simulator configuration: a workload, a cluster, a cost profile and scheduler knobs.

A simulator config names a *cost profile* (``profile: profiles/x.yaml``, relative to the config file) that
holds every hardware/model constant with its public source; the config's own ``cost:`` mapping is
deep-merged on top, so a what-if ("twice the PCIe bandwidth") is a one-line override. Everything is validated
by pydantic through `pivotrl.config.validate`, so a bad field is one line naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from pivotrl.config import MAX_GROUP, MAX_PROMPTS, Section, apply_overrides, read_yaml, validate
from pivotrl.errors import UserError

ROLES = ("rollout", "reward", "train")


#: Sequences of one iteration the simulator may hold (each is a few objects in memory).
MAX_SEQUENCES = 10_000_000


class LengthDist(Section):
    """A token-length distribution: lognormal (median, sigma), constant, uniform or empirical samples."""

    dist: Literal["lognormal", "constant", "uniform", "empirical"] = "lognormal"
    median: float = Field(512.0, gt=0)
    sigma: float = Field(0.8, ge=0)
    value: int = Field(512, ge=1, description="for dist=constant")
    low: int = Field(1, ge=1, description="for dist=uniform")
    high: int = Field(1024, ge=1, description="for dist=uniform")
    samples: list[int] = Field(default_factory=list, description="for dist=empirical (resampled)")
    min: int = Field(1, ge=1)
    max: int = Field(32768, ge=1)

    @model_validator(mode="after")
    def _check(self) -> LengthDist:
        if self.min > self.max:
            raise ValueError("min must be <= max")
        if self.dist == "empirical" and not self.samples:
            raise ValueError("dist=empirical needs a non-empty samples list")
        if self.dist == "uniform" and self.low > self.high:
            raise ValueError("uniform needs low <= high")
        return self

    def upper(self) -> int:
        """The longest length a draw can take (every draw is clipped to [min, max])."""
        top = {"constant": self.value, "uniform": self.high,
               "empirical": max(self.samples, default=self.max)}.get(self.dist, self.max)
        return min(max(top, self.min), self.max)


class WorkloadConfig(Section):
    # the simulator holds every sequence of an iteration in memory (`SimConfig` bounds their product)
    prompts_per_iteration: int = Field(512, ge=1, le=MAX_PROMPTS)
    group_size: int = Field(16, ge=1, le=MAX_GROUP)
    iterations: int = Field(2, ge=1)
    prompt_len: LengthDist = LengthDist(median=256, sigma=0.5, max=4096)
    response_len: LengthDist = LengthDist(median=1024, sigma=0.8, max=8192)
    critique_len: LengthDist = LengthDist(median=512, sigma=0.6, max=4096)
    judge_template_tokens: int = Field(128, ge=0, description="GenRM instructions around prompt+response")
    max_staleness: int = Field(
        0, ge=0, le=2, description="the runtime's run.max_staleness: how many policy versions a rollout may "
        "lag on-policy (0 = on-policy; k >= 1: iteration i+1 generates while iteration i judges and trains)")


class DecodeCost(Section):
    """Decode step time of one replica: a + b*batch + c*context_tokens (seconds)."""

    a_s: float = Field(..., ge=0, description="fixed per-step time: weight reads + launch")
    b_s: float = Field(..., ge=0, description="per sequence in the batch: FLOPs, sampling")
    c_s: float = Field(..., ge=0, description="per context token in the batch: KV-cache reads")


class GenRoleCost(Section):
    devices_per_replica: int = Field(1, ge=1)
    max_batch: int = Field(256, ge=1)
    kv_tokens: int = Field(200_000, ge=1, description="KV-cache capacity of one replica in tokens")
    decode: DecodeCost
    prefill_tokens_per_s: float = Field(..., gt=0, description="per replica")
    weights_gb: float = Field(..., ge=0, description="bytes one device must load to host this role (GB)")
    init_s: float = Field(0.0, ge=0, description="engine start/wake after the weights arrive")


class TrainRoleCost(Section):
    devices_per_replica: int = Field(1, ge=1)
    tokens_per_s_per_device: float = Field(..., gt=0)
    dp_efficiency_per_doubling: float = Field(1.0, gt=0, le=1.0)
    micro_batch_seqs: int = Field(16, ge=1)
    weights_gb: float = Field(..., ge=0, description="per device: weights + optimizer shard (GB)")
    init_s: float = Field(0.0, ge=0)


class Tier(Section):
    bandwidth_gb_s: float = Field(..., gt=0)
    latency_s: float = Field(0.0, ge=0)


class GPSCost(Section):
    fetch_tier: Literal["device", "host", "persistent", "peer"] = "host"
    tiers: dict[str, Tier] = Field(default_factory=dict)
    offload_s: float = Field(0.0, ge=0, description="release a role's memory before the next role loads")

    @model_validator(mode="after")
    def _check(self) -> GPSCost:
        if self.fetch_tier not in self.tiers:
            raise ValueError(f"fetch_tier {self.fetch_tier!r} is not among tiers {sorted(self.tiers)}")
        return self


class IterationCost(Section):
    optimizer_step_s: float = Field(0.0, ge=0)
    grad_allreduce_gb: float = Field(0.0, ge=0, description="gradient bytes reduced once per iteration")
    allreduce_gb_s: float = Field(100.0, gt=0)
    publish_s: float = Field(0.0, ge=0, description="new policy version -> GPS, commit")
    weight_sync_s: float = Field(0.0, ge=0, description="a rollout replica picks up the new version")
    optimizer_owner: Literal["driver", "sharded"] = Field(
        "sharded", description="sharded: the train group's ZeRO-1 step (optimizer step and publish divided "
        "over the ranks, bucketed all-reduce); driver: one process steps and publishes the whole model")
    bucket_gb: float = Field(0.1, gt=0, description="all-reduce bucket size (sharded)")
    collective_latency_s: float = Field(0.0, ge=0, description="fixed cost of one collective (sharded)")
    commit_s: float = Field(0.0, ge=0, description="rank 0 committing the sharded version's manifest")
    control_s: float = Field(0.0, ge=0, description="the control plane's part of the barrier, whatever the "
                             "owner: asking the train replicas for their sums and handing them in, the "
                             "driver's bookkeeping, the next iteration's first request reaching the "
                             "scheduler")


class CostProfile(Section):
    gpu: str = Field("H100-SXM-80GB", description="the device the profile describes (a label in reports)")
    rollout: GenRoleCost
    reward: GenRoleCost
    train: TrainRoleCost
    gps: GPSCost
    iteration: IterationCost = IterationCost()
    abort_s: float = Field(0.0, ge=0, description="per aborted batch: engine bookkeeping")
    control_cores: float = Field(
        0.0, ge=0, description="cores' worth of control-plane work (scheduler, driver) on the devices' own "
        "cores, as on a CPU cluster whose devices are one host's cores: busy devices slow down when fewer "
        "cores than this are idle (`costs.shared_core_slowdown`); 0 where devices are accelerators")


class ClusterConfig(Section):
    devices: int = Field(32, ge=1)
    devices_per_node: int = Field(
        8, ge=1, description="not supported yet: the simulator does not model nodes"
    )


class SchedulerConfig(Section):
    tick_s: float = Field(2.0, gt=0)
    horizon_s: float = Field(30.0, gt=0)
    hysteresis: float = Field(0.05, ge=0)
    cooldown_s: float = Field(10.0, ge=0)
    cooldown_shift_multiple: float = Field(
        3.0, ge=0, description="after a shift, a device is locked for the shorter of cooldown_s and this "
        "multiple of the shift's duration; 0: cooldown_s after every shift")
    progress_s: float = Field(5.0, gt=0, description="how often engines report per-sequence progress")
    expected_lengths: Literal["mean", "none"] = Field(
        "mean", description="what the driver tells core per sequence: the workload's mean length, or "
        "nothing (core then assumes half the remaining budget)")
    kv_reserve: Literal["budget", "expected"] = Field(
        "expected", description="core's KV admission: whole budget, or prompt + expected length (vLLM-like)")
    prior_weight: float = Field(
        1e9, gt=0, description="core's ControllerConfig.prior_weight: weighted step samples before the "
        "throughput fit's own slope replaces the cost profile's (the fit's weights decay 0.95 per sample, so "
        "anything above 20 means never: the profile's step-time shape, which holds the mean context cost, is "
        "only scaled to the measured step time), as a slope fitted on a stage's first short-context steps "
        "under-predicts tail step times "
        "(see docs/decisions.md#the-simulator-never-replaces-the-profiles-slope)")
    dispatch_batch_s: float = Field(
        0.02, ge=0, description="results are reported in batches: dispatch runs at most once per window")


class SearchConfig(Section):
    exhaustive_max_splits: int = Field(64, ge=1, description="simulate every split when there are this few")
    top_k: int = Field(6, ge=1, description="else: simulate the analytically best K and hill-climb")
    max_simulations: int = Field(40, ge=1, description="cap on simulated splits during the hill-climb")
    iterations: int | None = Field(
        None, ge=1, description="iterations per split during the search; null (the default): all of the "
        "run's, so that the baseline is the best split on what the runs are measured on. One iteration "
        "cannot see a split that pays in a later one, nor, with staleness, the overlap of iterations at all "
        "(see docs/decisions.md#the-static-search-simulates-the-whole-run)")


class SimConfig(Section):
    name: str = "sim"
    seed: int = 0
    cluster: ClusterConfig = ClusterConfig()
    workload: WorkloadConfig = WorkloadConfig()
    cost: CostProfile
    scheduler: SchedulerConfig = SchedulerConfig()
    search: SearchConfig = SearchConfig()
    static_split: dict[str, int] | None = Field(
        None, description="devices per role of the static (disaggregated) baseline; None: searched"
    )
    max_sim_time_s: float = Field(1e7, gt=0, description="safety stop for a run that cannot finish")

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        c = self.cost
        if self.cluster.devices_per_node != ClusterConfig.model_fields["devices_per_node"].default:
            raise ValueError("cluster.devices_per_node: not supported yet (the simulator does not model "
                             "nodes); remove it")
        # Fewer devices than one replica per role is allowed (e.g. 2 CPU workers, 3 roles): colocated and
        # shiftable time-share them, and the static baseline groups roles on devices (`compare`).
        need = max(c.reward.devices_per_replica, c.rollout.devices_per_replica, c.train.devices_per_replica)
        if self.cluster.devices < need:
            raise ValueError(f"cluster.devices must be >= {need} (one replica of the largest role)")
        seqs = self.workload.prompts_per_iteration * self.workload.group_size
        if seqs > MAX_SEQUENCES:
            raise ValueError(f"workload.prompts_per_iteration: x group_size is {seqs} sequences an "
                             f"iteration; the simulator holds at most {MAX_SEQUENCES}")
        # Every sequence reserves its whole budget (`max`) after its prompt, as the engines do: the longest
        # must fit one replica's KV cache, or the run fails at its first such sequence.
        w = self.workload
        prompt = w.prompt_len.upper()
        needs = {
            "rollout": ("workload.response_len.max", prompt + w.response_len.max),
            "reward": ("workload.critique_len.max",
                       prompt + w.response_len.upper() + w.judge_template_tokens + w.critique_len.max),
        }
        for role, (field, need) in needs.items():
            held = getattr(c, role).kv_tokens
            if need > held:
                raise ValueError(f"{field}: the longest {role} sequence needs {need} KV tokens (prompt and "
                                 f"budget); a {role} replica holds {held} (cost.{role}.kv_tokens)")
        if self.static_split is not None:
            bad = sorted(set(self.static_split) - set(ROLES))
            if bad:
                raise ValueError(f"static_split has unknown role(s) {bad}")
            if sum(self.static_split.values()) > self.cluster.devices:
                raise ValueError(f"static_split: {self.static_split} uses more than cluster.devices "
                                 f"({self.cluster.devices})")
        return self


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_sim_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> SimConfig:
    """Read a simulator YAML (+ its cost profile), apply `--set` overrides, validate; `UserError` if bad."""
    p = Path(path)
    data = read_yaml(p)
    profile = data.pop("profile", None)
    if profile is not None:
        if not isinstance(profile, str):
            raise UserError(f"{p}: profile: expected a path to a cost-profile YAML")
        prof_path = (p.parent / profile) if not Path(profile).is_absolute() else Path(profile)
        if not prof_path.is_file():
            raise UserError(f"{p}: profile: file not found: {prof_path}")
        prof = read_yaml(prof_path)
        cost = data.get("cost") or {}
        if not isinstance(cost, dict):
            raise UserError(f"{p}: cost: expected a mapping")
        data["cost"] = _deep_merge(prof, cost)
    apply_overrides(data, list(overrides))
    return validate(data, SimConfig, source=str(p))
