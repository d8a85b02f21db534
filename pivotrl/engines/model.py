"""A compact Qwen2/Llama-style causal LM in one readable file (nanoGPT style).

Why our own: the generation engine needs a decode path over a *pre-allocated slot KV cache* (no per-step
reallocation, no per-token Python in HF's generation utilities), and the trainer needs a plain forward.
Parameter names and shapes equal HF `Qwen2ForCausalLM` / `LlamaForCausalLM`, so one state dict is saved
as HF safetensors, published to the parameter store, and loaded by transformers or vLLM unchanged.
`tests/engines/test_models.py` proves the logits equal transformers' on the same weights.

Blocks: RMSNorm → GQA attention with RoPE (q/k/v bias for Qwen2, per config for Llama) → RMSNorm →
SwiGLU MLP, pre-norm residuals, final RMSNorm, lm_head tied to the embedding when the config says so.

Engine paths: `prefill_packed` runs new sequences back to back without padding; `decode` runs one token
per running sequence, through the native fused kernels (`kernels.py`: attention, add+norm, SwiGLU) when an
engine switched them on, else through the same math in torch ops. Both work in fp32 and bf16 (CPU weights
are packed once, `PackedWeight`: bf16 ones for the native bf16 matmul where it is built, the others for
oneDNN); `tests/engines/test_decode_paths.py` checks every path against the plain forward.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pivotrl.malloc import huge_pages


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in ("default", None):
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported by the compact model")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _inv_freq(config) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2] in fp32 (on the default device), computed as HF computes
    them, so the rotary tables round the same way."""
    d = _head_dim(config)
    return 1.0 / (_rope_theta(config) ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


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


def _can_pack() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packable(dtype: torch.dtype, native: object | None = None) -> bool:
    """Weight dtypes packed on this CPU (`PackedWeight`): fp32 always; bf16 where the CPU has native bf16
    support (avx512_bf16 / AMX; otherwise oneDNN would emulate it and the packed path is no faster) or the
    native kernels' own bf16 matmul was built."""
    if dtype == torch.float32:
        return _can_pack() or (native is not None and bool(native.has_linear_fp32()))
    if dtype != torch.bfloat16:
        return False
    if native is not None and bool(native.has_linear_bf16()):
        return True
    return _can_pack() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedWeight:
    """A Linear weight packed once for no-grad CPU calls.

    With the native kernels (`kernels.py`, `csrc/linear.cpp`; fp32 where built for AVX-512, bf16 for
    AVX512-BF16): our own packing and matmul, faster than oneDNN's on decode-sized batches (no per-call
    primitive lookup, and it requests the next panels of the weight while it multiplies). Otherwise
    oneDNN's prepacked weight.
    """

    __slots__ = ("data", "native", "out_features")

    def __init__(self, w: torch.Tensor, native: object | None) -> None:
        w = w.detach()
        self.out_features = w.shape[0]
        if _native_linear(native, w):
            self.native, self.data = native, native.pack_linear(w)
        else:
            self.native, self.data = None, torch.ops.mkldnn._reorder_linear_weight(w, 32)

    def bias_for(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """`bias` as a call takes it fastest: the native matmul adds an fp32 bias (converted once by a
        caller that keeps it, rather than inside every call); oneDNN takes the weight's dtype."""
        return bias.detach().float() if bias is not None and self.native is not None else bias

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.native is not None:
            return self.native.linear(x, self.data, bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")

    def memory(self) -> tuple[int, int]:
        """(address, bytes) of the packed copy."""
        if self.native is not None:
            return self.data.data_ptr(), self.data.numel() * self.data.element_size()
        return torch.ops.mkldnn.data_ptr(self.data), torch.ops.mkldnn._nbytes(self.data)


def _native_linear(native: object | None, w: torch.Tensor) -> bool:
    """Whether the native kernels' matmul takes `w` (see `PackedWeight`)."""
    if native is None:
        return False
    if w.dtype == torch.float32:
        return bool(native.has_linear_fp32())
    return w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0 and bool(native.has_linear_bf16())


def linear(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`m(x)`, through a packed weight (`PackedWeight`) when the module was packed and no gradient is wanted.

    Why: for decode-sized batches on CPU, MKL re-packs the weight on every call; a weight packed once is
    15-35% faster. The packed copy is refreshed whenever the weight changes (its tensor version or storage
    moves, as on `load_state_dict`, an optimizer step or `.to()`), so a packed module never computes with
    stale weights; a weight cast to a dtype that is not packed (see `_packable`) or moved off the CPU
    drops it.
    """
    if torch.is_grad_enabled() or x.device.type != "cpu":
        return m(x)
    packed = _current_pack(m)
    return m(x) if packed is None else packed(x, m.bias)


def _current_pack(m: nn.Linear) -> PackedWeight | None:
    """`m`'s packed weight, re-packed first if the weight changed since; None if `m` is not packed (a
    weight moved off the CPU or cast to a dtype that is not packed drops its copy)."""
    packed = m.__dict__.get("_packed")
    if packed is None:
        return None
    w = m.weight
    if w.device.type != "cpu" or not _packable(w.dtype, packed[0].native):  # moved or cast out of reach
        m.__dict__.pop("_packed", None)
        return None
    if packed[1] is not w or packed[2] != w._version or packed[3] != w.data_ptr() or packed[4] != w.dtype:
        packed = _pack(m, packed[0].native)
    return packed[0]


def _pack(m: nn.Linear, native: object | None) -> tuple:
    w = m.weight
    packed = (PackedWeight(w, native), w, w._version, w.data_ptr(), w.dtype)
    m.__dict__["_packed"] = packed
    return packed


class FusedLinear:
    """Several Linear layers that read the same input, as one matmul, for no-grad calls only.

    Why: a decode step on a small model is dominated by per-call overhead, not FLOPs; q/k/v and gate/up
    each become one call (and one packed weight on CPU fp32/bf16, `PackedWeight`). The fused copy is rebuilt
    whenever any part's weight changes (its storage or tensor version moves, as on `load_state_dict`, an
    optimizer step or `.to()`), so it never computes with stale weights. Not an `nn.Module`: it owns no
    parameters and never appears in the state dict.
    """

    def __init__(self, parts: list[nn.Linear]) -> None:
        self.parts = parts
        self.sizes = [m.out_features for m in parts]
        self._state: tuple | None = None
        self.pack = False
        self.native: object | None = None  # the native kernels' module, for `PackedWeight`
        # Off until an inference engine asks (`CausalLM.pack_for_inference`): a trainer's no-grad passes
        # (old/reference log-probs) keep the per-layer path and never pay for a fused copy of the weights.
        self.enabled = False

    def _key(self) -> tuple:
        return tuple((m.weight.data_ptr(), m.weight._version, m.weight.dtype) for m in self.parts)

    def _build(self, key: tuple) -> tuple:
        w = torch.cat([m.weight.detach() for m in self.parts])
        if any(m.bias is not None for m in self.parts):
            b = torch.cat(
                [m.bias.detach() if m.bias is not None else w.new_zeros(m.out_features) for m in self.parts]
            )
        else:
            b = None
        packed = None
        if self.pack and w.device.type == "cpu" and _packable(w.dtype, self.native):
            packed = PackedWeight(w, self.native)
            b = packed.bias_for(b)
            w = None  # the packed copy is all a CPU call needs
        self._state = (key, w, b, packed)
        return self._state

    def current(self) -> tuple:
        """(key, weight, bias, packed weight) for the parts' current weights, rebuilt if they changed."""
        key = self._key()
        return self._state if self._state is not None and self._state[0] == key else self._build(key)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _, w, b, packed = self.current()
        if packed is not None:  # only built for CPU weights, hence a CPU input
            return packed(x, b)
        return F.linear(x, w, b)

    def clear(self) -> None:
        self._state = None


class _PackedMatmul:
    """A packed weight with its bias bound, as the native loop calls it (see `CausalLM._plan`)."""

    __slots__ = ("bias", "packed")

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None) -> None:
        self.packed = packed
        self.bias = packed.bias_for(bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x, self.bias)


def _bound(m: nn.Linear | FusedLinear) -> Callable[[torch.Tensor], torch.Tensor]:
    """`m` as a one-argument matmul: its current packed weight bound to its bias where it is packed, else
    a call that resolves the module each time."""
    if isinstance(m, FusedLinear):
        _, _, bias, packed = m.current() if m.enabled else (None, None, None, None)
        return _PackedMatmul(packed, bias) if packed is not None else m
    packed = _current_pack(m)
    return _PackedMatmul(packed, m.bias) if packed is not None else lambda x: linear(m, x)


_VERSION = operator.attrgetter("_version")


def _param_state(params: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Storage addresses and versions of `params`: they move with every update (in place or not)."""
    return list(map(torch.Tensor.data_ptr, params)), list(map(_VERSION, params))


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
        self.head_dim = _head_dim(config)
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
            cache.store(
                layer,
                slots,
                positions,
                k.transpose(1, 2).reshape(n * t, kv, d),
                v.transpose(1, 2).reshape(n * t, kv, d),
            )
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
        t = qkv.view(b, h + 2 * kv, d)
        half = d // 2
        r = t * step.cos
        r.addcmul_(torch.cat((t[..., half:], t[..., :half]), dim=-1), step.sin)
        cache.store(layer, cache.rows[:b], step.lens, r[:, h : h + kv], r[:, h + kv :])
        span = step.span
        keys_t = cache.keys(layer, b, span).reshape(b * kv, span, d).transpose(1, 2)
        values = cache.v[layer, :b, :, :span].reshape(b * kv, span, d)
        if keys_t.dtype != torch.float32:
            # Reduced-precision bmm on CPU copies a strided operand internally, and slower than this does.
            keys_t, values = keys_t.contiguous(), values.contiguous()
        scores = torch.baddbmm(step.bias, r[:, :h].reshape(b * kv, h // kv, d), keys_t)
        return torch.bmm(torch.softmax(scores, dim=-1), values).view(b, h * d)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """q|k|v of x [N, hidden] as one [N, (heads + 2 kv_heads) * head_dim] tensor."""
        if self.qkv.enabled:
            return self.qkv(x)
        return torch.cat([linear(self.q_proj, x), linear(self.k_proj, x), linear(self.v_proj, x)], dim=-1)

    def prefill_packed(self, qkv: torch.Tensor, cos, sin, cache: KVSlots, layer: int, where: tuple, spans):
        """Several sequences packed back to back, qkv [T, (heads + 2 kv_heads) * head_dim] (no padding):
        causal attention within each `spans` (start, length); token t's keys/values go to cache slot
        where[0][t], position where[1][t]. Returns [T, heads * head_dim] before o_proj."""
        t, d, h, kv = qkv.shape[0], self.head_dim, self.n_heads, self.n_kv
        heads = qkv.view(t, h + 2 * kv, d).transpose(0, 1)  # [heads, T, D]
        q = apply_rope(heads[:h], cos, sin)
        k = apply_rope(heads[h : h + kv], cos, sin)
        v = heads[h + kv :]
        cache.store(layer, where[0], where[1], k.transpose(0, 1), v.transpose(0, 1))
        y = torch.empty_like(q)
        gqa = kv != h
        for start, n in spans:
            part = slice(start, start + n)
            y[:, part] = F.scaled_dot_product_attention(
                q[None, :, part], k[None, :, part], v[None, :, part], is_causal=True, enable_gqa=gqa
            )[0]
        return y.transpose(0, 1).reshape(t, h * d)


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


KEY_BLOCK = 16  # positions per key block of the cache (one AVX-512 vector of fp32 scores)


class KVSlots:
    """Pre-allocated KV cache: [layers, 2 (keys, values), slots, kv_heads, max_len, head_dim] in ONE buffer.

    Allocated once per engine; a sequence owns one slot for its lifetime on the engine, and the running
    sequences are kept compact in slots 0..B-1 so decode attends to a plain view, never a gather.
    Values are stored [max_len, head_dim] per head. Keys are stored in blocks of `KEY_BLOCK` positions, each
    block TRANSPOSED ([head_dim, KEY_BLOCK] in memory): decode scores are then q times row-major 16-wide
    rows, which the native kernel (`kernels.py`) reads one vector load each, and a sequence's first n keys
    are ONE contiguous run of memory (ceil(n / 16) blocks), which the hardware prefetcher streams; a plain
    [head_dim, max_len] transpose splits them into head_dim short runs that it does not foresee, and decode
    attention waited on memory. Either way the first n positions of a head occupy the first
    round_up(n, 16) x head_dim elements of its block, so copies of a prefix (`copy_slots`, `grown`) are the
    same for keys and values. `kv[layer]` is the one contiguous block the kernel takes per layer.
    """

    def __init__(self, config, slots: int, max_len: int, device, dtype) -> None:
        kv_heads, d, layers = config.num_key_value_heads, _head_dim(config), config.num_hidden_layers
        max_len = _round_up(max_len, KEY_BLOCK)
        self.kv = torch.empty((layers, 2, slots, kv_heads, max_len, d), device=device, dtype=dtype)
        if self.kv.device.type == "cpu":  # before the first touch: fresh pages then fault in huge, no copy
            huge_pages([(self.kv.data_ptr(), self.kv.numel() * self.kv.element_size())])
        self.kv.zero_()  # the torch path reads stale positions (masked): they must be finite
        blocks = max_len // KEY_BLOCK
        # [layers, slots, kv_heads, blocks, KEY_BLOCK (position in block), head_dim]: a strided view.
        self.k_blocks = self.kv[:, 0].view(layers, slots, kv_heads, blocks, d, KEY_BLOCK).transpose(-1, -2)
        self.v = self.kv[:, 1]
        self.rows = torch.arange(slots, device=device)
        self.heads = torch.arange(kv_heads, device=device)
        self.slots, self.max_len, self.kv_heads = slots, max_len, kv_heads

    def store(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k, v) -> None:
        """Write k, v [N, kv_heads, head_dim] of N tokens at (slots[n], positions[n]) in `layer`."""
        heads, pos = self.heads[None, :], positions[:, None]
        self.k_blocks[layer].index_put_((slots[:, None], heads, pos // KEY_BLOCK, pos % KEY_BLOCK), k)
        self.v[layer].index_put_((slots[:, None], heads, pos), v)

    def keys(self, layer: int, n: int, span: int) -> torch.Tensor:
        """Keys of slots 0..n-1 at positions 0..span-1 as [n, kv_heads, span, head_dim] (a copy)."""
        blocks = -(-span // KEY_BLOCK)
        k = self.k_blocks[layer, :n, :, :blocks]
        return k.reshape(n, self.kv_heads, blocks * KEY_BLOCK, -1)[:, :, :span]

    def copy_slots(self, src, dst, length: int) -> None:
        """Copy the first `length` positions of slots `src` into slots `dst` (ints or index lists)."""
        end = _round_up(length, KEY_BLOCK)
        self.kv[:, :, dst, :, :end] = self.kv[:, :, src, :, :end]

    def grown(self, max_len: int, n: int) -> KVSlots:
        """A longer cache holding slots 0..n-1 of this one."""
        shape = _CacheShape(self.kv.shape[0], self.kv_heads, self.kv.shape[-1])
        bigger = KVSlots(shape, self.slots, max_len, self.kv.device, self.kv.dtype)
        bigger.kv[:, :, :n, :, : self.max_len] = self.kv[:, :, :n]
        return bigger

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class _CacheShape:
    """The three config fields `KVSlots` reads, for a cache built from another one."""

    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int


class CausalLM(nn.Module):
    """Qwen2/Llama causal LM. `model(input_ids) -> logits [B, T, V]`; plus cached prefill/decode."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", _inv_freq(config), persistent=False)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        # The native decode kernels (`kernels.native()`), set by an engine that wants them; None: torch ops.
        self.native: object | None = None

    # -- construction -------------------------------------------------------------------------------------
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
        model.inv_freq = _inv_freq(config).to(device)
        return model

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
        """Prepack the inference weights for fast CPU calls (`PackedWeight`: the native bf16 matmul when
        `self.native` is set and has it, else oneDNN); returns whether packing is on.

        Also switches no-grad calls to the fused q/k/v and gate/up matmuls (see `FusedLinear`; on CPU fp32
        bf16 packed fused, o/down/lm_head packed each on their own). Costs one extra copy of the weights; only
        no-grad calls use it, training is unchanged. `enable=False` drops every packed and fused copy (an
        offloaded engine gives the memory back) and returns no-grad calls to the per-layer path.
        """
        self.__dict__.pop("_plan_cache", None)  # it holds packed copies: rebuilt from the new state on use
        fused = [f for m in self.modules() for f in vars(m).values() if isinstance(f, FusedLinear)]
        for f in fused:
            f.enabled = enable
        enable = enable and _can_pack() and self.lm_head.weight.device.type == "cpu"
        in_fused = {id(p) for f in fused for p in f.parts}
        for f in fused:
            if (f.pack, f.native) != (enable, self.native):  # a copy packed the same way is kept
                f.pack, f.native = enable, self.native
                f.clear()
        for m in self.modules():
            if isinstance(m, nn.Linear):
                if enable and _packable(m.weight.dtype, self.native) and id(m) not in in_fused:
                    old = m.__dict__.get("_packed")
                    if old is None or old[0].native is not (
                        self.native if _native_linear(self.native, m.weight) else None
                    ):
                        _pack(m, self.native)  # else kept: `repack` below refreshes it if the weight changed
                else:
                    m.__dict__.pop("_packed", None)
        if enable:
            self.repack()
        return enable

    def repack(self) -> None:
        """Bring every packed and fused weight copy up to date now (rather than at its next call) and back
        them with huge pages (`malloc.huge_pages`): a decode step reads them all. After new weights."""
        packed = []
        for m in self.modules():
            for f in vars(m).values():
                if isinstance(f, FusedLinear) and f.enabled:
                    state = f.current()
                    if state[3] is not None:
                        packed.append(state[3])
            if isinstance(m, nn.Linear) and (p := _current_pack(m)) is not None:
                packed.append(p)
        huge_pages([p.memory() for p in packed])

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

    def prefill_packed(self, seqs: list[list[int]], cache: KVSlots, slot0: int) -> torch.Tensor:
        """Run `seqs` into slots slot0.. packed back to back (no padding); logits [N, V] at each last token.

        Why packed: prompts are long-tailed, and a right-padded batch computes every row at the longest
        length (about 3x the real tokens for task prompts); only attention needs the sequence bounds.
        """
        dev = self.inv_freq.device
        lengths = [len(s) for s in seqs]
        ids = torch.tensor([tok for s in seqs for tok in s], dtype=torch.long, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lengths])
        slots = torch.repeat_interleave(
            torch.arange(slot0, slot0 + len(seqs), device=dev), torch.tensor(lengths, device=dev)
        )
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        spans = list(zip(starts, lengths))
        x = self.model.embed_tokens(ids)
        cos, sin = self._rope(positions[None], x.dtype)
        cos, sin = cos[0], sin[0]  # [1, T, D]: broadcast over heads
        last = torch.tensor([s + n - 1 for s, n in spans], device=dev)
        native = self.native if self._native_ok(positions, x.dtype) else None
        where = (slots, positions)
        return self._blocks(
            x,
            lambda i, qkv: self.model.layers[i].self_attn.prefill_packed(
                qkv, cos, sin, cache, i, where, spans
            ),
            native,
            last,
        )

    def decode_step(self, lens: torch.Tensor, span: int, cache: KVSlots, dtype: torch.dtype) -> DecodeStep:
        """What every layer of one decode step shares, built once: see `DecodeStep`."""
        b, dev = lens.shape[0], lens.device
        h, kv, d = self.config.num_attention_heads, self.config.num_key_value_heads, _head_dim(self.config)
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
        """The engine paths' pass through every block and the head: x [N, hidden] (updated in place, so
        no-grad only), `attend(i, qkv)` layer i's attention given its q|k|v projection, before o_proj;
        logits at rows `last` (all rows if None). With `native`, each residual add is fused with the norm
        that follows it, SwiGLU is one call, and the weights come from `_plan` (resolved once per weight
        version, not per call); otherwise the same math in torch ops."""
        if native is None:
            for i, layer in enumerate(self.model.layers):
                attn = layer.self_attn
                x.add_(linear(attn.o_proj, attend(i, attn.project_qkv(layer.input_layernorm(x)))))
                x.add_(layer.mlp(layer.post_attention_layernorm(x)))
            return linear(self.lm_head, self.model.norm(x if last is None else x[last]))
        layers, (w_final, eps_final, head) = self._plan()
        delta = None
        for i, (w_in, eps_in, qkv, o_proj, w_post, eps_post, gate_up, down) in enumerate(layers):
            h = native.add_rms_norm(x, delta, w_in, eps_in)
            h = native.add_rms_norm(x, o_proj(attend(i, qkv(h))), w_post, eps_post)
            delta = down(native.silu_mul(gate_up(h)))
        if last is not None:
            x, delta = x[last], delta[last]
        return head(native.add_rms_norm(x, delta, w_final, eps_final))

    def _plan(self) -> tuple[list[tuple], tuple]:
        """Per layer (input-norm weight, eps, q|k|v matmul, o_proj, post-norm weight, eps, gate|up, down) and
        (final-norm weight, eps, lm_head): what the native loop of `_blocks` reads.

        Why: resolving each packed weight per call (its freshness check, module attribute lookups) cost
        more Python time per decode step than the norms' arithmetic. With every matmul packed, the plan is
        built once and kept while no parameter's storage or version moves (one check per step); otherwise
        it is rebuilt per call from the live modules.
        """
        cached = self.__dict__.get("_plan_cache")
        if cached is not None:
            params, key, plan = cached
            if _param_state(params) == key:
                return plan
        plan, packed = [], True
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            matmuls = (_bound(attn.qkv), _bound(attn.o_proj), _bound(mlp.gate_up), _bound(mlp.down_proj))
            packed = packed and all(isinstance(m, _PackedMatmul) for m in matmuls)
            qkv, o_proj, gate_up, down = matmuls
            norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
            plan.append(
                (norm_in.weight, norm_in.eps, qkv, o_proj, norm_post.weight, norm_post.eps, gate_up, down)
            )
        head = _bound(self.lm_head)
        packed = packed and isinstance(head, _PackedMatmul)
        plan = (plan, (self.model.norm.weight, self.model.norm.eps, head))
        if packed:
            params = list({id(p): p for p in self.parameters()}.values())
            self.__dict__["_plan_cache"] = (params, _param_state(params), plan)
        else:
            self.__dict__.pop("_plan_cache", None)
        return plan

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
