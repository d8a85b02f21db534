"""The few derived quantities of a Qwen2/Llama HF config that more than one engine module reads.

Why a module of its own: the model (`model.py`), its KV cache (`kv_cache.py`) and a model built without
initialisation (`CausalLM.empty`) must agree on them, and the cache must not depend on the model to know
its own shape.
"""

from __future__ import annotations

import torch


def head_dim(config) -> int:
    """Per-head width: the config's `head_dim` where it has one, else hidden_size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_theta(config) -> float:
    """The RoPE base. Only plain RoPE is implemented: a scaled variant would silently change the logits."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", None):
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported by the compact model")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def inv_freq(config) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] in fp32 (on the default device), computed as HF computes
    them, so the rotary tables round the same way."""
    d = head_dim(config)
    return 1.0 / (rope_theta(config) ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
