"""`padding_chunks`: the sorted micro-batch cut where lengths jump, exact against every partition."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.engines.grpo_loss import LossConfig, compute_grad_sum, padding_chunks
from tests.engines.test_trainer import PAD, random_samples, tiny_model


def _cost(lengths, chunks, chunk_cost):
    return sum((b - a) * lengths[b - 1] + chunk_cost for a, b in chunks)


def _every_partition(n, max_rows):
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        chunks = list(itertools.pairwise(bounds))
        if all(b - a <= max_rows for a, b in chunks):
            yield chunks


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=10).map(sorted),
    max_rows=st.integers(1, 12),
    chunk_cost=st.integers(0, 300),
)
def test_chunks_cover_the_batch_in_order_and_cost_the_best_partitions_cost(lengths, max_rows, chunk_cost):
    chunks = padding_chunks(lengths, max_rows, chunk_cost)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(lengths)
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(chunks))  # contiguous, in order
    assert all(0 < b - a <= max_rows for a, b in chunks)
    best = min(_cost(lengths, p, chunk_cost) for p in _every_partition(len(lengths), max_rows))
    assert _cost(lengths, chunks, chunk_cost) == best


def test_a_long_tailed_batch_is_cut_and_a_uniform_one_kept_whole():
    rng = random.Random(0)
    tailed = sorted(min(60, round(rng.lognormvariate(3.0, 0.5))) for _ in range(128))
    chunks = padding_chunks(tailed, 128, 128)
    padded = sum((b - a) * tailed[b - 1] for a, b in chunks)
    assert len(chunks) > 1 and padded < 0.8 * 128 * tailed[-1]
    assert padding_chunks([20] * 128, 128, 128) == [(0, 128)]
    assert padding_chunks([20] * 128, 32, 128) == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert padding_chunks([], 8, 128) == []


def test_unsorted_lengths_and_empty_chunks_are_refused():
    with pytest.raises(ValueError, match="ascending"):
        padding_chunks([3, 1], 4, 0)
    with pytest.raises(ValueError, match="max_rows"):
        padding_chunks([1, 3], 0, 0)


@pytest.mark.parametrize("chunk_cost", [0, 16, 10**9])
def test_the_gradient_sum_does_not_depend_on_the_cuts(chunk_cost):
    model = tiny_model(dtype=torch.float64)
    ref = tiny_model(seed=1, dtype=torch.float64)
    samples = random_samples(24, seed=3, model=model)
    loss = LossConfig(clip_eps=0.2, kl_coef=0.1)
    whole = compute_grad_sum(model, samples, pad_id=PAD, micro_batch=24, loss=loss, ref_model=ref,
                             chunk_cost_tokens=10**9)
    cut = compute_grad_sum(model, samples, pad_id=PAD, micro_batch=24, loss=loss, ref_model=ref,
                           chunk_cost_tokens=chunk_cost)
    assert cut.tokens == whole.tokens and cut.samples == whole.samples and cut.clipped == whole.clipped
    for name, g in whole.grads.items():
        assert torch.allclose(cut.grads[name], g, rtol=1e-10, atol=1e-13), name
    assert cut.loss_sum == pytest.approx(whole.loss_sum, rel=1e-10)
    assert cut.kl_ref_sum == pytest.approx(whole.kl_ref_sum, rel=1e-10) and whole.kl_ref_sum > 0
