"""The synthetic transformer state dict the storage benchmarks move, in a module of its own so that
`benchmarks.gps` and `benchmarks.gps_nodes` both import it and neither imports the other."""

from __future__ import annotations

import torch


def transformer_state_dict(
    layers: int = 16, hidden: int = 768, inter: int = 2048, kv: int = 256, vocab: int = 16000, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Qwen2-like shapes: bf16 projections, fp32 embedding, norms and biases (~257 MB, 195 tensors)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    sd = {"model.embed_tokens.weight": rnd(vocab, hidden, dtype=torch.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = rnd(hidden, dtype=torch.float32)
        sd[p + "self_attn.q_proj.weight"] = rnd(hidden, hidden)
        sd[p + "self_attn.q_proj.bias"] = rnd(hidden, dtype=torch.float32)
        sd[p + "self_attn.k_proj.weight"] = rnd(kv, hidden)
        sd[p + "self_attn.k_proj.bias"] = rnd(kv, dtype=torch.float32)
        sd[p + "self_attn.v_proj.weight"] = rnd(kv, hidden)
        sd[p + "self_attn.v_proj.bias"] = rnd(kv, dtype=torch.float32)
        sd[p + "self_attn.o_proj.weight"] = rnd(hidden, hidden)
        sd[p + "post_attention_layernorm.weight"] = rnd(hidden, dtype=torch.float32)
        sd[p + "mlp.gate_proj.weight"] = rnd(inter, hidden)
        sd[p + "mlp.up_proj.weight"] = rnd(inter, hidden)
        sd[p + "mlp.down_proj.weight"] = rnd(hidden, inter)
    sd["model.norm.weight"] = rnd(hidden, dtype=torch.float32)
    sd["lm_head.weight"] = rnd(vocab // 4, hidden)
    return sd
