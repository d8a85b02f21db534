"""Measured CUDA memory facts for `gpu_budget`, and the one call every offload ends with.

Why a separate module: `gpu_budget` is arithmetic on facts; reading them (and freeing the caching
allocator's blocks) needs torch and a device, and must be a no-op on a CPU-only machine.
"""

from __future__ import annotations

import torch

from pivotrl.engines.gpu_budget import DeviceMemory, TierHold


def is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def read_cuda_memory(device: str | torch.device = "cuda:0") -> DeviceMemory | None:
    """Total and free bytes of `device` as the driver sees them (other processes included); None off CUDA."""
    if not is_cuda(device) or not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return DeviceMemory(total_bytes=int(total), free_bytes=int(free))


def tier_hold(tier: object, device: str | torch.device) -> TierHold | None:
    """The GPS device tier's share of `device` (None when the tier lives elsewhere, e.g. on the host)."""
    tier_device = getattr(tier, "device", None)
    if tier_device is None or torch.device(tier_device).type != torch.device(device).type:
        return None
    return TierHold(capacity_bytes=int(tier.capacity), held_bytes=int(tier.nbytes))  # type: ignore[attr-defined]


def free_cuda_cache() -> bool:
    """Give the caching allocator's unused blocks back to the driver, so the next role (vLLM above all,
    which checks *driver*-free memory at start-up) can have them; True if there was a CUDA cache to free."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return True
