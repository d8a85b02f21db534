"""The tiny bootstrap every recipe test shares: a 1-layer model shape and SFT settings that train in seconds
(a policy that answers some prompts, a judge too short-trained to agree), so a test only states what its
run is about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pivotrl.config import PipelineConfig, load_config

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}

#: A few RL prompts of short lists, with budgets that fit them.
RUN = [
    "train.sft.steps=40",
    "reward.sft.steps=2",
    "train.sft.examples=400",
    "reward.sft.examples=20",
    "train.sft.batch_size=16",
    "reward.sft.batch_size=2",
    "task.prompts_per_iteration=4",
    "task.group_size=4",
    "task.options={max_size: 4}",
    "rollout.sampling.max_new_tokens=10",
    "reward.sampling.max_new_tokens=12",
    "train.micro_batch=5",
    "train.lr=0.01",
]


def tiny_config(root: Path | str, sets: list[str]) -> PipelineConfig:
    """`RUN` under `root`, then `sets` (later settings win), with the tiny model shape for both models."""
    cfg = load_config(None, PipelineConfig, [f"run.storage_root={root}", *RUN, *sets])
    cfg.train.sft.shape = dict(TINY)
    cfg.reward.sft.shape = dict(TINY)
    return cfg


def tiny_bootstrap(root: Path | str, sets: list[str]) -> tuple[PipelineConfig, Any]:
    """`tiny_config` and its bootstrap models (cached under `root`)."""
    from pivotrl.engines.bootstrap import ensure_bootstrap

    cfg = tiny_config(root, sets)
    return cfg, ensure_bootstrap(cfg, parallel=False, log=lambda *_: None)
