"""The GPU memory budget: arithmetic only (no GPU), including the paper configuration on an 80 GB card."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivotrl.config import load_config
from pivotrl.engines.gpu_budget import (
    BudgetError,
    DeviceMemory,
    EngineNeed,
    GiB,
    TierHold,
    engine_budget,
    host_allows_sleep,
    kv_bytes_per_token,
    max_tier_bytes,
)

PAPER = Path(__file__).resolve().parents[2] / "configs" / "qwen2.5-7b_genrm-qwen3-30b-a3b.yaml"
CARD_80GB = DeviceMemory(total_bytes=81559 << 20, free_bytes=81559 << 20)  # an 80 GB A100/H100 (nvidia-smi)
CONTEXT = 600 << 20  # what a process's CUDA context takes before anything is allocated


def qwen_params(
    vocab, hidden, layers, heads, kv_heads, head_dim, mlp, *, experts=0, bias=False, qk_norm=False
):
    """Parameter count of a Qwen2 / Qwen3(-MoE) decoder from its config.json fields (untied embeddings)."""
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    attn += (heads + 2 * kv_heads) * head_dim if bias else 0
    attn += 2 * head_dim if qk_norm else 0
    ffn = experts * 3 * hidden * mlp + hidden * experts if experts else 3 * hidden * mlp
    return 2 * vocab * hidden + layers * (attn + ffn + 2 * hidden) + hidden


# config.json of Qwen/Qwen2.5-7B-Instruct and Qwen/Qwen3-30B-A3B (published model cards: 7.62B, 30.5B)
POLICY_PARAMS = qwen_params(152064, 3584, 28, 28, 4, 128, 18944, bias=True)
JUDGE_PARAMS = qwen_params(151936, 2048, 48, 32, 4, 128, 768, experts=128, qk_norm=True)
POLICY_KV = kv_bytes_per_token(layers=28, kv_heads=4, head_dim=128, dtype_bytes=2)
JUDGE_KV = kv_bytes_per_token(layers=48, kv_heads=4, head_dim=128, dtype_bytes=2)


def test_parameter_counts_match_the_published_sizes():
    assert POLICY_PARAMS == 7_615_616_512
    assert JUDGE_PARAMS == 30_532_122_624
    assert (POLICY_KV, JUDGE_KV) == (57_344, 98_304)


def test_fraction_keeps_the_tier_growth_and_headroom_out_and_passes_vllms_start_check():
    mem = DeviceMemory(total_bytes=80 * GiB, free_bytes=70 * GiB)  # 10 GiB used, 4 of them by the tier
    tier = TierHold(capacity_bytes=8 * GiB, held_bytes=4 * GiB)
    b = engine_budget(mem, tier, headroom_bytes=2 * GiB)
    assert b.reserved_bytes == 6 * GiB and b.engine_bytes == 64 * GiB
    assert b.gpu_memory_utilization == pytest.approx(0.8, abs=1e-4)
    assert b.gpu_memory_utilization * mem.total_bytes <= mem.free_bytes  # vLLM's start-up rule
    empty = engine_budget(DeviceMemory(80 * GiB, 80 * GiB), None)
    assert empty.gpu_memory_utilization <= 0.92  # never the whole card


def test_a_model_that_cannot_fit_is_refused_with_the_numbers():
    mem = DeviceMemory(total_bytes=80 * GiB, free_bytes=79 * GiB)
    judge = EngineNeed(weights_bytes=2 * JUDGE_PARAMS, kv_bytes_per_token=JUDGE_KV, kv_tokens=1)
    with pytest.raises(BudgetError, match=r"reward.engine: needs 62\.1 GB .*gps.device_tier_bytes=34\.4 GB"):
        engine_budget(mem, TierHold(32 * GiB, 0), judge, what="reward.engine")
    with pytest.raises(BudgetError, match="no GPU memory left"):
        engine_budget(DeviceMemory(80 * GiB, 1 * GiB), None)
    with pytest.raises(ValueError, match="not a reading"):
        engine_budget(DeviceMemory(80 * GiB, 81 * GiB), None)


def test_the_paper_config_fits_an_80gb_card():
    """configs/qwen2.5-7b_genrm-qwen3-30b-a3b.yaml on one 80 GB GPU per device, as the runtime runs it:
    each role's engine, with its whole configured KV budget, fits beside the device tier.

    The first version of the config did not: a 32 GiB tier plus the 61 GB judge is more than the card, the
    judge's 524k-token KV budget fits no 80 GB card beside its weights, and the policy's 1M tokens leave
    under 7 GiB for a tier. Those facts are checked below too, so the numbers in the config are explained."""
    cfg = load_config(PAPER)
    assert cfg.models.policy.dtype == cfg.models.genrm.dtype == "bfloat16"
    tier = TierHold(cfg.gps.device_tier_bytes, 0)
    card = DeviceMemory(CARD_80GB.total_bytes, CARD_80GB.total_bytes - CONTEXT)
    policy = EngineNeed(2 * POLICY_PARAMS, POLICY_KV, cfg.rollout.engine.kv_budget_tokens)
    judge = EngineNeed(2 * JUDGE_PARAMS, JUDGE_KV, cfg.reward.engine.kv_budget_tokens)
    assert policy.weights_bytes / 1e9 == pytest.approx(15.23, abs=0.01)
    assert judge.weights_bytes / 1e9 == pytest.approx(61.06, abs=0.01)
    for need, what in ((policy, "rollout.engine"), (judge, "reward.engine")):
        fit = engine_budget(card, tier, need, what=what)
        assert fit.kv_tokens_fit >= need.kv_tokens, what
        assert fit.gpu_memory_utilization * card.total_bytes <= card.free_bytes  # vLLM's start-up rule

    # why not the first numbers
    with pytest.raises(BudgetError, match="reward.engine"):
        engine_budget(card, TierHold(32 * GiB, 0), judge, what="reward.engine")
    alone = engine_budget(card, None, judge)
    assert 160_000 < alone.kv_tokens_fit < 175_000 < 524_288
    assert max_tier_bytes(card.total_bytes, EngineNeed(2 * JUDGE_PARAMS, JUDGE_KV, 524_288)) < 0
    first_policy = EngineNeed(2 * POLICY_PARAMS, POLICY_KV, 1 << 20)
    assert 6 * GiB < max_tier_bytes(card.total_bytes, first_policy) < 7 * GiB


def test_sleeping_into_host_memory_needs_room_there():
    assert host_allows_sleep(15 * GiB, 64 * GiB)
    assert not host_allows_sleep(61 * GiB, 64 * GiB)
    assert not host_allows_sleep(0, 64 * GiB)
