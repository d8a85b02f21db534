"""CPU weight packing and fused matmuls for the compact model's no-grad calls.

Why: on CPU a decode step of a small model is dominated by per-call overhead, not FLOPs. MKL re-packs a
Linear's weight on every call, and q/k/v and gate/up are separate matmuls over the same input. Here a
weight is packed once (`PackedWeight`: the native matmul of `kernels.py` where it is built, else oneDNN's
prepacked format), q/k/v and gate/up become one matmul each (`FusedLinear`), and the native decode loop
gets every matmul resolved once per weight version (`plan`). Every copy follows its weights (tensor
version and storage), so a packed model never computes with stale weights; training (grad enabled) never
touches any of it. Nothing here owns parameters or appears in a state dict.

The model (`model.py`) calls `linear` and `FusedLinear`; an engine switches packing on through
`CausalLM.pack_for_inference` (`pack_for_inference` below).
"""

from __future__ import annotations

import functools
import operator
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pivotrl.malloc import huge_pages

Matmul = Callable[[torch.Tensor], torch.Tensor]

#: Multiply-accumulates (rows × in × out) from which a bf16 call goes to oneDNN on a CPU with AMX tiles
#: (`amx_handoff`). Measured on an Intel Xeon with AMX-BF16 (one thread, `small`'s weights): oneDNN's
#: tiles take 21–30 µs for up to 16 rows, fixed cost mostly, while our AVX-512 matmul's time grows with
#: the rows (about 100 GFLOP/s); they cross at 0.9–1.5 M multiply-accumulates for every weight shape,
#: and at 32 rows oneDNN is 1.2–3.7× faster (docs/engine.md, "A CPU with AMX tiles").
AMX_MIN_MACS = 1 << 20
AMX_ENV = "PIVOTRL_AMX"


@functools.cache
def _cpu_has_amx_bf16() -> bool:
    read = getattr(torch._C._cpu, "_get_cpu_capability", None)
    caps = read() if read is not None else {}
    return bool(caps.get("amx_bf16") and caps.get("amx_tile"))


def amx_handoff() -> bool:
    """Whether large bf16 calls go to oneDNN (`PackedWeight`): the CPU has AMX-BF16 tiles, which oneDNN
    uses and our kernels do not, oneDNN runs bf16 here, and ``PIVOTRL_AMX`` is not ``off`` (it forces our
    matmul for every call, so that tests and benchmarks run both paths)."""
    value = os.environ.get(AMX_ENV, "auto").strip().lower() or "auto"
    if value not in ("auto", "off"):
        raise ValueError(f"{AMX_ENV}={value!r}: expected auto or off")
    return value == "auto" and can_pack() and _cpu_has_amx_bf16() and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported())


