"""Tiny HF-format models, the char tokenizer, and the compact model's equality with transformers."""

from __future__ import annotations

import pytest
import torch

from pivotrl.engines.checkpoints import (
    BOS_ID,
    EOS_ID,
    MODEL_SIZES,
    build_tokenizer,
    create_model,
    ensure_model,
    init_state_dict,
    load_state_dict,
    make_config,
)
from pivotrl.engines.kv_cache import KVSlots
from pivotrl.engines.model import CausalLM, num_parameters


def test_tokenizer_roundtrip_and_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = build_tokenizer()
    text = "sort 3 9 1 4=\n1 3 4 9 ~!{}"
    ids = tok(text)["input_ids"]
    assert ids[0] == BOS_ID and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").exists()
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == ids
    assert loaded.eos_token_id == EOS_ID and loaded.pad_token_id == 0
    assert loaded.decode([*ids, EOS_ID], skip_special_tokens=True) == text


@pytest.mark.parametrize(("size", "low", "high"), [("debug", 0.5e6, 2e6), ("small", 10e6, 30e6)])
def test_model_sizes(size, low, high):
    model = CausalLM.from_config(make_config(size), device="meta")
    assert low <= num_parameters(model) <= high
    assert set(MODEL_SIZES) >= {"debug", "small"}


