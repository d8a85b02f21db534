"""A compact Qwen2/Llama-style causal LM: the model math only, readable top to bottom (nanoGPT style).

Why our own: the generation engine needs a decode path over a *pre-allocated slot KV cache* (no per-step
reallocation, no per-token Python in HF's generation utilities), and the trainer needs a plain forward.
Parameter names and shapes equal HF `Qwen2ForCausalLM` / `LlamaForCausalLM`, so one state dict is saved
as HF safetensors, published to the parameter store, and loaded by transformers or vLLM unchanged.
`tests/engines/test_models.py` proves the logits equal transformers' on the same weights.

Blocks: RMSNorm → GQA attention with RoPE (q/k/v bias for Qwen2, per config for Llama) → RMSNorm →
SwiGLU MLP, pre-norm residuals, final RMSNorm, lm_head tied to the embedding when the config says so.

Engine paths: `prefill_packed` runs new sequences back to back without padding; `decode` runs one token
per running sequence, through the native fused kernels (`kernels.py`: attention, add+norm, SwiGLU) when an
engine switched them on, else through the same math in torch ops. Both work in fp32 and bf16;
`tests/engines/test_decode_paths.py` checks every path against the plain forward.

Elsewhere: the KV cache layout (`kv_cache.py`), CPU weight packing and fused matmuls (`cpu_pack.py`),
config-derived sizes (`arch.py`), and loading/saving HF directories (`checkpoints.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pivotrl.engines import arch, cpu_pack
from pivotrl.engines.arch import head_dim
from pivotrl.engines.cpu_pack import FusedLinear, linear
from pivotrl.engines.kv_cache import KVSlots


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (as HF does) and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused kernel; in fp32 it equals the three-step form below bit for bit (tested).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, 1, T, D] (already in x's dtype)."""
    return x * cos + _rotate_half(x) * sin


