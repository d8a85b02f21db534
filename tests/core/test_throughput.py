from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.core.throughput import StepTotals, ThroughputModel, fit_totals

from ._hyp import CI


def test_prior_before_data_is_the_prior_line() -> None:
    m = ThroughputModel(0.02, 0.001)
    assert m.samples == 0
    assert m.a == pytest.approx(0.02)
    assert m.b == pytest.approx(0.001)
    assert m.rate(0) == 0.0
    assert m.rate(10) == pytest.approx(10 / (0.02 + 0.01))


def test_fit_recovers_a_noiseless_line() -> None:
    m = ThroughputModel(0.5, 0.5, prior_weight=0.01)
    for n in [1, 2, 4, 8, 16, 32, 64] * 5:
        m.observe(n, 0.01 + 0.002 * n)
    assert m.a == pytest.approx(0.01, rel=0.02)
    assert m.b == pytest.approx(0.002, rel=0.02)


def test_recency_weighting_follows_a_change() -> None:
    m = ThroughputModel(0.01, 0.001, decay=0.8, prior_weight=0.1)
    for n in [1, 8, 16, 32] * 10:
        m.observe(n, 0.01 + 0.001 * n)
    for n in [1, 8, 16, 32] * 10:
        m.observe(n, 0.05 + 0.004 * n)  # the engine got slower (e.g. longer contexts)
    assert m.b == pytest.approx(0.004, rel=0.05)
    assert m.a == pytest.approx(0.05, rel=0.1)


def test_samples_at_one_concurrency_stay_sane() -> None:
    m = ThroughputModel(0.02, 0.001)
    for _ in range(200):
        m.observe(16, 0.1)
    assert m.a > 0 and m.b > 0
    assert m.step_time(16) == pytest.approx(0.1, rel=0.05)  # matches the data where there is data


def test_train_tokens_per_seq_learned() -> None:
    m = ThroughputModel(0.05, 1e-5, tokens_per_seq_step=1.0)
    for _ in range(20):
        m.observe(4, 0.05 + 1e-5 * 2000, tokens=2000)
    assert m.tokens_per_seq_step == pytest.approx(500)
    assert m.rate(4) == pytest.approx(2000 / m.step_time(4))


def test_invalid_samples_ignored() -> None:
    m = ThroughputModel(0.02, 0.001)
    m.observe(0, 0.1)
    m.observe(4, 0.0)
    m.observe(4, float("nan"))
    assert m.samples == 0


def test_spawn_starts_from_role_fit_then_learns_alone() -> None:
    role = ThroughputModel(0.5, 0.5, prior_weight=0.01)
    for n in [1, 4, 16, 64] * 5:
        role.observe(n, 0.01 + 0.002 * n)
    child = role.spawn()
    assert child.a == pytest.approx(role.a) and child.b == pytest.approx(role.b)
    child.observe(8, 5.0)
    assert role.step_time(8) < 1.0  # the parent is unaffected


@settings(CI, max_examples=300)
@given(a=st.floats(1e-4, 1.0), b=st.floats(1e-7, 1e-1), n=st.integers(0, 5000),
       obs=st.lists(st.tuples(st.integers(1, 512), st.floats(1e-4, 10.0)), max_size=20))
def test_rate_concave_increasing(a: float, b: float, n: int, obs: list[tuple[int, float]]) -> None:
    m = ThroughputModel(a, b)
    for c, t in obs:
        m.observe(c, t)
    assert m.a > 0 and m.b > 0
    g0, g1 = m.marginal_gain(n), m.marginal_gain(n + 1)
    assert g0 > 0
    assert g1 <= g0 * (1 + 1e-9)
    assert m.rate(n) <= m.peak_rate * (1 + 1e-9)


@given(
    obs=st.lists(st.tuples(st.integers(1, 64), st.floats(1e-3, 1.0)), min_size=0, max_size=20),
    more=st.lists(st.tuples(st.integers(1, 64), st.floats(1e-3, 1.0)), min_size=0, max_size=5),
)
def test_restored_statistics_refit_to_the_same_line_and_learn_on_alike(obs, more) -> None:
    """A model restored from another's statistics predicts exactly what the original does, before and
    after both see the same further samples (what a resumed run relies on)."""
    original, restored = ThroughputModel(0.01, 1e-4), ThroughputModel(0.01, 1e-4)
    for n, t in obs:
        original.observe(n, t)
    restored.restore_statistics(*original.statistics())
    for n, t in more:
        original.observe(n, t)
        restored.observe(n, t)
    assert (restored.a, restored.b, restored.samples) == (original.a, original.b, original.samples)
    assert restored.tokens_per_seq_step == original.tokens_per_seq_step


def test_restored_statistics_of_the_wrong_shape_are_refused() -> None:
    with pytest.raises(ValueError, match="5 sums and 2 kx"):
        ThroughputModel(0.01, 1e-4).restore_statistics([0.0] * 4, [0.0, 0.0], 0)


@settings(CI, max_examples=200)
@given(a=st.floats(1e-4, 0.01), b=st.floats(1e-6, 1e-3), per_token=st.floats(1e-7, 1e-3),
       steps=st.lists(st.tuples(st.integers(1, 64), st.integers(0, 4096)), min_size=1, max_size=60))
