"""One GPU memory budget for everything a GPU worker holds: the store's device tier, fetched state, engines.

Why: vLLM sizes itself as a *fraction of the whole card* (`gpu_memory_utilization`) and refuses to start
when that fraction is more than what is free at start-up. Everything else this process keeps on the GPU
— the GPS device tier (32 GiB in the paper config), a trainer that has not emptied the CUDA cache, a
sleeping engine — is outside that fraction. A fixed fraction (0.5 before) is therefore wrong both ways: it
fails the start-up check on a card shared with the tier, and wastes half an otherwise empty card. Here the
fraction is computed from what is free, minus what the tier may still grow by, minus a headroom for this
process's own CUDA allocations; and a model that cannot fit is refused with the numbers, before vLLM
spends a minute starting.

Pure arithmetic (no torch, no CUDA): the facts — total and free bytes, tier capacity and holdings, the
model's sizes — are measured by the caller (`device_memory.read_cuda_memory`) and passed in, so the paper
configuration can be checked against an 80 GB card in a test without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from pivotrl.errors import UserError

GiB = 1 << 30
DEFAULT_HEADROOM = 2 * GiB  # this worker's CUDA context, the caching allocator's slack, NCCL buffers
DEFAULT_ACTIVATIONS = 1 * GiB  # vLLM's profiled forward peak beyond weights, for a small max_num_seqs
DEFAULT_CEILING = 0.92  # never hand vLLM the whole card, whatever is free


class BudgetError(UserError):
    """The model (or its KV budget) does not fit the device's free memory; the message has the numbers."""


@dataclass(frozen=True)
class DeviceMemory:
    """Measured: a CUDA device's total and currently free bytes (`torch.cuda.mem_get_info`)."""

    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class TierHold:
    """What the GPS device tier may take on this device: its capacity and what it holds now (already
    counted as used in `DeviceMemory.free_bytes`, so only the remaining growth is reserved)."""

    capacity_bytes: int
    held_bytes: int

    @property
    def growth_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.held_bytes)


@dataclass(frozen=True)
class EngineNeed:
    """An engine's memory needs: its weights, the KV bytes per cached token, the tokens it must cache."""

    weights_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int
    activations_bytes: int = DEFAULT_ACTIVATIONS

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.activations_bytes + self.kv_bytes_per_token * self.kv_tokens


@dataclass(frozen=True)
class Budget:
    """The engine's share: the fraction to pass to vLLM, its bytes, and how many KV tokens fit in it."""

    gpu_memory_utilization: float
    engine_bytes: int
    reserved_bytes: int  # tier growth + headroom, kept out of the engine's share
    kv_tokens_fit: int | None  # None when no `EngineNeed` was given


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of K and V cached per token by a decoder with grouped-query attention."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def engine_budget(
    mem: DeviceMemory,
    tier: TierHold | None = None,
    need: EngineNeed | None = None,
    *,
    headroom_bytes: int = DEFAULT_HEADROOM,
    ceiling: float = DEFAULT_CEILING,
    what: str = "engine",
) -> Budget:
    """vLLM's `gpu_memory_utilization` for this device now, or a `BudgetError` naming what does not fit.

    The fraction satisfies vLLM's start-up rule (fraction × total <= free) with the tier's growth and the
    headroom kept out. With `need`, the share must hold the weights and activations and at least one
    token of KV; `kv_tokens_fit` then says how many tokens vLLM's paged cache will have (fewer than
    `need.kv_tokens` means vLLM preempts under a full admission budget, which is allowed, not an error).
    """
    if mem.total_bytes <= 0 or not 0 <= mem.free_bytes <= mem.total_bytes:
        raise ValueError(f"device memory: free {mem.free_bytes} of total {mem.total_bytes} is not a reading")
    if not 0.0 < ceiling <= 1.0:
        raise ValueError(f"ceiling={ceiling}: expected a fraction in (0, 1]")
    reserved = headroom_bytes + (tier.growth_bytes if tier is not None else 0)
    engine_bytes = min(mem.free_bytes - reserved, int(ceiling * mem.total_bytes))
    tier_note = f", gps.device_tier_bytes={gb(tier.capacity_bytes)}" if tier is not None else ""
    if engine_bytes <= 0:
        raise BudgetError(
            f"{what}: no GPU memory left for it ({gb(mem.free_bytes)} free of {gb(mem.total_bytes)}, "
            f"{gb(reserved)} reserved{tier_note}); lower gps.device_tier_bytes or free the device"
        )
    kv_fit = None
    if need is not None:
        fixed = need.weights_bytes + need.activations_bytes
        room = engine_bytes - fixed
        if room < need.kv_bytes_per_token:
            raise BudgetError(
                f"{what}: needs {gb(fixed)} for weights and activations plus KV, but only {gb(engine_bytes)} "
                f"of the GPU's {gb(mem.total_bytes)} can be its share ({gb(mem.free_bytes)} free, "
                f"{gb(reserved)} reserved{tier_note}); lower gps.device_tier_bytes or use a larger GPU"
            )
        kv_fit = room // max(1, need.kv_bytes_per_token)
    # vLLM compares fraction × total with free memory: round the fraction down, never up
    fraction = int(engine_bytes / mem.total_bytes * 1e4) / 1e4
    return Budget(fraction, engine_bytes, reserved, kv_fit)


def max_tier_bytes(total_bytes: int, need: EngineNeed, *, headroom_bytes: int = DEFAULT_HEADROOM) -> int:
    """The largest device tier that still leaves `need` (weights, activations, all its KV tokens) room on an
    otherwise empty card of `total_bytes`; 0 or less means the engine alone does not fit."""
    return total_bytes - headroom_bytes - need.total_bytes


def host_allows_sleep(weights_bytes: int, available_host_bytes: int, share: float = 0.5) -> bool:
    """May an engine sleep at level 1 (its weights copied to host memory)? Only if they take at most
    `share` of the host memory available now: the GPS host tier and the trainer live there too."""
    return 0 < weights_bytes <= share * available_host_bytes
