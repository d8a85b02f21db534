"""The device tier never takes a second copy of a version it would refuse (on a GPU that copy is memory
outside every engine's budget), and a version that fits is copied to the tier's device once."""

from __future__ import annotations

import torch

from pivotrl.gps import ParameterStore
from pivotrl.gps import store as store_mod
from pivotrl.gps.device_tier import DeviceTier


def state(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {f"w{i}": torch.randn(64, 64, generator=g) for i in range(n)}  # 16 KiB each


def test_admits_counts_held_entries_and_the_key_itself():
    tier = DeviceTier(100_000)
    assert tier.admits(60_000) and not tier.admits(100_001) and not tier.admits(0)
    tier.put(("m", 0), {"a": torch.zeros(10_000)}, ["a"], held=True)  # 40 kB held
    assert not tier.admits(70_000) and tier.admits(60_000)
    assert tier.admits(60_000, ("m", 0))  # merging into the held entry: its own 40 kB + 60 kB
    assert not tier.admits(60_001, ("m", 0))


def test_an_oversized_version_is_never_moved_to_the_tier_device(tmp_path, monkeypatch):
    moves: list[str] = []
    real = store_mod.move_packed

    def counting(tensors, device):
        moves.append(torch.device(device).type)
        return real(tensors, device)

    monkeypatch.setattr(store_mod, "move_packed", counting)
    with ParameterStore(tmp_path, device_tier_bytes=0) as w:
        w.publish("big", 0, state(8))  # 128 KiB
        w.publish("small", 0, state(2))  # 32 KiB
        w.flush()
    # a tier on another device (meta: no memory), 64 KiB: "big" must not be copied there at all
    with ParameterStore(tmp_path, device_tier_bytes=64 << 10, device="meta") as r:
        got = r.fetch("big", 0, device="cpu")
        assert moves == [] and r.device_tier.cached() == []
        assert torch.equal(got["w3"], state(8)["w3"])
        r.fetch("small", 0, device="meta", copy=False)
        assert moves == ["meta"] and r.device_tier.cached() == [("small", 0)]  # once, and delivered as is
        r.publish("big", 1, state(8))  # a held publish larger than the tier stays on the host only
        assert moves == ["meta"] and ("big", 1) not in r.device_tier.cached()
        r.flush()