def test_prefill_is_priced_apart_and_leaves_the_decode_line_alone(a, b, per_token, steps) -> None:
    """Steps that prefill cost the line plus `per_token` per prompt token. The line learns only from the
    pure decode steps (as if the prefill steps never happened), and the prefill rate is exactly 1/per_token
    once the line is right."""
    mixed, decode_only = ThroughputModel(a, b), ThroughputModel(a, b)
    for n, prompt in steps:
        t = a + b * n + per_token * prompt
        if prompt:
            mixed.observe_prefill(n, t, prompt)
        else:
            mixed.observe(n, t)
            decode_only.observe(n, t)
    assert (mixed.a, mixed.b, mixed.samples) == (decode_only.a, decode_only.b, decode_only.samples)
    if any(p for _, p in steps):
        assert mixed.prefill_tokens_per_s == pytest.approx(1.0 / per_token, rel=1e-6)
    else:
        assert mixed.prefill_tokens_per_s is None


def test_a_prefill_faster_than_the_line_counts_as_free_not_negative() -> None:
    m = ThroughputModel(0.01, 0.001)
    m.observe_prefill(8, 0.005, 512)  # quicker than the line says 8 rows take: nothing beyond it
    assert m.prefill_tokens_per_s is None
    m.observe_prefill(8, 0.018 + 0.0512, 512)
    # the free prefill's tokens stay in the (decayed) count: their time was nothing
    assert m.prefill_tokens_per_s == pytest.approx((512 * 0.95 + 512) / 0.0512, rel=1e-6)


def test_a_step_whose_context_says_it_cost_more_than_it_took_is_no_sample() -> None:
    """A context report that leaves nothing of the step once moved to the reference context is dropped,
    for the line and for the prefill rate; one without a context report is fitted as measured."""
    m = ThroughputModel(0.01, 0.001, context_s=1e-6, context_ref=100.0)
    m.observe(4, 0.01, context=1e6)
    m.observe_prefill(4, 0.5, 1000.0, context=1e6)
    assert m.samples == 0 and m.prefill_tokens_per_s is None
    m.observe(4, 0.02)
    assert m.samples == 1


@given(c=st.floats(0.0, 1e-5), ref=st.floats(0.0, 1e4), ctx=st.floats(0.0, 1e5), k=st.floats(1.0, 10.0))
@settings(max_examples=100, deadline=None)
def test_the_line_moves_to_a_context_by_its_cost(c: float, ref: float, ctx: float, k: float) -> None:
    m = ThroughputModel(0.01, 0.001, tokens_per_seq_step=k, context_s=c, context_ref=ref)
    assert m.b_at(ref) == pytest.approx(m.b)
    assert m.b_at(ctx) == pytest.approx(max(m.b + c * (ctx - ref) / k, 1e-9))
    assert ThroughputModel(0.01, 0.001).b_at(ctx) == m.b  # a role that prices no context keeps its line


@settings(CI, max_examples=300)
@given(a=st.floats(1e-4, 0.01), b=st.floats(1e-6, 1e-3), per_token=st.floats(1e-6, 1e-3),
       steps=st.lists(st.tuples(st.integers(1, 256), st.one_of(st.just(0), st.integers(64, 4096))),
                      min_size=1, max_size=80),
       cut=st.integers(0, 80))
def test_step_totals_fit_the_line_through_every_step_and_any_window(a, b, per_token, steps, cut) -> None:
    """Steps on a noiseless line (prefilling ones plus `per_token` per prompt token). The totals of all of
    them, and the difference of two snapshots (a window), fit that line and that prefill rate exactly,
    wherever the window's decode steps show two batch sizes; otherwise there is no slope to fit."""
    totals = StepTotals()
    before = None
    for i, (n, prompt) in enumerate(steps):
        if i == cut:
            before = StepTotals(list(totals.decode), list(totals.prefill))
        totals.add(float(n), a + b * n + per_token * prompt, prompt)
    before = before or StepTotals(list(totals.decode), list(totals.prefill))  # a cut past the end: empty
    window = ([y - x for x, y in zip(before.decode, totals.decode, strict=True)],
              [y - x for x, y in zip(before.prefill, totals.prefill, strict=True)])
    for (dec, pre), part in (((totals.decode, totals.prefill), steps), (window, steps[cut:])):
        fit = fit_totals(dec, pre)
        if len({n for n, p in part if not p}) < 2:
            assert fit is None
            continue
        assert fit is not None
        assert fit[0] == pytest.approx(a, rel=1e-4, abs=1e-9)
        assert fit[1] == pytest.approx(b, rel=1e-4, abs=1e-12)
        if any(p for _, p in part):
            assert fit[2] == pytest.approx(1.0 / per_token, rel=1e-3)
        else:
            assert fit[2] is None


def test_step_totals_leave_out_empty_and_timeless_steps() -> None:
    t = StepTotals()
    t.add(0.0, 0.01)
    t.add(4.0, 0.0)
    t.add(4.0, float("nan"))
    assert t.as_dict() == {"decode": [0.0] * 5, "prefill": [0.0] * 4}
