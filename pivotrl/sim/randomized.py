"""Randomized workloads for the property-style benchmark (`python -m benchmarks.sim random`).

Why: a planner tuned on the twelve sweep configs can still lose on shapes the sweep never shows (issue #14:
3 of 11 held-out workloads below the best static split). This module draws whole simulator configs —
workload, cost profile, cluster — deterministically from a seed, over the axes that change which schedule
wins: the shape of the response-length distribution (unimodal, multimodal, near-constant, very heavy
tails), group size (2-64), cluster size (8-1,024 devices), the balance of train vs judge cost, cold or warm
shift costs, and devices per replica.

Realism: every drawn constant is a bounded rescaling of the H100 profile under `configs/sim/profiles/`
(whose constants cite their sources), so a draw is a plausible other model or cluster, never an
impossible one: decode step times stay within 0.5-2x, train speed within 0.3-2x, shift costs between a
warm (device-tier, ~1 s) and a cold (persistent-tier, engine re-creation, ~20-40 s) shift.
The shape of a draw is chosen by `seed % 4`, so any 4 consecutive seeds cover every shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pivotrl.config import read_yaml, validate
from pivotrl.sim.config import SimConfig

ROOT = Path(__file__).resolve().parents[2]
BASE_PROFILE = ROOT / "configs/sim/profiles/h100-qwen2.5-7b-qwen3-30b-a3b.yaml"
SHAPES = ("unimodal", "multimodal", "near_constant", "heavy_tail")


@dataclass(frozen=True)
class DrawLimits:
    """How big a draw may be. `quick` keeps a whole benchmark of 50+ workloads within minutes on 2 CPU
    cores: fewer sequences per device (a realistic RL batch is 64-256 per GPU) and one iteration fewer."""

    seqs_per_device: tuple[int, int]
    max_seqs: int
    iterations: int

    @classmethod
    def of(cls, quick: bool) -> DrawLimits:
        if quick:
            return cls((16, 64), 6144, 2)
        return cls((32, 128), 32768, 3)


@dataclass(frozen=True)
class Draw:
    """What was drawn, in words and numbers (for the benchmark's per-workload rows)."""

    seed: int
    shape: str
    devices: int
    group_size: int
    sequences: int
    train_scale: float
    judge_scale: float
    shift: str
    devices_per_replica: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _log_uniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _response_dist(rng: np.random.Generator, shape: str) -> dict[str, Any]:
    median = _log_uniform(rng, 128, 2048)
    if shape == "unimodal":
        return {"dist": "lognormal", "median": median, "sigma": rng.uniform(0.4, 1.0), "min": 8, "max": 8192}
    if shape == "near_constant":
        return {
            "dist": "lognormal",
            "median": median,
            "sigma": rng.uniform(0.01, 0.06),
            "min": 8,
            "max": 8192,
        }
    if shape == "heavy_tail":
        return {
            "dist": "lognormal",
            "median": _log_uniform(rng, 96, 768),
            "sigma": rng.uniform(1.2, 1.8),
            "min": 8,
            "max": 32768,
        }
    # multimodal: a mixture of 2-3 narrow lognormal modes spread 4-16x apart (e.g. short answers and long
    # chains of thought in one batch), as empirical samples the simulator resamples
    k = int(rng.integers(2, 4))
    spread = _log_uniform(rng, 4, 16)
    lo = max(median / spread, 16.0)
    mids = np.exp(np.linspace(math.log(lo), math.log(lo * spread), k))
    weights = rng.dirichlet(np.ones(k) * 2.0)
    comp = rng.choice(k, size=4000, p=weights)
    x = mids[comp] * np.exp(rng.uniform(0.1, 0.35) * rng.standard_normal(4000))
    samples = np.clip(np.rint(x), 8, 16384).astype(int).tolist()
    return {"dist": "empirical", "samples": samples, "min": 8, "max": 16384}


def _scale_gen(role: dict[str, Any], g: int, base_g: int, step_scale: float) -> None:
    """A replica of `g` devices instead of `base_g` (tensor parallel): weights and KV split across g, so the
    weight-read part of a step scales ~1/g plus a per-step collective, KV capacity grows with g."""
    ratio = base_g / g
    dec = role["decode"]
    comm = 0.0015 if g > 1 else 0.0
    dec["a_s"] = (dec["a_s"] * ratio + comm) * step_scale
    dec["b_s"] = dec["b_s"] * ratio * step_scale
    dec["c_s"] = dec["c_s"] * ratio * step_scale
    role["kv_tokens"] = int(role["kv_tokens"] * g / base_g)
    role["weights_gb"] = role["weights_gb"] * ratio
    role["prefill_tokens_per_s"] = role["prefill_tokens_per_s"] / ratio / step_scale
    role["devices_per_replica"] = g


def draw_config(seed: int, quick: bool = True) -> tuple[SimConfig, Draw]:
    """One workload, a pure function of (`seed`, `quick`)."""
    rng = np.random.default_rng([14, seed])
    lim = DrawLimits.of(quick)
    shape = SHAPES[seed % len(SHAPES)]
    prof = read_yaml(BASE_PROFILE)

    g_roll = int(rng.choice([1, 1, 1, 2]))
    g_rew = int(rng.choice([1, 2, 2, 4]))
    g_train = int(rng.choice([1, 1, 2]))
    devices = round(_log_uniform(rng, 8, 1024))
    devices = max(devices, g_roll + g_rew + g_train)
    group = int(2 ** rng.integers(1, 7))
    spd = _log_uniform(rng, *lim.seqs_per_device)
    seqs = min(int(devices * spd), lim.max_seqs)
    prompts = max(1, round(seqs / group))

    judge_scale = _log_uniform(rng, 0.5, 2.0)  # judge model step cost vs the 30B-A3B reference
    train_scale = _log_uniform(rng, 0.3, 2.0)  # train tokens/s vs the 7B reference
    _scale_gen(prof["rollout"], g_roll, 1, _log_uniform(rng, 0.7, 1.4))
    _scale_gen(prof["reward"], g_rew, 2, judge_scale)
    prof["reward"]["weights_gb"] *= judge_scale
    prof["train"]["tokens_per_s_per_device"] *= train_scale
    prof["train"]["devices_per_replica"] = g_train
    prof["train"]["weights_gb"] /= g_train

    warm = bool(rng.random() < 0.5)
    if warm:  # the role's context stays parked in device memory: only a wake-up and a weight refresh
        prof["gps"]["fetch_tier"] = "device"
        prof["gps"]["offload_s"] = rng.uniform(0.05, 0.3)
        for r in ("rollout", "reward", "train"):
            prof[r]["init_s"] = rng.uniform(0.1, 0.6)
    else:  # cold: weights from host or persistent storage and the engine built again
        prof["gps"]["fetch_tier"] = str(rng.choice(["host", "persistent"]))
        for r in ("rollout", "reward", "train"):
            prof[r]["init_s"] = rng.uniform(2.0, 10.0)

    crit_median = _log_uniform(rng, 96, 1536)
    data = {
        "name": f"random-{seed}-{shape}",
        "seed": seed,
        "cost": prof,
        "cluster": {"devices": devices},
        "workload": {
            "prompts_per_iteration": prompts,
            "group_size": group,
            "iterations": lim.iterations,
            "prompt_len": {
                "dist": "lognormal",
                "median": _log_uniform(rng, 64, 512),
                "sigma": rng.uniform(0.2, 0.6),
                "min": 16,
                "max": 2048,
            },
            "response_len": _response_dist(rng, shape),
            "critique_len": {
                "dist": "lognormal",
                "median": crit_median,
                "sigma": rng.uniform(0.3, 0.9),
                "min": 8,
                "max": 8192,
            },
            "judge_template_tokens": int(rng.integers(64, 512)),
        },
        "scheduler": {"tick_s": 2.0, "horizon_s": 30.0, "hysteresis": 0.05, "cooldown_s": 10.0},
        "search": {
            "exhaustive_max_splits": 64,
            "top_k": 3,
            "max_simulations": 12 if quick else 24,
        },
    }
    cfg = validate(data, SimConfig, source=f"random workload {seed}")
    draw = Draw(
        seed,
        shape,
        devices,
        group,
        prompts * group,
        round(train_scale, 3),
        round(judge_scale, 3),
        "warm" if warm else "cold",
        {"rollout": g_roll, "reward": g_rew, "train": g_train},
    )
    return cfg, draw
