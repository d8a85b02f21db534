"""Continuous-batching engine: abort/resume identity across engines, KV budget, sampling, log-probs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pivotrl.engines.checkpoints import from_pretrained
from pivotrl.engines.generation import (
    GenerationEngine,
    GenRequest,
    SamplingParams,
    keyed_uniform,
    sample_tokens,
)

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40, stop_ids=())


@pytest.fixture(scope="module")
def model(debug_model_dir):
    return from_pretrained(debug_model_dir)


def _engine(model, **kw):
    kw.setdefault("kv_budget_tokens", 4096)
    kw.setdefault("max_batch", 8)
    return GenerationEngine(model, **kw)


def _prompts(n, seed=0, lo=3, hi=20):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 99) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _reqs(prompts, sampling=GREEDY, prefix="s"):
    return [GenRequest(f"{prefix}{i}", p, sampling) for i, p in enumerate(prompts)]


@pytest.mark.parametrize(
    "sampling",
    [GREEDY, SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=40, stop_ids=(), seed=11)],
    ids=["greedy", "sampled"],
)
def test_abort_then_resume_on_another_engine_is_identical(model, sampling, kernel_isa):
    prompts = _prompts(6, seed=1)
    reference = _engine(model).generate(_reqs(prompts, sampling))

    first = _engine(model, max_batch=4)  # 4 run, 2 wait: abort mid-batch while others keep going
    for r in _reqs(prompts, sampling):
        first.add(r)
    for _ in range(7):
        first.step()
    partials = first.abort(["s1", "s3", "s5"])  # s1, s3 running; s5 still waiting
    assert {p.seq_id for p in partials} == {"s1", "s3", "s5"}
    assert all(p.finish_reason == "abort" for p in partials)
    by_id = {p.seq_id: p for p in partials}
    assert len(by_id["s1"].generated_ids) == 7 and by_id["s5"].generated_ids == []
    finished_first = {}
    while first.has_work():
        finished_first.update({r.seq_id: r for r in first.step()})

    second = _engine(model, max_batch=3)  # other sequences already running on the second engine
    for r in _reqs(_prompts(2, seed=9), sampling, prefix="other"):
        second.add(r)
    second.step()
    second.step()
    resumed = second.generate([p.as_request(sampling) for p in partials])
    got = {**finished_first, **{r.seq_id: r for r in resumed}}
    for ref in reference:
        res = got[ref.seq_id]
        assert res.generated_ids == ref.generated_ids, ref.seq_id
        assert res.finish_reason == ref.finish_reason == "length"
        assert torch.allclose(torch.tensor(res.logprobs), torch.tensor(ref.logprobs), atol=1e-4)


def test_partials_are_what_abort_would_return_and_stop_nothing(model):
    engine = _engine(model, max_batch=2)  # 2 run, 1 waits: partials covers the running ones only
    for r in _reqs(_prompts(3, seed=4)):
        engine.add(r)
    for _ in range(5):
        engine.step()
    partials = engine.partials()
    assert set(partials) == {"s0", "s1"} and engine.num_running == 2
    aborted = {r.seq_id: r for r in engine.abort(["s0", "s1"])}
    for seq_id, (ids, logprobs) in partials.items():
        assert len(ids) == 5 and ids == aborted[seq_id].generated_ids
        assert logprobs == aborted[seq_id].logprobs


def test_logprobs_match_teacher_forced_forward(model):
    sampling = SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=25, stop_ids=(), seed=3)
    results = _engine(model).generate(_reqs(_prompts(4, seed=2), sampling))
    with torch.no_grad():
        for res in results:
            ids = torch.tensor([res.prompt_ids + res.generated_ids])
            logp = torch.log_softmax(model(ids)[0].float(), dim=-1)
            n = len(res.prompt_ids)
            expected = logp[n - 1 : -1].gather(1, torch.tensor(res.generated_ids)[:, None]).squeeze(1)
            assert torch.allclose(torch.tensor(res.logprobs), expected, atol=1e-4)


def test_kv_budget_is_respected_and_admission_waits(model):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=30, stop_ids=())
    prompts = _prompts(10, seed=3)
    need = [len(p) + 30 for p in prompts]
    budget = sum(sorted(need)[-3:])  # room for ~3 at a time, never all 10
    engine = _engine(model, kv_budget_tokens=budget, max_batch=10)
    for r in _reqs(prompts, sampling):
        engine.add(r)
    finished, saw_waiting = [], False
    while engine.has_work():
        finished += engine.step()
        assert engine.reserved_tokens <= budget
        assert int(engine.lens[: engine.num_running].sum()) <= budget
        saw_waiting |= engine.num_waiting > 0 and engine.num_running > 0
    assert saw_waiting and len(finished) == 10
    stats = engine.stats()
    assert stats["peak_reserved_tokens"] <= budget and stats["peak_cached_tokens"] <= budget
    assert stats["reserved_tokens"] == 0
    with pytest.raises(ValueError, match="max_seq_len"):  # max_seq_len <= budget: it could never fit
        engine.add(GenRequest("huge", [1] * budget, SamplingParams(max_new_tokens=1)))


def test_finished_sequence_leaves_and_waiting_takes_its_slot(model):
    engine = _engine(model, max_batch=2)
    engine.add(GenRequest("short", [1, 5, 6], SamplingParams(temperature=0, max_new_tokens=3, stop_ids=())))
    engine.add(GenRequest("long", [1, 7, 8], SamplingParams(temperature=0, max_new_tokens=10, stop_ids=())))
    engine.add(GenRequest("late", [1, 9], SamplingParams(temperature=0, max_new_tokens=2, stop_ids=())))
    assert engine.step() == [] and (engine.num_running, engine.num_waiting) == (2, 1)
    engine.step()
    done = engine.step()
    assert [r.seq_id for r in done] == ["short"] and engine.num_running == 1
    engine.step()  # "late" is admitted into the freed slot at the very next step
    assert (engine.num_running, engine.num_waiting) == (2, 0)
    assert [r.seq_id for r in engine.step()] == ["late"]


def test_stop_ids_and_max_new_tokens(model):
    prompt = _prompts(1, seed=4)[0]
    free = _engine(model).generate([GenRequest("a", prompt, GREEDY)])[0]
    assert len(free.generated_ids) == 40 and free.finish_reason == "length"
    stop_tok = free.generated_ids[5]
    first = free.generated_ids.index(stop_tok)
    stopped = _engine(model).generate(
        [GenRequest("a", prompt, SamplingParams(temperature=0, max_new_tokens=40, stop_ids=(999, stop_tok)))]
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.generated_ids == free.generated_ids[: first + 1]
    short = _engine(model).generate(
        [GenRequest("a", prompt, SamplingParams(temperature=0, max_new_tokens=4))]
    )[0]
    assert len(short.generated_ids) <= 4


def test_seeded_sampling_is_reproducible_across_batch_composition(model):
    sampling = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=30, stop_ids=(), seed=5)
    prompt = _prompts(1, seed=5)[0]
    alone = _engine(model).generate([GenRequest("x", prompt, sampling)])[0]
    crowd = _reqs(
        _prompts(5, seed=6), SamplingParams(temperature=1.0, max_new_tokens=12, stop_ids=(), seed=1)
    )
    together = _engine(model, max_batch=3).generate([*crowd, GenRequest("x", prompt, sampling)])[-1]
    assert together.generated_ids == alone.generated_ids
    other = _engine(model).generate(
        [GenRequest("x", prompt, SamplingParams(**{**sampling.__dict__, "seed": 6}))]
    )
    assert other[0].generated_ids != alone.generated_ids


def test_a_groups_shared_prompt_is_prefilled_once_and_each_sample_is_its_own(model, kernel_isa):
    """Requests that repeat a prompt (a GRPO group) prefill it once and copy its cache; each sample then
    generates exactly what it generates alone, with its own seed, and a resumed request (its prompt plus
    generated tokens) is only shared with an equal one."""
    rng = random.Random(3)
    prompts = _prompts(4, seed=8)
    reqs = []
    for i in range(14):  # groups of 1-5 repeats, interleaved, different seeds
        p = prompts[rng.randrange(4)]
        reqs.append(GenRequest(f"g{i}", p, SamplingParams(temperature=1.0, max_new_tokens=16, stop_ids=(),
                                                          seed=rng.randrange(4))))
    resumed = reqs[0]
    reqs.append(GenRequest("r", resumed.prompt_ids, resumed.sampling, generated_ids=[5, 6],
                           logprobs=[-1.0, -1.0]))
    engine = _engine(model, max_batch=16)
    together = {r.seq_id: r for r in engine.generate(reqs)}
    assert engine.prefill_tokens == sum(len(r.prompt_ids) + len(r.generated_ids) for r in reqs)
    for r in reqs:
        alone = _engine(model).generate([r])[0]
        assert together[r.seq_id].generated_ids == alone.generated_ids, r.seq_id
        assert together[r.seq_id].logprobs == pytest.approx(alone.logprobs, abs=1e-5), r.seq_id
    assert len({tuple(together[r.seq_id].generated_ids) for r in reqs}) > 4  # samples differ: not vacuous


def test_cache_growth_does_not_change_results(model):
    sampling = SamplingParams(temperature=0, max_new_tokens=60, stop_ids=())
    prompts = _prompts(3, seed=7, lo=20, hi=40)
    roomy = _engine(model, initial_cache_len=512).generate(_reqs(prompts, sampling))
    grown = _engine(model, initial_cache_len=16)
    out = grown.generate(_reqs(prompts, sampling))
    assert grown.cache.max_len >= 100
    assert [r.generated_ids for r in out] == [r.generated_ids for r in roomy]


def test_sampler_follows_softmax_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    n = logits.shape[0]
    seed, index = torch.full((n,), 42, dtype=torch.long), torch.arange(n)
    u = keyed_uniform(seed, index)
    tokens = sample_tokens(logits, torch.ones(n), torch.ones(n), seed, index)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.015)
    top = sample_tokens(logits, torch.ones(n), torch.full((n,), 0.7), seed, index)
    p = torch.softmax(logits[0], -1)
    assert set(top.tolist()) == {0, 1}  # 0.64 < 0.7 so the nucleus is {0, 1}
    assert abs((top == 0).float().mean().item() - p[0] / (p[0] + p[1])) < 0.015
    cold = sample_tokens(logits[:5], torch.zeros(5), torch.ones(5), seed[:5], index[:5])
    assert cold.tolist() == [0] * 5
    assert float(u.min()) > 0 and float(u.max()) < 1 and math.isclose(float(u.mean()), 0.5, abs_tol=0.01)


def test_stats_and_offload(model):
    engine = _engine(model)
    engine.generate(_reqs(_prompts(3, seed=8), SamplingParams(temperature=0, max_new_tokens=10, stop_ids=())))
    s = engine.stats()
    assert s["tokens_generated"] == 30 and s["tokens_per_s"] > 0
    assert s["running"] == s["waiting"] == 0
    assert s["samples"] and all(n >= 1 and t > 0 for n, t in s["samples"])
    engine.add(GenRequest("p", [1, 5], SamplingParams(max_new_tokens=20)))
    engine.step()
    partials = engine.offload()
    assert [p.seq_id for p in partials] == ["p"] and len(partials[0].generated_ids) == 1
    with pytest.raises(RuntimeError):
        engine.step()


def test_load_state_dict_swaps_weights(model, debug_model_dir):
    from pivotrl.engines.checkpoints import load_state_dict

    engine = _engine(from_pretrained(debug_model_dir))
    req = [GenRequest("a", [1, 4, 5, 6], SamplingParams(temperature=0, max_new_tokens=15, stop_ids=()))]
    before = engine.generate(req)[0].generated_ids
    sd = {k: v * 3 for k, v in load_state_dict(debug_model_dir).items()}
    engine.load_state_dict(sd)
    after = engine.generate([GenRequest("b", [1, 4, 5, 6], req[0].sampling)])[0].generated_ids
    assert after != before
