"""Sampling of a decode batch, keyed so that a sequence's draws depend only on its seed and position.

Why keyed noise and no RNG state: a sequence aborted on one replica and resumed on another must draw the
same numbers, and which other sequences share its batch must not change what it samples.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """Murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2^32) (low bits wrap correctly)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def keyed_uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A uniform in (0, 1) that depends only on (seed, index): the sampling noise of token `index`."""
    x = _fmix32((seed & _MASK32) ^ ((seed >> 32) & _MASK32) * 0x27D4EB2F & _MASK32)
    x = _fmix32(x ^ (((index + 1) * 0x9E3779B1) & _MASK32))
    x = _fmix32(x ^ 0x165667B1)
    return ((x >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    index: torch.Tensor,
) -> torch.Tensor:
    """Vectorised sampling for a batch: greedy where temperature == 0, else top-p by inverse CDF.

    Row b uses the uniform `keyed_uniform(seed[b], index[b])`, so its draw depends on nothing else.
    """
    tokens = logits.argmax(-1)
    sampled = temperature > 0
    if bool(sampled.any()):
        rows = sampled.nonzero().squeeze(1)
        uniform = keyed_uniform(seed[rows], index[rows])
        scaled = logits[rows] / temperature[rows, None]
        probs = torch.softmax(scaled, dim=-1)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        kept = torch.where(before < top_p[rows, None], sorted_p, torch.zeros_like(sorted_p))
        cdf = kept.cumsum(-1)
        target = uniform[:, None] * cdf[:, -1:]
        pick = (cdf < target).sum(-1).clamp_max(logits.shape[-1] - 1)
        tokens[rows] = order.gather(1, pick[:, None]).squeeze(1)
    return tokens
