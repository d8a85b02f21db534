"""Shared helpers of the GPS tests: deterministic state dicts whose content identifies their version."""

from __future__ import annotations

import torch


def versioned_state_dict(version: int, layers: int = 3, width: int = 64) -> dict[str, torch.Tensor]:
    """Tensors whose every element encodes `version`, so a torn or mixed read is detectable."""
    sd: dict[str, torch.Tensor] = {}
    for i in range(layers):
        sd[f"layers.{i}.w"] = torch.full((width, width), float(version), dtype=torch.bfloat16)
        sd[f"layers.{i}.b"] = torch.arange(width, dtype=torch.float32) * (i + 1) + version * 1e3
        sd[f"layers.{i}.norm"] = torch.full((width,), float(version))
    sd["step"] = torch.tensor(version, dtype=torch.int64)
    return sd


def check_versioned(version: int, got: dict[str, torch.Tensor], layers: int = 3, width: int = 64) -> None:
    want = versioned_state_dict(version, layers, width)
    assert list(got) == list(want), f"v{version}: names differ"
    for k, w in want.items():
        assert got[k].dtype == w.dtype and got[k].shape == w.shape, f"v{version} {k}: dtype/shape"
        assert torch.equal(got[k], w), f"v{version} {k}: content differs (torn or mixed read)"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (compares NaN payloads and -0.0 exactly)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
