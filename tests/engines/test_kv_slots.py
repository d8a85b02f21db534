"""`KVSlots` stores keys in transposed blocks of 16 positions (one contiguous run per head, see its
docstring): whatever the layout, a position written is the position read back, and copies of a prefix
(compaction, growing the cache) move exactly that prefix."""

from __future__ import annotations

import torch

from pivotrl.engines.checkpoints import make_config
from pivotrl.engines.kv_cache import KEY_BLOCK, KVSlots


def _filled(max_len: int = 40, seed: int = 0):
    config = make_config("debug")
    cache = KVSlots(config, slots=3, max_len=max_len, device="cpu", dtype=torch.float32)
    layers, kv, d = config.num_hidden_layers, config.num_key_value_heads, cache.kv.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    lengths = [33, 5, 17]
    keys = [torch.randn(layers, n, kv, d, generator=gen) for n in lengths]
    values = [torch.randn(layers, n, kv, d, generator=gen) for n in lengths]
    for layer in range(layers):
        for slot, n in enumerate(lengths):
            where = torch.full((n,), slot), torch.arange(n)
            cache.store(layer, *where, keys[slot][layer], values[slot][layer])
    return cache, lengths, keys, values


def test_cache_length_rounds_up_to_whole_key_blocks():
    cache, *_ = _filled(max_len=40)
    assert cache.max_len == 48 and cache.max_len % KEY_BLOCK == 0


def test_keys_and_values_read_back_what_was_stored():
    cache, lengths, keys, values = _filled()
    for layer in range(cache.kv.shape[0]):
        read = cache.keys(layer, 3, max(lengths))  # [slots, kv_heads, span, d]
        for slot, n in enumerate(lengths):
            assert torch.equal(read[slot, :, :n], keys[slot][layer].transpose(0, 1))
            assert torch.equal(cache.v[layer, slot, :, :n], values[slot][layer].transpose(0, 1))
        # the storage really is blocked: position 17's key sits at lane 1 of block 1, stride 16 over d
        head = cache.kv[layer, 0, 0, 0].reshape(-1)
        d = cache.kv.shape[-1]
        assert torch.equal(head[KEY_BLOCK * d + 1 :: KEY_BLOCK][:d], keys[0][layer, 17, 0])


def test_copy_slots_and_grown_keep_each_prefix():
    cache, lengths, keys, values = _filled()
    cache.copy_slots([2], [1], lengths[2])  # compaction: slot 2's sequence moves into slot 1
    for layer in range(cache.kv.shape[0]):
        assert torch.equal(cache.keys(layer, 2, 17)[1], keys[2][layer].transpose(0, 1))
        assert torch.equal(cache.v[layer, 1, :, :17], values[2][layer].transpose(0, 1))
    bigger = cache.grown(100, n=2)
    assert bigger.max_len == 112
    for layer in range(cache.kv.shape[0]):
        assert torch.equal(bigger.keys(layer, 2, 33)[0], keys[0][layer].transpose(0, 1))
        assert torch.equal(bigger.keys(layer, 2, 17)[1], keys[2][layer].transpose(0, 1))
        assert torch.equal(bigger.v[layer, 0, :, :33], values[0][layer].transpose(0, 1))
    assert not bigger.kv[:, :, 2].any()  # slot 2 was not asked for


def test_a_cache_and_its_growth_ask_the_kernel_for_no_huge_pages(monkeypatch):
    """The cache is allocated per engine and again at every growth; asking for huge pages there made the
    kernel compact memory first, 0.22-0.29 s a cache in a churned process (docs/decisions.md, "The KV
    cache stays on ordinary pages"). Every madvise call is recorded; none may cover the cache's memory."""
    import pivotrl.malloc as malloc

    calls: list[tuple[int, int, int]] = []

    def record(addr: int, n: int, advice: int) -> int:
        calls.append((addr, n, advice))
        return 0

    monkeypatch.setattr(malloc, "_madvise", lambda: record)
    config = make_config("debug")
    # large enough that `huge_pages` would act on it (over `MIN_HUGE_BYTES`)
    cache = KVSlots(config, slots=64, max_len=1024, device="cpu", dtype=torch.float32)
    assert cache.nbytes() >= malloc.MIN_HUGE_BYTES
    bigger = cache.grown(2048, 3)
    for c in (cache, bigger):
        lo, hi = c.kv.data_ptr(), c.kv.data_ptr() + c.nbytes()
        assert not [x for x in calls if x[0] < hi and x[0] + x[1] > lo]