def test_create_model_is_deterministic_and_loadable(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    a = create_model("debug", tmp_path / "a", seed=3)
    b = create_model("debug", tmp_path / "b", seed=3)
    c = create_model("debug", tmp_path / "c", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert AutoConfig.from_pretrained(a).model_type == "qwen2"
    assert AutoTokenizer.from_pretrained(a)("12")["input_ids"][1:] == build_tokenizer()("12")["input_ids"][1:]
    sd = load_state_dict(a)
    assert torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    again = ensure_model(tmp_path, "m", "debug", seed=3)
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert ensure_model(tmp_path, "m", "debug", seed=3) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime
    assert (again / "model.safetensors").read_bytes() == (a / "model.safetensors").read_bytes()


def _random_weights(config, seed):
    """Init weights with a larger spread (and non-zero biases/norms) so the comparison is not trivial."""
    sd = init_state_dict(config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    out = {}
    for k, v in sd.items():
        if k == "lm_head.weight" and config.tie_word_embeddings:
            continue
        out[k] = v * 5 if v.abs().sum() else v + 0.1 * torch.randn(v.shape, generator=gen)
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_empty_model_loads_to_the_same_model_as_from_config(dtype):
    config = make_config("debug")
    sd = init_state_dict(config, seed=3)
    ref = CausalLM.from_config(config, dtype=dtype).eval()
    ref.load_state_dict(sd)
    model = CausalLM.empty(config, dtype=dtype).eval()
    model.load_state_dict(sd)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.inv_freq.dtype == torch.float32
    assert torch.equal(model.inv_freq, CausalLM.from_config(config).inv_freq)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids)
    if dtype == torch.float32:
        with torch.no_grad():
            assert torch.equal(got, ref(ids))
    assert torch.isfinite(got).all()


@pytest.mark.parametrize(("arch", "tied"), [("qwen2", True), ("qwen2", False), ("llama", True)])
def test_logits_equal_transformers(arch, tied):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    config = make_config("debug", arch)
    config.tie_word_embeddings = tied
    sd = _random_weights(config, seed=7)
    hf_cls = Qwen2ForCausalLM if arch == "qwen2" else LlamaForCausalLM
    hf = hf_cls(config).eval()
    hf_keys = {k: v.shape for k, v in hf.state_dict().items()}
    ours = CausalLM.from_config(config).eval()
    assert {k: v.shape for k, v in ours.state_dict().items()} == hf_keys
    ours.load_state_dict(sd)
    hf.load_state_dict(sd)
    ids = torch.randint(0, config.vocab_size, (3, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids)
    assert expected.abs().max() > 1.0  # logits are not trivially tiny
    assert (got - expected).abs().max().item() <= 1e-4


def test_cached_prefill_and_decode_match_full_forward():
    config = make_config("debug")
    model = CausalLM.from_config(config).eval()
    model.load_state_dict(_random_weights(config, seed=1))
    ids = torch.randint(4, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    cache = KVSlots(config, slots=2, max_len=32, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        full = model(ids)
        # Row 0 prefilled with 12 tokens, row 1 with 9 (right padded), then decode the rest step by step.
        lens = torch.tensor([12, 9])
        batch = torch.stack([ids[0, :12], torch.cat([ids[1, :9], torch.zeros(3, dtype=ids.dtype)])])
        first = model.prefill(batch, lens - 1, cache, slot0=0)
        assert torch.allclose(first[0], full[0, 11], atol=1e-4)
        assert torch.allclose(first[1], full[1, 8], atol=1e-4)
        for _ in range(6):
            logits = model.decode(ids[[0, 1], lens], lens, cache)
            assert torch.allclose(logits[0], full[0, lens[0]], atol=1e-4)
            assert torch.allclose(logits[1], full[1, lens[1]], atol=1e-4)
            lens = lens + 1


def test_training_forward_has_gradients():
    config = make_config("debug")
    model = CausalLM.from_config(config)
    model.load_state_dict(init_state_dict(config, 0))
    ids = torch.randint(4, config.vocab_size, (2, 8))
    loss = torch.nn.functional.cross_entropy(
        model(ids)[:, :-1].reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1)
    )
    loss.backward()
    assert model.model.embed_tokens.weight.grad is not None
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_packed_inference_matches_and_follows_weight_changes():
    config = make_config("debug")
    model = CausalLM.from_config(config).eval()
    model.load_state_dict(_random_weights(config, seed=2))
    ids = torch.randint(4, config.vocab_size, (3, 15), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(ids)
    if not model.pack_for_inference():
        pytest.skip("oneDNN packing unavailable in this torch build")
    with torch.no_grad():
        assert torch.allclose(model(ids), plain, rtol=1e-5, atol=1e-4)
        new = _random_weights(config, seed=3)
        model.load_state_dict(new)  # the packed copies must notice and refresh
        packed_new = model(ids)
    fresh = CausalLM.from_config(config).eval()
    fresh.load_state_dict(new)
    with torch.no_grad():
        assert torch.allclose(packed_new, fresh(ids), rtol=1e-5, atol=1e-4)
    loss = model(ids).float().logsumexp(-1).mean()  # grad enabled: plain path, gradients flow
    loss.backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None


def test_fused_inference_path_equals_training_path_and_tracks_updates():
    """No-grad calls run q/k/v and gate/up fused; they must equal the per-layer (autograd) path, and follow
    an optimizer step and a dtype change without going stale."""
    config = make_config("debug")
    model = CausalLM.from_config(config)
    model.load_state_dict(_random_weights(config, seed=4))
    ids = torch.randint(4, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(ids)  # not enabled: a trainer's no-grad pass builds no fused copy
    assert model.model.layers[0].self_attn.qkv._state is None
    model.pack_for_inference()
    with torch.no_grad():
        fused = model(ids)
    assert model.model.layers[0].self_attn.qkv._state is not None
    unfused = model(ids)  # grad enabled: one call per Linear
    assert torch.allclose(fused, unfused.detach(), rtol=1e-5, atol=1e-4)
    torch.optim.SGD(model.parameters(), lr=0.5).zero_grad()
    unfused.float().logsumexp(-1).mean().backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()  # in-place update: tensor versions move
    with torch.no_grad():
        after = model(ids)
    assert not torch.allclose(after, fused, atol=1e-3)
    assert torch.allclose(after, model(ids).detach(), rtol=1e-5, atol=1e-3)  # stale weights: ~300 off
    model.to(torch.float64)
    with torch.no_grad():
        assert model(ids).dtype == torch.float64
        assert torch.allclose(model(ids).float(), after, rtol=1e-4, atol=1e-3)


def test_fp32_rmsnorm_kernel_equals_the_reference_formula():
    from pivotrl.engines.model import RMSNorm

    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 7, 64, generator=torch.Generator().manual_seed(0)) * 3
    reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(norm(x), reference)
