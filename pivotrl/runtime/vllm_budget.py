"""The GPU memory budget of a vLLM role on this worker: measured facts in, `gpu_budget` arithmetic out.

Why here (runtime, not engines): the facts come from the worker — free device memory as the driver sees
it, what the GPS device tier holds and may still grow by, the model's KV shape from its HF config — and
the answer (vLLM's `gpu_memory_utilization`) is passed to the engine, which knows nothing of the store.
"""

from __future__ import annotations

from typing import Any

from pivotrl.engines.device_memory import read_cuda_memory, tier_hold
from pivotrl.engines.gpu_budget import DEFAULT_CEILING, Budget, EngineNeed, engine_budget, kv_bytes_per_token

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CPU_FALLBACK = 0.5  # no CUDA reading (a CPU test with a fake vllm): the engine's old fixed share


def kv_shape_bytes(hf_config: Any, dtype: str) -> int:
    """KV bytes per cached token, from an HF decoder config (GQA aware; `head_dim` when it is explicit)."""
    heads = int(hf_config.num_attention_heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    if dtype == "auto":
        dtype = str(getattr(hf_config, "torch_dtype", "bfloat16") or "bfloat16").removeprefix("torch.")
    return kv_bytes_per_token(int(hf_config.num_hidden_layers), kv_heads, head_dim, DTYPE_BYTES.get(dtype, 2))


def vllm_utilization(
    spec: dict[str, Any], env: Any, weights_bytes: int, kv_tokens: int, role: str
) -> tuple[Budget | None, float]:
    """(the budget, the fraction to start vLLM with). `spec["gpu_memory_utilization"]`, when given, is a
    ceiling, not a fixed share. Raises `gpu_budget.BudgetError` (one line, numbers) when it cannot fit."""
    ceiling = float(spec.get("gpu_memory_utilization", DEFAULT_CEILING))
    mem = read_cuda_memory(env.device)
    if mem is None:
        return None, min(ceiling, CPU_FALLBACK)
    from pivotrl.engines.checkpoints import load_config

    need = EngineNeed(
        weights_bytes=weights_bytes,
        kv_bytes_per_token=kv_shape_bytes(load_config(spec["hf_dir"]), str(spec.get("dtype", "auto"))),
        kv_tokens=kv_tokens,
    )
    budget = engine_budget(
        mem, tier_hold(env.gps.device_tier, env.device), need, ceiling=ceiling, what=f"{role}.engine"
    )
    return budget, budget.gpu_memory_utilization