def can_pack() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packable(dtype: torch.dtype, native: object | None = None) -> bool:
    """Weight dtypes packed on this CPU (`PackedWeight`): fp32 always; bf16 where the CPU has native bf16
    support (avx512_bf16 / AMX; otherwise oneDNN would emulate it and the packed path is no faster) or the
    native kernels' own bf16 matmul was built."""
    if dtype == torch.float32:
        return can_pack() or (native is not None and bool(native.has_linear_fp32()))
    if dtype != torch.bfloat16:
        return False
    if native is not None and bool(native.has_linear_bf16()):
        return True
    return can_pack() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedWeight:
    """A Linear weight packed once for no-grad CPU calls.

    With the native kernels (`kernels.py`, `csrc/kernels_impl.h`; fp32 on AVX-512 and AVX2, bf16 on
    AVX512-BF16): our own packing and matmul, faster than oneDNN's on decode-sized batches (no per-call
    primitive lookup, and it requests the next panels of the weight while it multiplies). Otherwise
    oneDNN's prepacked weight. A bf16 weight on a CPU with AMX tiles keeps both (`amx_handoff`): a call of
    at least `AMX_MIN_MACS` goes to oneDNN, whose tiles multiply a decode batch or a prefill several times
    faster than AVX-512 does; a small one stays on ours, which has no fixed cost per call.
    """

    __slots__ = ("data", "native", "onednn", "onednn_rows", "out_features")

    def __init__(self, w: torch.Tensor, native: object | None) -> None:
        w = w.detach()
        self.out_features = w.shape[0]
        self.onednn, self.onednn_rows = None, 0
        if _native_linear(native, w):
            self.native, self.data = native, native.pack_linear(w)
            if w.dtype == torch.bfloat16 and amx_handoff():
                self.onednn = torch.ops.mkldnn._reorder_linear_weight(w, 32)
                self.onednn_rows = max(1, -(-AMX_MIN_MACS // w.numel()))
        else:
            self.native, self.data = None, torch.ops.mkldnn._reorder_linear_weight(w, 32)

    def bias_for(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """`bias` as a call takes it fastest: the native matmul adds an fp32 bias (converted once by a
        caller that keeps it, rather than inside every call); oneDNN takes the weight's dtype."""
        return bias.detach().float() if bias is not None and self.native is not None else bias

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.native is not None:
            if self.onednn is not None and x.numel() >= self.onednn_rows * x.shape[-1]:
                return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
            return self.native.linear(x, self.data, bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")

    def memory(self) -> list[tuple[int, int]]:
        """(address, bytes) of each packed copy: ours and oneDNN's where both are kept."""
        if self.native is None:
            out, onednn = [], self.data
        else:
            out, onednn = [(self.data.data_ptr(), self.data.numel() * self.data.element_size())], self.onednn
        if onednn is not None:
            out.append((torch.ops.mkldnn.data_ptr(onednn), torch.ops.mkldnn._nbytes(onednn)))
        return out


def _native_linear(native: object | None, w: torch.Tensor) -> bool:
    """Whether the native kernels' matmul takes `w` (see `PackedWeight`). Not a bf16 weight of at least
    `AMX_MIN_MACS` elements on a CPU with AMX tiles: every call of it, one row included, goes to oneDNN
    (`amx_handoff`), and our copy would only double its memory (a 7B model's 14 GB)."""
    if native is None:
        return False
    if w.dtype == torch.float32:
        return bool(native.has_linear_fp32())
    if w.dtype != torch.bfloat16 or w.shape[1] % 2 or not native.has_linear_bf16():
        return False
    return w.numel() < AMX_MIN_MACS or not amx_handoff()


def linear(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`m(x)`, through a packed weight (`PackedWeight`) when the module was packed and no gradient is wanted.

    Why: for decode-sized batches on CPU, MKL re-packs the weight on every call; a weight packed once is
    15-35% faster. The packed copy is refreshed whenever the weight changes (its tensor version or storage
    moves, as on `load_state_dict`, an optimizer step or `.to()`), so a packed module never computes with
    stale weights; a weight cast to a dtype that is not packed (see `packable`) or moved off the CPU
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
    if w.device.type != "cpu" or not packable(w.dtype, packed[0].native):  # moved or cast out of reach
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
        # Off until an inference engine asks (`pack_for_inference`): a trainer's no-grad passes
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
        if self.pack and w.device.type == "cpu" and packable(w.dtype, self.native):
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


class PackedMatmul:
    """A packed weight with its bias bound, as the native loop calls it (see `plan`)."""

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
        return PackedMatmul(packed, bias) if packed is not None else m
    packed = _current_pack(m)
    return PackedMatmul(packed, m.bias) if packed is not None else lambda x: linear(m, x)


_VERSION = operator.attrgetter("_version")


def _param_state(params: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Storage addresses and versions of `params`: they move with every update (in place or not)."""
    return list(map(torch.Tensor.data_ptr, params)), list(map(_VERSION, params))


def pack_for_inference(model: nn.Module, enable: bool = True) -> bool:
    """Prepack `model`'s inference weights for fast CPU calls (`PackedWeight`: the native matmul when
    `model.native`, the native kernels' module, is set and has it, else oneDNN); returns whether packing
    is on.

    Also switches no-grad calls to the fused q/k/v and gate/up matmuls (`FusedLinear`; on CPU fp32/bf16
    packed fused, o/down/lm_head packed each on their own). Costs one extra copy of the weights; only
    no-grad calls use it, training is unchanged. `enable=False` drops every packed and fused copy (an
    offloaded engine gives the memory back) and returns no-grad calls to the per-layer path.
    """
    model.__dict__.pop("_plan_cache", None)  # it holds packed copies: rebuilt from the new state on use
    native = model.native
    fused = [f for m in model.modules() for f in vars(m).values() if isinstance(f, FusedLinear)]
    for f in fused:
        f.enabled = enable
    enable = enable and can_pack() and model.lm_head.weight.device.type == "cpu"
    in_fused = {id(p) for f in fused for p in f.parts}
    for f in fused:
        if (f.pack, f.native) != (enable, native):  # a copy packed the same way is kept
            f.pack, f.native = enable, native
            f.clear()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            if enable and packable(m.weight.dtype, native) and id(m) not in in_fused:
                old = m.__dict__.get("_packed")
                if old is None or old[0].native is not (native if _native_linear(native, m.weight) else None):
                    _pack(m, native)  # else kept: `repack` below refreshes it if the weight changed
            else:
                m.__dict__.pop("_packed", None)
    if enable:
        repack(model)
    return enable


def repack(model: nn.Module) -> None:
    """Bring every packed and fused weight copy of `model` up to date now (rather than at its next call)
    and back them with huge pages (`malloc.huge_pages`): a decode step reads them all. After new weights."""
    packed = []
    for m in model.modules():
        for f in vars(m).values():
            if isinstance(f, FusedLinear) and f.enabled:
                state = f.current()
                if state[3] is not None:
                    packed.append(state[3])
        if isinstance(m, nn.Linear) and (p := _current_pack(m)) is not None:
            packed.append(p)
    huge_pages([m for p in packed for m in p.memory()])


class LayerPlan(NamedTuple):
    """One block as the native decode loop calls it (`CausalLM._blocks`): norm weights with their eps,
    and the block's four matmuls as one-argument calls."""

    norm_in: torch.Tensor  # input_layernorm.weight
    eps_in: float
    qkv: Matmul  # (N, hidden) -> (N, (heads + 2 * kv_heads) * head_dim)
    o_proj: Matmul  # (N, heads * head_dim) -> (N, hidden)
    norm_post: torch.Tensor  # post_attention_layernorm.weight
    eps_post: float
    gate_up: Matmul  # (N, hidden) -> (N, 2 * intermediate)
    down: Matmul  # (N, intermediate) -> (N, hidden)


class Plan(NamedTuple):
    """Every block's `LayerPlan`, then the final norm and the head."""

    layers: list[LayerPlan]
    norm: torch.Tensor
    eps: float
    head: Matmul  # (N, hidden) -> (N, vocab)


def plan(model: nn.Module) -> Plan:
    """What the native loop of `CausalLM._blocks` reads, kept on `model` while its weights stand.

    Why: resolving each packed weight per call (its freshness check, module attribute lookups) cost more
    Python time per decode step than the norms' arithmetic. With every matmul packed, the plan is built
    once and kept while no parameter's storage or version moves (one check per step); otherwise it is
    rebuilt per call from the live modules.
    """
    cached = model.__dict__.get("_plan_cache")
    if cached is not None:
        params, key, kept = cached
        if _param_state(params) == key:
            return kept
    layers, packed = [], True
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        matmuls = (_bound(attn.qkv), _bound(attn.o_proj), _bound(mlp.gate_up), _bound(mlp.down_proj))
        packed = packed and all(isinstance(m, PackedMatmul) for m in matmuls)
        qkv, o_proj, gate_up, down = matmuls
        norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
        layers.append(
            LayerPlan(
                norm_in=norm_in.weight,
                eps_in=norm_in.eps,
                qkv=qkv,
                o_proj=o_proj,
                norm_post=norm_post.weight,
                eps_post=norm_post.eps,
                gate_up=gate_up,
                down=down,
            )
        )
    head = _bound(model.lm_head)
    packed = packed and isinstance(head, PackedMatmul)
    built = Plan(layers, model.model.norm.weight, model.model.norm.eps, head)
    if packed:
        params = list({id(p): p for p in model.parameters()}.values())
        model.__dict__["_plan_cache"] = (params, _param_state(params), built)
    else:
        model.__dict__.pop("_plan_cache", None)
    return built
