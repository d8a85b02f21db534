"""A compact Qwen2/Llama-style causal LM in one readable file (nanoGPT style).

Why our own: the generation engine needs a decode path over a *pre-allocated slot KV cache* (no per-step
reallocation, no per-token Python in HF's generation utilities), and the trainer needs a plain forward.
Parameter names and shapes equal HF `Qwen2ForCausalLM` / `LlamaForCausalLM`, so one state dict is saved
as HF safetensors, published to the parameter store, and loaded by transformers or vLLM unchanged.
`tests/engines/test_models.py` proves the logits equal transformers' on the same weights.

Blocks: RMSNorm → GQA attention with RoPE (q/k/v bias for Qwen2, per config for Llama) → RMSNorm →
SwiGLU MLP, pre-norm residuals, final RMSNorm, lm_head tied to the embedding when the config says so.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", None):
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported by the compact model")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (as HF does) and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _can_pack() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`m(x)`, through a oneDNN-prepacked weight when the module was packed and no gradient is wanted.

    Why: for decode-sized batches on CPU, MKL re-packs the weight on every call; a weight packed once is
    15-35% faster. The packed copy is refreshed whenever the weight changes (its tensor version moves, as
    on `load_state_dict` or an optimizer step), so a packed module never computes with stale weights.
    """
    packed = m.__dict__.get("_packed")
    if packed is None or torch.is_grad_enabled() or x.device.type != "cpu":
        return m(x)
    w = m.weight
    if packed[1] is not w or packed[2] != w._version:
        packed = _pack(m)
    return torch.ops.mkldnn._linear_pointwise(x, packed[0], m.bias, "none", [], "")