@dataclass(frozen=True)
class DecodeStep:
    """What all layers of one decode step share, built once per step (`CausalLM.decode_step`).

    cos/sin: [B, heads + 2 * kv_heads, D] rotary rows in the model dtype for q|k|v together: q's rows carry
    the 1/sqrt(head_dim) attention scale, v's rows are the identity (cos 1, sin 0), and sin carries
    rotate_half's sign so RoPE is `t * cos + swap_halves(t) * sin`. bias: [B * kv_heads, 1, span], 0 up to
    each sequence's position and -inf after. span: max position + 1. lens: [B] positions.
    With `kernel` (the native `decode_attention`, see `kernels.py`), cos/sin are instead the plain fp32
    rotary rows [B, D] at each position and bias is not needed (None): the kernel does RoPE, store and
    attention.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    bias: torch.Tensor | None
    span: int
    lens: torch.Tensor
    kernel: Callable | None = None


class Attention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.head_dim = head_dim(config)
        bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        out_bias = bool(getattr(config, "attention_bias", False)) and config.model_type != "qwen2"
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=out_bias)
        self.qkv = FusedLinear([self.q_proj, self.k_proj, self.v_proj])

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        d = self.head_dim
        if torch.is_grad_enabled() or not self.qkv.enabled:
            q, k, v = linear(self.q_proj, x), linear(self.k_proj, x), linear(self.v_proj, x)
        else:
            q, k, v = self.qkv(x).split(self.qkv.sizes, dim=-1)
        q = q.reshape(b, t, self.n_heads, d).transpose(1, 2)
        k = k.reshape(b, t, self.n_kv, d).transpose(1, 2)
        v = v.reshape(b, t, self.n_kv, d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = y.shape
        return linear(self.o_proj, y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))

    def forward(self, x, cos, sin, cache: KVSlots | None = None, layer: int = 0, slot0: int = 0):
        """Causal self-attention over `x` alone; with `cache`, also store k/v at slots slot0.. (prefill)."""
        q, k, v = self._qkv(x, cos, sin)
        if cache is not None:
            n, kv, t, d = k.shape
            slots = torch.arange(slot0, slot0 + n, device=k.device).repeat_interleave(t)
            positions = torch.arange(t, device=k.device).repeat(n)
            k_rows, v_rows = (z.transpose(1, 2).reshape(n * t, kv, d) for z in (k, v))  # (N * T, nkv, hs)
            cache.store(layer, slots, positions, k_rows, v_rows)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        return self._out(y)

    def decode(self, qkv: torch.Tensor, step: DecodeStep, cache: KVSlots, layer: int) -> torch.Tensor:
        """One new token per sequence in slots 0..B-1 (qkv: [B, (heads + 2 kv_heads) * head_dim], the fused
        q|k|v projection of the normed input); attends to the cached prefix. Returns the attention output
        [B, heads * head_dim] before o_proj (the caller owns the matmuls, see `CausalLM._blocks`).

        Everything that is the same for all layers (rotary rows, positions, length bias) is in `step`,
        built once per step. With the native kernel (`step.kernel`), RoPE, the KV store and attention are
        one call. Otherwise RoPE runs once over q, k and v together (v's rows are the identity) and attention
        is two grouped matmuls, one query token per sequence and GQA group (faster on CPU than SDPA's flash
        kernel, no repeat of the kv heads); the 1/sqrt(head_dim) scale is folded into q's rotary rows and the
        length bias into the first matmul. Both compute the same thing (tested).
        """
        b, d, h, kv = qkv.shape[0], self.head_dim, self.n_heads, self.n_kv
        if step.kernel is not None:
            return step.kernel(qkv, step.cos, step.sin, cache.kv[layer], step.lens, h, d**-0.5)
        t = qkv.view(b, h + 2 * kv, d)  # (B, nh + 2 * nkv, hs): the q heads, then k, then v
        half = d // 2
        r = t * step.cos  # RoPE on all rows at once (v's rows: identity; q's: scaled by hs**-0.5)
        r.addcmul_(torch.cat((t[..., half:], t[..., :half]), dim=-1), step.sin)
        cache.store(layer, cache.rows[:b], step.lens, r[:, h : h + kv], r[:, h + kv :])  # (B, nkv, hs) each
        span = step.span
        keys_t = cache.keys(layer, b, span).reshape(b * kv, span, d).transpose(1, 2)  # (B * nkv, hs, span)
        values = cache.v[layer, :b, :, :span].reshape(b * kv, span, d)  # (B * nkv, span, hs)
        if keys_t.dtype != torch.float32:
            # Reduced-precision bmm on CPU copies a strided operand internally, and slower than this does.
            keys_t, values = keys_t.contiguous(), values.contiguous()
        q = r[:, :h].reshape(b * kv, h // kv, d)  # (B * nkv, nh / nkv, hs): each kv head's query group
        scores = torch.baddbmm(step.bias, q, keys_t)  # (B * nkv, nh / nkv, span), -inf past each position
        return torch.bmm(torch.softmax(scores, dim=-1), values).view(b, h * d)  # (B, nh * hs)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """q|k|v of x [N, hidden] as one [N, (heads + 2 kv_heads) * head_dim] tensor."""
        if self.qkv.enabled:
            return self.qkv(x)
        return torch.cat([linear(self.q_proj, x), linear(self.k_proj, x), linear(self.v_proj, x)], dim=-1)

    def prefill_packed(self, qkv: torch.Tensor, cos, sin, cache: KVSlots, layer: int, where: tuple,
                       by_length: list[tuple[int, slice | torch.Tensor]]):
        """Several sequences packed back to back, qkv [T, (heads + 2 kv_heads) * head_dim] (no padding):
        causal attention within each sequence, the sequences grouped by length (`_equal_lengths`); token
        t's keys/values go to cache slot where[0][t], position where[1][t]. Returns [T, heads * head_dim]
        before o_proj."""
        t, d, h, kv = qkv.shape[0], self.head_dim, self.n_heads, self.n_kv
        heads = qkv.view(t, h + 2 * kv, d).transpose(0, 1)  # [heads, T, D]
        q = apply_rope(heads[:h], cos, sin)
        k = apply_rope(heads[h : h + kv], cos, sin)
        v = heads[h + kv :]
        cache.store(layer, where[0], where[1], k.transpose(0, 1), v.transpose(0, 1))
        y = torch.empty_like(q)
        gqa = kv != h
        for n, rows in by_length:
            if isinstance(rows, slice):  # the only sequence of its length: its own slice, no gather
                y[:, rows] = F.scaled_dot_product_attention(
                    q[None, :, rows], k[None, :, rows], v[None, :, rows], is_causal=True, enable_gqa=gqa
                )[0]
                continue
            m = rows.numel() // n
            qs, ks, vs = (z[:, rows].view(z.shape[0], m, n, d).transpose(0, 1) for z in (q, k, v))
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)  # [m, h, n, D]
            y[:, rows] = out.transpose(0, 1).reshape(h, m * n, d)
        return y.transpose(0, 1).reshape(t, h * d)


def _equal_lengths(spans, device) -> list[tuple[int, slice | torch.Tensor]]:
    """The packed sequences grouped by length: (length, rows) with rows a slice for a length that one
    sequence has, else the packed indices of every sequence of that length, sequence by sequence.

    Why: attention ran once per sequence, and a prefill of hundreds of short prompts spent more in those
    calls than in their arithmetic; sequences of one length attend as one batch instead (a batch of RL
    prompts has few distinct lengths)."""
    by_length: dict[int, list[int]] = {}
    for start, n in spans:
        by_length.setdefault(n, []).append(start)
    out: list[tuple[int, slice | torch.Tensor]] = []
    for n, starts in by_length.items():
        if len(starts) == 1:
            out.append((n, slice(starts[0], starts[0] + n)))
        else:
            base = torch.tensor(starts, dtype=torch.long, device=device)
            out.append((n, (base[:, None] + torch.arange(n, device=device)[None, :]).reshape(-1)))
    return out


class MLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or not self.gate_up.enabled:
            return linear(self.down_proj, F.silu(linear(self.gate_proj, x)) * linear(self.up_proj, x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return linear(self.down_proj, F.silu(gate).mul_(up))


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


class CausalLM(nn.Module):
    """Qwen2/Llama causal LM. `model(input_ids) -> logits [B, T, V]`; plus cached prefill/decode."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", arch.inv_freq(config), persistent=False)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # The native decode kernels (`kernels.native()`), set by an engine that wants them; None: torch ops.
        self.native: object | None = None

    # -- construction (loading from a checkpoint directory: `checkpoints.from_pretrained`) ----------------
    @classmethod
    def from_config(cls, config, device="cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
        """A randomly initialised model (as `nn.Linear`/`nn.Embedding` initialise) in `dtype`."""
        with torch.device(device):
            model = cls(config)
        return model.to(dtype=dtype)

    @classmethod
    def empty(cls, config, device="cpu", dtype: torch.dtype = torch.float32) -> CausalLM:
        """Parameters allocated in `dtype` but not initialised, for loading a state dict into: initialising
        weights that are overwritten at once is most of a small model's build time on CPU. `inv_freq` (the
        one non-persistent buffer) is computed as `__init__` does and kept fp32, as the rotary tables are."""
        with torch.device("meta"):
            model = cls(config)
        model = model.to(dtype).to_empty(device=device)
        if getattr(config, "tie_word_embeddings", False):  # allocating unties shared parameters
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = arch.inv_freq(config).to(device)
        return model

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As `nn.Module.load_state_dict`, accepting a state dict without the tied `lm_head.weight`."""
        if getattr(self.config, "tie_word_embeddings", False) and "lm_head.weight" not in state_dict:
            state_dict = dict(state_dict, **{"lm_head.weight": state_dict["model.embed_tokens.weight"]})
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def pack_for_inference(self, enable: bool = True) -> bool:
        """Pack the weights for fast no-grad CPU calls and fuse q/k/v and gate/up (`enable=False` drops
        every copy); returns whether packing is on. See `cpu_pack.pack_for_inference`."""
        return cpu_pack.pack_for_inference(self, enable)

    def repack(self) -> None:
        """Bring every packed and fused weight copy up to date now (rather than at its next call) and back
        them with huge pages (`malloc.huge_pages`): a decode step reads them all. After new weights."""
        cpu_pack.repack(self)

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

    def prefill_packed(self, seqs: list[list[int]], cache: KVSlots, slot0: int,
                       slots: list[int] | None = None) -> torch.Tensor:
        """Run `seqs` into slots slot0.. (or the given `slots`, one per sequence) packed back to back (no
        padding); logits [N, V] at each last token.

        Why packed: prompts are long-tailed, and a right-padded batch computes every row at the longest
        length (about 3x the real tokens for task prompts); only attention needs the sequence bounds.
        """
        dev = self.inv_freq.device
        lengths = [len(s) for s in seqs]
        ids = torch.tensor([tok for s in seqs for tok in s], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
        rows = torch.arange(slot0, slot0 + len(seqs)) if slots is None else torch.tensor(slots)
        token_slots = torch.repeat_interleave(rows.to(dev, torch.long), torch.tensor(lengths, device=dev))
        starts = [0, *itertools.accumulate(lengths)][:-1]
        spans = list(zip(starts, lengths))
        x = self.model.embed_tokens(ids)
        cos, sin = self._rope(positions[None], x.dtype)
        cos, sin = cos[0], sin[0]  # [1, T, D]: broadcast over heads
        last = torch.tensor([s + n - 1 for s, n in spans], device=dev)
        native = self.native if self._native_ok(positions, x.dtype) else None
        where = (token_slots, positions)
        by_length = _equal_lengths(spans, dev)  # the same for every layer

        def attend(i: int, qkv: torch.Tensor) -> torch.Tensor:
            return self.model.layers[i].self_attn.prefill_packed(qkv, cos, sin, cache, i, where, by_length)

        return self._blocks(x, attend, native, last)

    def decode_step(self, lens: torch.Tensor, span: int, cache: KVSlots, dtype: torch.dtype) -> DecodeStep:
        """What every layer of one decode step shares, built once: see `DecodeStep`."""
        b, dev = lens.shape[0], lens.device
        h, kv, d = self.config.num_attention_heads, self.config.num_key_value_heads, head_dim(self.config)
        cos, sin = self._rope(lens[:, None], torch.float32)
        cos, sin = cos[:, 0, 0], sin[:, 0, 0]  # [B, D]
        if self._native_ok(lens, dtype):
            return DecodeStep(
                cos=cos, sin=sin, bias=None, span=span, lens=lens, kernel=self.native.decode_attention
            )
        half = d // 2
        sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # rotate_half's sign, folded in
        scale = d**-0.5
        one, zero = cos.new_ones(b, kv, d), cos.new_zeros(b, kv, d)
        cos_rows = torch.cat(((cos * scale)[:, None].expand(b, h, d), cos[:, None].expand(b, kv, d), one), 1)
        sin_rows = torch.cat(((sin * scale)[:, None].expand(b, h, d), sin[:, None].expand(b, kv, d), zero), 1)
        beyond = torch.arange(span, device=dev)[None, :] > lens[:, None]
        bias = torch.zeros(b, 1, span, device=dev, dtype=dtype).masked_fill_(beyond[:, None], float("-inf"))
        return DecodeStep(
            cos=cos_rows.to(dtype),
            sin=sin_rows.to(dtype),
            bias=bias.repeat_interleave(kv, dim=0),
            span=span,
            lens=lens,
        )

    def decode(
        self, tokens: torch.Tensor, lens: torch.Tensor, cache: KVSlots, span: int | None = None
    ) -> torch.Tensor:
        """One token for each sequence in slots 0..B-1. tokens, lens: [B]; returns logits [B, V].

        Token b sits at position lens[b] (the number of tokens already cached for slot b); `span`, if the
        caller knows it, is max(lens) + 1.
        """
        span = int(lens.max()) + 1 if span is None else span
        x = self.model.embed_tokens(tokens)
        step = self.decode_step(lens, span, cache, x.dtype)
        native = self.native if step.kernel is not None else None
        return self._blocks(
            x, lambda i, qkv: self.model.layers[i].self_attn.decode(qkv, step, cache, i), native
        )

    def _blocks(
        self,
        x: torch.Tensor,
        attend: Callable[[int, torch.Tensor], torch.Tensor],
        native: object | None,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The engine paths' pass through every block and the head: x (N, hidden), updated in place (so
        no-grad only); `attend(i, qkv)` is layer i's attention given its q|k|v projection, before o_proj;
        logits (len(last) or N, vocab) at rows `last` (all rows if None).

        With `native`, each residual add is fused with the norm that follows it, SwiGLU is one call, and
        the weights come from `cpu_pack.plan` (resolved once per weight version, not per call); otherwise
        the same math in torch ops."""
        if native is None:
            for i, layer in enumerate(self.model.layers):
                attn = layer.self_attn
                x.add_(linear(attn.o_proj, attend(i, attn.project_qkv(layer.input_layernorm(x)))))
                x.add_(layer.mlp(layer.post_attention_layernorm(x)))
            return linear(self.lm_head, self.model.norm(x if last is None else x[last]))
        plan = cpu_pack.plan(self)
        delta = None  # the MLP output not yet added to x: the next add_rms_norm adds it
        # Unpacked in the loop header rather than read by attribute: cheaper, and it runs every decode step.
        for i, (norm_in, eps_in, qkv, o_proj, norm_post, eps_post, gate_up, down) in enumerate(plan.layers):
            h = native.add_rms_norm(x, delta, norm_in, eps_in)  # x += delta; h = norm(x): (N, hidden)
            a = o_proj(attend(i, qkv(h)))  # (N, hidden)
            h = native.add_rms_norm(x, a, norm_post, eps_post)  # x += a; h = norm(x)
            delta = down(native.silu_mul(gate_up(h)))  # (N, 2 * inter) -> (N, inter) -> (N, hidden)
        if last is not None:
            x, delta = x[last], delta[last]
        return plan.head(native.add_rms_norm(x, delta, plan.norm, plan.eps))

    def _native_ok(self, lens: torch.Tensor, dtype: torch.dtype) -> bool:
        return (
            self.native is not None
            and lens.device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
            and self.model.layers[0].mlp.gate_up.enabled  # fused projections: what the kernels expect
        )


def num_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
