"""The engine's KV cache: one pre-allocated buffer of slots, laid out for the decode kernels.

Why its own layout rather than HF's per-layer cache: the generation engine keeps its running sequences in
slots 0..B-1 of one buffer allocated once (no per-step reallocation, decode attends to a plain view), and
the native attention kernel (`kernels.py`, `csrc/decode_attention.cpp`) reads keys in the blocked layout
described at `KVSlots`. The torch decode path (`model.Attention.decode`) reads the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pivotrl.engines.arch import head_dim

KEY_BLOCK = 16  # positions per key block of the cache (one AVX-512 vector of fp32 scores)


class KVSlots:
    """Pre-allocated KV cache: [layers, 2 (keys, values), slots, kv_heads, max_len, head_dim] in ONE buffer.

    Allocated once per engine; a sequence owns one slot for its lifetime on the engine, and the running
    sequences are kept compact in slots 0..B-1 so decode attends to a plain view, never a gather.
    Values are stored [max_len, head_dim] per head. Keys are stored in blocks of `KEY_BLOCK` positions, each
    block TRANSPOSED ([head_dim, KEY_BLOCK] in memory): decode scores are then q times row-major 16-wide
    rows, which the native kernel (`kernels.py`) reads one vector load each, and a sequence's first n keys
    are ONE contiguous run of memory (ceil(n / 16) blocks), which the hardware prefetcher streams; a plain
    [head_dim, max_len] transpose would split them into head_dim short runs that it does not foresee, and
    decode attention would wait on memory. Either way the first n positions of a head occupy the first
    round_up(n, 16) x head_dim elements of its block, so copies of a prefix (`copy_slots`, `grown`) are the
    same for keys and values. `kv[layer]` is the one contiguous block the kernel takes per layer.
    """

    def __init__(self, config, slots: int, max_len: int, device, dtype) -> None:
        kv_heads, d, layers = config.num_key_value_heads, head_dim(config), config.num_hidden_layers
        max_len = _round_up(max_len, KEY_BLOCK)
        self.kv = torch.empty((layers, 2, slots, kv_heads, max_len, d), device=device, dtype=dtype)
        # Ordinary pages, not huge ones: a cache is allocated per engine and again at every growth
        # (`grown`), and in a process whose memory other work has churned, asking for huge pages there made
        # the kernel compact memory first (docs/decisions.md, "The KV cache stays on ordinary pages").
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