def _pack(m: nn.Linear, batch_hint: int = 32):
    w = m.weight
    packed = (torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint), w, w._version)
    m.__dict__["_packed"] = packed
    return packed


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, 1, T, D] (already in x's dtype)."""
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        out_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=out_bias)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = linear(self.q_proj, x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = linear(self.k_proj, x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = linear(self.v_proj, x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = y.shape
        return linear(self.o_proj, y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def forward(self, x, cos, sin, cache: KVSlots | None = None, layer: int = 0, slot0: int = 0):
        """Causal self-attention over `x` alone; with `cache`, also store k/v at slots slot0.. (prefill)."""
        q, k, v = self._qkv(x, cos, sin)
        if cache is not None:
            n, _, t, _ = k.shape
            cache.k[layer, slot0 : slot0 + n, :, :t] = k
            cache.v[layer, slot0 : slot0 + n, :, :t] = v
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        return self._out(y)

    def decode(self, x, cos, sin, cache: KVSlots, layer: int, lens: torch.Tensor, mask: torch.Tensor):
        """One new token per sequence in slots 0..B-1 at positions `lens`; attends to the cached prefix."""
        q, k, v = self._qkv(x, cos, sin)  # [B, h, 1, D]
        b = x.shape[0]
        rows = cache.rows[:b]
        cache.k[layer, rows, :, lens] = k[:, :, 0]
        cache.v[layer, rows, :, lens] = v[:, :, 0]
        span = mask.shape[-1]
        keys = cache.k[layer, :b, :, :span]
        values = cache.v[layer, :b, :, :span]
        y = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads
        )
        return self._out(y)


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.down_proj, F.silu(linear(self.gate_proj, x)) * linear(self.up_proj, x))


class Block(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Backbone(nn.Module):
    """Named like HF's `Qwen2Model` so state-dict keys read `model.layers.N...`."""

    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class KVSlots:
    """Pre-allocated KV cache: k, v of shape [layers, slots, kv_heads, max_len, head_dim].

    Allocated once per engine; a sequence owns one slot for its lifetime on the engine, and the running
    sequences are kept compact in slots 0..B-1 so decode attends to a plain view, never a gather.
    """

    def __init__(self, config, slots: int, max_len: int, device, dtype) -> None:
        shape = (config.num_hidden_layers, slots, config.num_key_value_heads, max_len, _head_dim(config))
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.rows = torch.arange(slots, device=device)
        self.slots, self.max_len = slots, max_len

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src`'s first `length` positions into slot `dst` (compaction after a finish)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class CausalLM(nn.Module):
    """Qwen2/Llama causal LM. `model(input_ids) -> logits [B, T, V]`; plus cached prefill/decode."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        d = _head_dim(config)
        inv_freq = 1.0 / (_rope_theta(config) ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config, device="cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
        with torch.device(device):
            model = cls(config)
        return model.to(dtype=dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, device="cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
        from pivotrl.engines.models import load_config, load_state_dict

        model = cls.from_config(load_config(path), device=device, dtype=dtype)
        model.load_state_dict(load_state_dict(path))
        return model.eval()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As `nn.Module.load_state_dict`, accepting a state dict without the tied `lm_head.weight`."""
        if getattr(self.config, "tie_word_embeddings", False) and "lm_head.weight" not in state_dict:
            state_dict = dict(state_dict, **{"lm_head.weight": state_dict["model.embed_tokens.weight"]})
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def pack_for_inference(self, enable: bool = True) -> bool:
        """Prepack every Linear weight for fast CPU inference (oneDNN); returns whether packing is on.

        Costs one extra copy of the weights. Only no-grad calls use the packed copies; training is unchanged.
        """
        enable = enable and _can_pack() and self.lm_head.weight.device.type == "cpu"
        for m in self.modules():
            if isinstance(m, nn.Linear):
                if enable and m.weight.dtype == torch.float32:
                    _pack(m)
                else:
                    m.__dict__.pop("_packed", None)
        return enable

    # -- rotary tables ------------------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin [B, 1, T, D] for integer positions [B, T], from a table grown on demand."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        table = self._rope_cache
        if table is None or table[0].shape[0] < need or table[0].device != positions.device:
            n = max(need, int(getattr(self.config, "max_position_embeddings", 2048)))
            pos = torch.arange(n, device=positions.device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq.to(positions.device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            table = self._rope_cache = (emb.cos(), emb.sin())
        cos = table[0][positions].to(dtype).unsqueeze(1)
        sin = table[1][positions].to(dtype).unsqueeze(1)
        return cos, sin

    # -- training / scoring forward -----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V] for a causal pass (right padding is harmless: earlier positions never see it)."""
        return linear(self.lm_head, self.hidden(input_ids, position_ids))

    def hidden(self, input_ids, position_ids=None, cache: KVSlots | None = None, slot0: int = 0):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self._rope(position_ids, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, cache, i, slot0)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    # -- engine paths -------------------------------------------------------------------------------------
    def prefill(
        self, input_ids: torch.Tensor, last: torch.Tensor, cache: KVSlots, slot0: int
    ) -> torch.Tensor:
        """Run right-padded sequences [N, T] into slots slot0..slot0+N-1; logits [N, V] at index `last`."""
        h = self.hidden(input_ids, cache=cache, slot0=slot0)
        h = h[torch.arange(h.shape[0], device=h.device), last]
        return linear(self.lm_head, h)

    def decode(self, tokens: torch.Tensor, lens: torch.Tensor, cache: KVSlots) -> torch.Tensor:
        """One token for each sequence in slots 0..B-1. tokens, lens: [B]; returns logits [B, V].

        Token b sits at position lens[b] (the number of tokens already cached for slot b).
        """
        b = tokens.shape[0]
        span = int(lens.max()) + 1
        mask = (torch.arange(span, device=tokens.device)[None, :] <= lens[:, None]).view(b, 1, 1, span)
        x = self.model.embed_tokens(tokens[:, None])
        cos, sin = self._rope(lens[:, None], x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn.decode(layer.input_layernorm(x), cos, sin, cache, i, lens, mask)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return linear(self.lm_head, self.model.norm(x))[:, 0]


def num_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
