"""Workloads: the sequences of each GRPO iteration, drawn deterministically from the config's distributions.

The true response and critique lengths are drawn up front (the simulator needs them to know when a sequence
ends) but are *never* shown to the controller: it only learns a sequence's length when it finishes, exactly
like the real runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pivotrl.sim.config import LengthDist, WorkloadConfig


def draw_lengths(dist: LengthDist, n: int, rng: np.random.Generator) -> np.ndarray:
    """n integer lengths from `dist`, clipped to [min, max]."""
    if dist.dist == "constant":
        x = np.full(n, float(dist.value))
    elif dist.dist == "uniform":
        x = rng.integers(dist.low, dist.high + 1, size=n).astype(float)
    elif dist.dist == "empirical":
        x = rng.choice(np.asarray(dist.samples, dtype=float), size=n, replace=True)
    else:
        x = dist.median * np.exp(dist.sigma * rng.standard_normal(n))
    return np.clip(np.rint(x), dist.min, dist.max).astype(np.int64)


def mean_length(dist: LengthDist, rng_seed: int = 12345, n: int = 200_000) -> float:
    """The distribution's mean after clipping (by sampling: clipping makes closed forms awkward)."""
    if dist.dist == "constant":
        return float(min(max(dist.value, dist.min), dist.max))
    return float(draw_lengths(dist, n, np.random.default_rng(rng_seed)).mean())


def mean_position(dist: LengthDist, rng_seed: int = 12345, n: int = 200_000) -> float:
    """The mean number of tokens already generated when a token of `dist` is decoded, over all decoded
    tokens: E[L(L - 1) / 2] / E[L]. Long sequences decode more tokens, so this is past half the mean length
    (by cv² / 2 of the mean); by sampling, as `mean_length`."""
    if dist.dist == "constant":
        x = np.asarray([float(min(max(dist.value, dist.min), dist.max))])
    else:
        x = draw_lengths(dist, n, np.random.default_rng(rng_seed)).astype(float)
    return float((x * (x - 1.0)).mean() / (2.0 * max(x.mean(), 1e-12)))


def length_profile(dist: LengthDist, n: int, fractions: tuple[float, ...],
                   rng_seed: int = 12345, draws: int = 200_000) -> tuple[tuple[float, ...], float]:
    """What a runtime may know of a length distribution before measuring (as `mean_length`, by sampling
    the configured distribution, never the iteration's own draws): the lengths exceeded by each of
    `fractions` of the items, and the expected longest of `n` items, E[max] = sum of x_(i) ((i / N)^n -
    ((i - 1) / N)^n) over the N sorted samples.

    Why the expectation and not the 1 - 1/(n + 1) quantile: the longest of n items falls below that
    quantile with probability (1 - 1/(n + 1))^n ~ 1/e, so the quantile is the longest's 37th percentile,
    and on a lognormal tail 10-20 % below its mean. An iteration ends with its longest item, so a prior
    that low under-priced the long tail's stage in every iteration 0 (docs/decisions.md, "The prior's
    longest item is its expectation")."""
    x = np.sort(draw_lengths(dist, draws, np.random.default_rng(rng_seed)).astype(float))
    tail = tuple(float(v) for v in np.quantile(x, [1.0 - f for f in fractions]))
    below = (np.arange(x.size + 1) / x.size) ** max(n, 1)  # P(the longest of n is at most x_(i))
    return tail, float((np.diff(below) * x).sum())


@dataclass(slots=True)
class SeqSpec:
    """One rollout sequence of one iteration, with its (hidden) true lengths."""

    seq_id: str
    group_id: str
    iteration: int
    prompt_len: int
    response_len: int
    critique_len: int


def iteration_sequences(wl: WorkloadConfig, iteration: int, seed: int) -> list[SeqSpec]:
    """All P*G sequences of `iteration`: members of a group share their prompt (and its length)."""
    rng = np.random.default_rng([seed, iteration])
    p, g = wl.prompts_per_iteration, wl.group_size
    prompts = draw_lengths(wl.prompt_len, p, rng)
    responses = draw_lengths(wl.response_len, p * g, rng)
    critiques = draw_lengths(wl.critique_len, p * g, rng)
    out: list[SeqSpec] = []
    for i in range(p):
        gid = f"i{iteration}g{i}"
        for j in range(g):
            k = i * g + j
            out.append(SeqSpec(f"{gid}s{j}", gid, iteration, int(prompts[i]), int(responses[k]),
                               int(critiques[k])))
    return out
