"""GRPO trainer: advantages, elastic gradient equality, NaN guard, checkpoint/restore."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from pivotrl.engines.grpo_loss import (
    TrainSample,
    compute_advantages,
    compute_grad_sum,
    reduce,
    token_logprobs,
)
from pivotrl.engines.trainer import GRPOTrainer

VOCAB = 24
PAD = 0


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg).to(dtype)


def random_samples(n: int, seed: int, model: torch.nn.Module | None = None) -> list[TrainSample]:
    """Samples with varied prompt/response lengths; old logprobs near the model's own (off-policy a bit)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))]
        resp = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 9))]
        old = None
        if model is not None:
            with torch.no_grad():
                lp = token_logprobs(model, torch.tensor([prompt + resp]))[0, len(prompt) - 1 :]
            old = [float(v) + rng.uniform(-0.3, 0.3) for v in lp]
        out.append(TrainSample(prompt, resp, advantage=rng.uniform(-2, 2), old_logprobs=old))
    return out


def test_advantages_are_group_normalised():
    adv = compute_advantages([1, 0, 1, 1, 0.5, 0.5], ["a", "a", "b", "b", "c", "c"])
    assert adv[0] == pytest.approx(1.0, abs=1e-5) and adv[1] == pytest.approx(-1.0, abs=1e-5)
    assert adv[2:] == [0.0, 0.0, 0.0, 0.0]  # no preference within a uniform group
    adv = compute_advantages([3.0, 1.0, 2.0], [0, 0, 0], scale_by_std=False)
    assert adv == [1.0, -1.0, 0.0]
    with pytest.raises(ValueError):
        compute_advantages([1.0], [0, 1])


@pytest.mark.parametrize("replicas", [1, 2, 3, 7])
def test_elastic_gradient_equals_single_replica(replicas):
    """Disjoint shares of one iteration on any number of replicas, reduced, give the single-replica grad."""
    model = tiny_model(dtype=torch.float64)
    samples = random_samples(12, seed=1, model=model)
    single = compute_grad_sum(model, samples, pad_id=PAD, micro_batch=4, loss=_loss())
    rng = random.Random(replicas)
    idx = list(range(len(samples)))
    rng.shuffle(idx)
    shares = [idx[r::replicas] for r in range(replicas)]
    parts = [
        compute_grad_sum(
            model, [samples[i] for i in share], pad_id=PAD, micro_batch=rng.randint(1, 5), loss=_loss()
        )
        for share in shares
    ]
    rng.shuffle(parts)
    total = reduce(parts)
    assert total.tokens == single.tokens == sum(s.num_tokens for s in samples)
    assert total.samples == single.samples == len(samples)
    for name, g in single.grads.items():
        got, want = total.grads[name] / total.tokens, g / single.tokens
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-13), name
    assert any(float(g.abs().max()) > 1e-6 for g in single.grads.values())  # the test is not vacuous
    assert total.loss_sum == pytest.approx(single.loss_sum, rel=1e-10)
    assert total.clipped == single.clipped and single.clipped > 0  # clipping is exercised, and elastic too


def _loss():
    from pivotrl.engines.grpo_loss import LossConfig

    return LossConfig(clip_eps=0.2, kl_coef=0.0)


def test_elastic_apply_gives_identical_weights():
    """The optimizer owner applying a 3-way reduction steps to the same weights as a single replica."""
    a, b = tiny_model(dtype=torch.float64), tiny_model(dtype=torch.float64)
    samples = random_samples(12, seed=2, model=a)
    ta = GRPOTrainer(a, pad_id=PAD, lr=1e-2, micro_batch=5)
    tb = GRPOTrainer(b, pad_id=PAD, lr=1e-2, micro_batch=2)
    sa = ta.step(samples)
    sb = tb.apply(reduce(compute_grad_sum(b, samples[i::3], pad_id=PAD, micro_batch=2) for i in range(3)))
    assert not sa.skipped and not sb.skipped and sa.version == sb.version == 1
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.allclose(pa, pb, rtol=1e-9, atol=1e-12), n


def test_positive_advantage_raises_logprob():
    model = tiny_model()
    s = TrainSample([3, 4], [5, 6, 7], advantage=1.0)
    neg = TrainSample([3, 4], [9, 9, 9], advantage=-1.0)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        before = float(token_logprobs(model, ids)[0, 1:].sum())
    trainer = GRPOTrainer(model, pad_id=PAD, lr=1e-2)
    for _ in range(5):
        st = trainer.step([s, neg])
    with torch.no_grad():
        assert float(token_logprobs(model, ids)[0, 1:].sum()) > before + 0.1
    assert st.version == 5 and st.tokens == 6


def test_nan_guard_skips_step_and_says_so(caplog):
    model = tiny_model()
    trainer = GRPOTrainer(model, pad_id=PAD, lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = [TrainSample([1, 2], [3, 4], advantage=float("nan")), TrainSample([1], [5], advantage=1.0)]
    with caplog.at_level("WARNING"):
        stats = trainer.step(bad)
    assert stats.skipped and "non-finite" in stats.reason and stats.version == 0
    assert "skipped" in caplog.text
    assert trainer.skipped_steps == 1 and trainer.version == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not trainer.optimizer.state  # AdamW moments untouched
    good = trainer.step([TrainSample([1, 2], [3, 4], advantage=1.0), TrainSample([1], [5], advantage=-1.0)])
    assert not good.skipped and good.version == 1 and math.isfinite(good.grad_norm)


def test_inf_logprob_is_guarded():
    model = tiny_model()
    trainer = GRPOTrainer(model, pad_id=PAD)
    stats = trainer.step([TrainSample([1, 2], [3], advantage=1.0, old_logprobs=[float("-inf")])])
    assert stats.skipped and trainer.version == 0


def test_checkpoint_restore_gives_identical_next_step(tmp_path):
    model = tiny_model(seed=3)
    b1, b2 = random_samples(8, seed=4, model=model), random_samples(8, seed=5)
    t1 = GRPOTrainer(model, pad_id=PAD, lr=3e-3, micro_batch=3, weight_decay=0.01, warmup_steps=4)
    t1.step(b1)
    t1.save_checkpoint(tmp_path / "ckpt")
    t1.step(b2)
    restored = GRPOTrainer(
        tiny_model(seed=99), pad_id=PAD, lr=3e-3, micro_batch=3, weight_decay=0.01, warmup_steps=4
    )
    restored.load_checkpoint(tmp_path / "ckpt")
    assert restored.version == 1
    restored.step(b2)
    assert restored.version == t1.version == 2
    for (n, pa), pb in zip(t1.model.state_dict().items(), restored.model.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), n


def test_kl_to_reference():
    model, ref = tiny_model(seed=5), tiny_model(seed=5)
    samples = random_samples(4, seed=6)
    with pytest.raises(ValueError):
        GRPOTrainer(tiny_model(), pad_id=PAD, kl_coef=0.1).step(samples)
    t = GRPOTrainer(model, pad_id=PAD, kl_coef=0.1, ref_model=ref, lr=5e-2)
    first = t.step(samples)
    assert first.kl_ref == pytest.approx(0.0, abs=1e-9)  # identical weights: KL is 0
    second = t.step(samples)
    assert second.kl_ref > 0.0 and not any(p.requires_grad for p in ref.parameters())
