"""Copies of a state dict that cost one transfer, or one allocation, per dtype rather than one per tensor.

A state dict has ~200 tensors; fetched ones are views of one packed buffer per dtype (`pivotrl.gps.arena`),
and these helpers keep that layout when a store moves tensors to a device or copies them for a peer.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


def move_packed(tensors: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Copy tensors to `device` with one transfer per dtype instead of one per tensor.

    Tensors of one dtype are packed into one contiguous staging buffer (a no-op reuse when they already are
    views of one packed buffer, as fetched tensors are), copied in one `copy_`, and re-viewed on the device:
    ~200 small host-to-device copies would each pay a launch and a sync. The result never aliases the input.
    """
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for n, t in tensors.items():
        groups.setdefault(t.dtype, []).append((n, t))
    out: dict[str, torch.Tensor] = {}
    for dtype, items in groups.items():
        flat = _packed_source(items)
        if flat is None:
            flat = (
                torch.cat([t.detach().reshape(-1) for _, t in items])
                if items
                else torch.empty(0, dtype=dtype)
            )
        moved = torch.empty(flat.numel(), dtype=dtype, device=device)
        moved.copy_(flat, non_blocking=flat.device.type == "cpu" and flat.is_pinned())
        off = 0
        for n, t in items:
            out[n] = moved[off : off + t.numel()].view(t.shape)
            off += t.numel()
    return {n: out[n] for n in tensors}


def _packed_source(items: list[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
    """The 1-D view spanning `items` when they are contiguous, back to back, in one storage; else None."""
    if not items:
        return None
    first = items[0][1]
    storage, start = first.untyped_storage().data_ptr(), first.storage_offset()
    pos = start
    for _, t in items:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != pos:
            return None
        pos += t.numel()
    return first.detach().as_strided((pos - start,), (1,), start)


def packed_clone(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy CPU tensors into one fresh numpy-allocated buffer (one 64-byte aligned region per dtype).

    Why not `Tensor.clone()`: numpy asks the kernel for transparent huge pages on large allocations, torch's
    CPU allocator does not; first-touching 256 MB of 4 KiB pages costs more than the copy itself (the
    benchmark's device-tier hit went from slower than a disk read to several times faster).
    """
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for n, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError("packed_clone takes CPU tensors")
        groups.setdefault(t.dtype, []).append((n, t))
    out: dict[str, torch.Tensor] = {}
    sizes = {d: torch.empty((), dtype=d).element_size() for d in groups}
    spans = {d: -(-sum(t.numel() for _, t in items) * sizes[d] // 64) * 64 for d, items in groups.items()}
    whole = torch.from_numpy(np.empty(sum(spans.values()), dtype=np.uint8))  # one allocation, as for fetch
    base = 0
    for dtype, items in groups.items():
        size = sizes[dtype]
        flat = whole[base : base + spans[dtype]]
        base += spans[dtype]
        off = 0
        for n, t in items:
            nb = t.numel() * size
            dst = flat[off : off + nb].view(dtype).view(t.shape)
            dst.copy_(t)
            out[n] = dst
            off += nb
    return {n: out[n] for n in tensors}
