"""GRPO on one device, written so that one iteration's gradient can be computed by any number of replicas.

Why the split into ``compute_grad_sum`` / ``reduce`` / ``GRPOTrainer.apply``: the runtime shifts devices into
and out of the train role at any moment, so the set of replicas that computes the gradients of one iteration
is not known in advance. Each replica therefore returns the *un-normalised* sum of per-token-loss gradients
over the micro-batches it was given, together with its token count; the reduction adds sums and counts, and
the single optimizer owner divides by the global token count. Token-level aggregation (every response token
weighs the same, whatever sequence it belongs to) makes that division exact, so 1, 2, 3 or 7 replicas on
disjoint micro-batches give the single-replica gradient up to float summation order.

Loss per response token t of sample i (PPO-style clipped surrogate with group-normalised advantages):

    r_t   = exp(logp_t - logp_rollout_t)
    pg_t  = -min(r_t * A_i, clip(r_t, 1-eps, 1+eps) * A_i)
    kl_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (k3 estimator, only with a reference model)
    loss  = sum_t (pg_t + beta * kl_t) / total_response_tokens_of_the_iteration
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------------


def compute_advantages(
    rewards: Sequence[float], group_ids: Sequence[Any], eps: float = 1e-6, scale_by_std: bool = True
) -> list[float]:
    """Group-normalised advantages: (r - mean_group) / (std_group + eps).

    A group whose rewards are all equal carries no preference signal and gets zero advantage. The std is the
    population std of the group (GRPO's choice); ``scale_by_std=False`` gives the mean-centred variant.
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"rewards ({len(rewards)}) and group_ids ({len(group_ids)}) differ in length")
    groups: dict[Any, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for members in groups.values():
        vals = [float(rewards[i]) for i in members]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
        for i, v in zip(members, vals, strict=True):
            out[i] = (v - mean) / (std + eps) if scale_by_std else v - mean
    return out


# ----------------------------------------------------------------------------------------------------
# Samples and micro-batches
# ----------------------------------------------------------------------------------------------------


@dataclass
class TrainSample:
    """One rollout to learn from. ``old_logprobs`` are the rollout engine's per-token log-probs (None means
    on-policy: the ratio is then 1 and only its gradient matters)."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    old_logprobs: list[float] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.response_ids)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T] right-padded prompt+response
    mask: torch.Tensor  # [B, T-1] 1 where the *target* token is a response token
    old_logprobs: torch.Tensor  # [B, T-1] aligned with targets (NaN where unknown)
    advantages: torch.Tensor  # [B]


def collate(samples: Sequence[TrainSample], pad_id: int) -> MicroBatch:
    """Right-pad prompt+response; targets are shifted by one, so response token k of a sample with prompt
    length P is predicted at position P-1+k."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    width = max(lengths)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width - 1), dtype=torch.bool)
    old = torch.full((len(samples), width - 1), float("nan"), dtype=torch.float64)
    for b, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p == 0:
            raise ValueError("a training sample needs a non-empty prompt")
        ids[b, : p + r] = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        mask[b, p - 1 : p - 1 + r] = True
        if s.old_logprobs is not None:
            if len(s.old_logprobs) != r:
                raise ValueError(f"old_logprobs has {len(s.old_logprobs)} entries for {r} response tokens")
            old[b, p - 1 : p - 1 + r] = torch.tensor(s.old_logprobs, dtype=torch.float64)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
    return MicroBatch(ids, mask, old, adv)


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, V] from either the engine's compact ``CausalLM`` (returns a tensor) or a HF model."""
    out = model(input_ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(x_{t+1} | x_<=t) for every position, [B, T-1], under the sampling temperature."""
    logits = forward_logits(model, input_ids)[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


# ----------------------------------------------------------------------------------------------------
# Gradient sums (what a train replica returns) and their reduction
# ----------------------------------------------------------------------------------------------------


@dataclass
class GradSum:
    """Un-normalised sum over response tokens of per-token-loss gradients, plus the statistics to report.

    Adding two GradSums (``reduce``) is exactly what a tree reduction across replicas needs; the division by
    the global token count happens once, in ``GRPOTrainer.apply``.
    """

    grads: dict[str, torch.Tensor]
    tokens: int = 0
    samples: int = 0
    version: int = 0
    loss_sum: float = 0.0
    pg_sum: float = 0.0
    kl_ref_sum: float = 0.0
    kl_old_sum: float = 0.0
    clipped: int = 0
    nonfinite: bool = False

    def __add__(self, other: GradSum) -> GradSum:
        if other.version != self.version:
            raise ValueError(f"cannot reduce gradients of policy versions {self.version} and {other.version}")
        grads = dict(self.grads)
        for name, g in other.grads.items():
            grads[name] = grads[name] + g if name in grads else g.clone()
        return GradSum(
            grads=grads,
            tokens=self.tokens + other.tokens,
            samples=self.samples + other.samples,
            version=self.version,
            loss_sum=self.loss_sum + other.loss_sum,
            pg_sum=self.pg_sum + other.pg_sum,
            kl_ref_sum=self.kl_ref_sum + other.kl_ref_sum,
            kl_old_sum=self.kl_old_sum + other.kl_old_sum,
            clipped=self.clipped + other.clipped,
            nonfinite=self.nonfinite or other.nonfinite,
        )


def reduce(grad_sums: Iterable[GradSum]) -> GradSum:
    """Sum the gradient sums of any number of replicas (order only changes float rounding)."""
    items = list(grad_sums)
    if not items:
        raise ValueError("reduce needs at least one GradSum")
    total = items[0]
    for g in items[1:]:
        total = total + g
    return total


@dataclass(frozen=True)
class LossConfig:
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    temperature: float = 1.0


#: What one more chunk's forward/backward costs, in tokens of compute, per device type. Measured on the
#: 2-core CPU with the quickstart's 0.13M-parameter policy and its reference: ~3.5 ms of fixed cost per
#: call against ~28 us per token (about 125 tokens). On an accelerator a launch sequence costs far more
#: tokens; the value there is a guess that leaves padding cuts to batches with a long tail.
CHUNK_COST_TOKENS: dict[str, int] = {"cpu": 128, "cuda": 2048}


def padding_chunks(lengths: Sequence[int], max_rows: int, chunk_cost_tokens: int) -> list[tuple[int, int]]:
    """Split ascending ``lengths`` into contiguous ``[start, stop)`` chunks of at most ``max_rows`` rows that
    minimise padded tokens (each row padded to its chunk's longest) plus ``chunk_cost_tokens`` per chunk.

    Why: a micro-batch pads every row to its longest, and a long-tailed batch of 128 rollouts computed about
    twice its real tokens. Cutting the sorted batch where lengths jump removes that waste, while the per-chunk
    cost keeps a uniform batch whole. Exact dynamic programming, O(n · max_rows).
    """
    n = len(lengths)
    if any(b < a for a, b in itertools.pairwise(lengths)):
        raise ValueError("padding_chunks needs lengths in ascending order")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for stop in range(1, n + 1):
        width = lengths[stop - 1]
        for start in range(max(0, stop - max_rows), stop):
            cost = best[start] + (stop - start) * width + chunk_cost_tokens
            if cost < best[stop]:
                best[stop], cut[stop] = cost, start
    chunks = []
    stop = n
    while stop > 0:
        chunks.append((cut[stop], stop))
        stop = cut[stop]
    return chunks[::-1]


def compute_grad_sum(
    model: torch.nn.Module,
    samples: Sequence[TrainSample],
    *,
    pad_id: int,
    micro_batch: int,
    loss: LossConfig = LossConfig(),
    ref_model: torch.nn.Module | None = None,
    version: int = 0,
    chunk_cost_tokens: int | None = None,
) -> GradSum:
    """Forward/backward ``samples`` in micro-batches on ``model`` and return the local gradient *sum*.

    Stateless with respect to the optimizer, so any replica holding the policy weights of ``version`` can run
    it. ``model``'s ``.grad`` fields are used as scratch and left zeroed. The samples, sorted by length, run
    in chunks of at most ``micro_batch`` chosen by `padding_chunks` (``chunk_cost_tokens``: what one more
    forward/backward costs, in padded tokens; default by device, `CHUNK_COST_TOKENS`).
    """
    if loss.kl_coef > 0 and ref_model is None:
        raise ValueError("kl_coef > 0 needs a reference model")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    for p in params.values():
        p.grad = None
    out = GradSum(grads={}, version=version)
    # Similar lengths together: less padding; the sum does not depend on how samples are grouped.
    live = [s for s in samples if s.num_tokens > 0]
    live.sort(key=lambda s: len(s.prompt_ids) + s.num_tokens)
    lengths = [len(s.prompt_ids) + s.num_tokens for s in live]
    if chunk_cost_tokens is None:
        device_type = next(model.parameters()).device.type
        chunk_cost_tokens = CHUNK_COST_TOKENS.get(device_type, CHUNK_COST_TOKENS["cuda"])
    model.train()
    for start, stop in padding_chunks(lengths, micro_batch, chunk_cost_tokens):
        chunk = live[start:stop]
        mb = collate(chunk, pad_id)
        stats = _micro_batch_loss(model, mb, loss, ref_model)
        stats["loss"].backward()
        out.tokens += int(mb.mask.sum())
        out.samples += len(chunk)
        out.loss_sum += float(stats["loss"].detach())
        out.pg_sum += stats["pg"]
        out.kl_ref_sum += stats["kl_ref"]
        out.kl_old_sum += stats["kl_old"]
        out.clipped += stats["clipped"]
    for n, p in params.items():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out.grads[n] = g.detach().clone()
        p.grad = None
    out.nonfinite = not all(bool(torch.isfinite(g).all()) for g in out.grads.values()) or not math.isfinite(
        out.loss_sum
    )
    return out


def _micro_batch_loss(
    model: torch.nn.Module, mb: MicroBatch, cfg: LossConfig, ref_model: torch.nn.Module | None
) -> dict[str, Any]:
    dev = next(model.parameters()).device
    ids = mb.input_ids.to(dev)
    mask = mb.mask.to(dev)
    logp = token_logprobs(model, ids, cfg.temperature)
    dtype = logp.dtype
    old = mb.old_logprobs.to(dev, dtype)
    old = torch.where(torch.isnan(old), logp.detach(), old)  # unknown rollout logprobs: on-policy
    adv = mb.advantages.to(dev, dtype).unsqueeze(1)
    ratio = torch.exp(logp - old)
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)
    pg = -torch.minimum(ratio * adv, clipped_ratio * adv)
    per_token = pg
    kl_ref = torch.zeros_like(logp)
    if ref_model is not None:
        with torch.no_grad():
            ref = token_logprobs(ref_model, ids, cfg.temperature).to(dtype)
        d = ref - logp
        kl_ref = torch.exp(d) - d - 1.0
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl_ref
    d_old = (old - logp).detach()
    kl_old = torch.exp(d_old) - d_old - 1.0
    m = mask.to(dtype)
    is_clipped = ((ratio - clipped_ratio).abs() > 0) & mask
    return {
        "loss": (per_token * m).sum(),
        "pg": float((pg.detach() * m).sum()),
        "kl_ref": float((kl_ref.detach() * m).sum()),
        "kl_old": float((kl_old * m).sum()),
        "clipped": int(is_clipped.sum()),
    }
