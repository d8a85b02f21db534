"""Abort, offload and resume after the engine's state grew inside `step()` (a longer KV cache, more stop ids).

Why these tests exist: `step()` runs under `torch.inference_mode`, so the cache it regrows and the stop-id
table it widens are inference tensors; `abort`/`offload` used to update them in place outside inference mode
and raised. Every migration of a sequence longer than the initial cache hit it, and the older tests only
used short sequences. These run sequences several times longer than the initial cache, on every kernel path.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pivotrl.engines import kernels
from pivotrl.engines.checkpoints import from_pretrained
from pivotrl.engines.generation import GenerationEngine, GenRequest, GenResult, SamplingParams

NATIVE_BUILDS = kernels.native() is not None

# (pack_weights, native_kernels, dtype): the plain torch path, the packed matmul, the native kernels, bf16.
PATHS = {
    "torch": (False, False, torch.float32),
    "packed": (True, False, torch.float32),
    "native": (True, True, torch.float32),
    "torch-bf16": (False, False, torch.bfloat16),
    "native-bf16": (True, True, torch.bfloat16),
}
FP32_PATHS = ["torch", "packed", "native"]
INITIAL_CACHE = 16  # the smallest the engine allows: every sequence below outgrows it


@pytest.fixture(scope="module")
def model(debug_model_dir):
    return from_pretrained(debug_model_dir)


def _skip_unbuilt(path: str) -> None:
    if PATHS[path][1] and not NATIVE_BUILDS:
        pytest.skip("native kernels do not build here")


def _engine(model, path: str, *, max_batch: int = 4, initial_cache_len: int = INITIAL_CACHE):
    pack, native, dtype = PATHS[path]
    return GenerationEngine(
        model,
        kv_budget_tokens=4096,
        max_batch=max_batch,
        max_seq_len=160,
        initial_cache_len=initial_cache_len,
        pack_weights=pack,
        native_kernels=native,
        dtype=dtype,
    )


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 99) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("stop_ids", [(), (2, 3), (5, 7, 11)], ids=["no-stop", "two-stops", "three-stops"])
def test_abort_and_offload_after_the_cache_grew(model, path, stop_ids):
    """The issue's repro: initial cache 16, three requests, 20 steps, abort one, then offload the rest."""
    _skip_unbuilt(path)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=40, stop_ids=stop_ids)
    engine = _engine(model, path)
    for i, p in enumerate(_prompts(3, seed=0, lo=5, hi=5)):
        engine.add(GenRequest(f"s{i}", p, sampling))
    finished = {r.seq_id for _ in range(20) for r in engine.step()}
    assert engine.cache is not None and engine.cache.max_len > INITIAL_CACHE  # it did grow
    aborted = engine.abort(["s0"])
    assert [p.seq_id for p in aborted] == ([] if "s0" in finished else ["s0"])
    if not stop_ids:
        assert len(aborted[0].generated_ids) == 20 and aborted[0].finish_reason == "abort"
    rest = engine.offload()
    assert {p.seq_id for p in rest} == {"s1", "s2"} - finished
    assert engine.cache is None


@pytest.mark.parametrize("path", list(PATHS))
def test_resumed_long_sequences_end_as_an_uninterrupted_run(model, path):
    """Sequences 3-5x the initial cache, aborted after growth and resumed on an engine that grows again."""
    _skip_unbuilt(path)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=60, stop_ids=(2, 3))
    prompts = _prompts(5, seed=3, lo=10, hi=25)
    reqs = [GenRequest(f"s{i}", p, sampling) for i, p in enumerate(prompts)]
    reference = {r.seq_id: r for r in _engine(model, path, max_batch=8, initial_cache_len=256).generate(reqs)}

    first = _engine(model, path, max_batch=3)
    for r in reqs:
        first.add(r)
    for _ in range(30):
        first.step()
    partials = first.abort(["s0", "s2", "s4"]) + first.offload()
    second = _engine(model, path, max_batch=2)
    got = {r.seq_id: r for r in second.generate([p.as_request(sampling) for p in partials])}
    for ref in reference.values():
        assert got[ref.seq_id].generated_ids == ref.generated_ids, ref.seq_id
        assert got[ref.seq_id].finish_reason == ref.finish_reason


@pytest.mark.parametrize("path", FP32_PATHS)
def test_weights_swap_after_growth_keeps_the_engine_usable(model, path, debug_model_dir):
    _skip_unbuilt(path)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=50, stop_ids=(2, 3))
    engine = _engine(model, path)
    for i, p in enumerate(_prompts(3, seed=5, lo=12, hi=20)):
        engine.add(GenRequest(f"s{i}", p, sampling))
    for _ in range(25):
        engine.step()
    engine.load_state_dict(from_pretrained(debug_model_dir).state_dict())
    engine.step()
    assert len(engine.abort(["s1"])) == 1 or engine.num_running < 3


# -- property: random interleavings --------------------------------------------------------------------------

OPS = st.sampled_from(["add", "step", "step", "step", "abort", "offload"])


def _drive(model, path: str, data, prompts, sampling) -> dict[str, GenResult]:
    """Apply drawn add/step/abort/offload operations; aborted and offloaded partials resume later, on the
    same engine or on a fresh one (offload kills an engine). Returns every sequence's final result."""
    pending = {f"s{i}": GenRequest(f"s{i}", p, sampling) for i, p in enumerate(prompts)}
    done: dict[str, GenResult] = {}
    engine = _engine(model, path, max_batch=data.draw(st.integers(1, 4), label="max_batch"))

    def park(results: list[GenResult]) -> None:
        for r in results:
            pending[r.seq_id] = r.as_request(sampling)

    for _ in range(data.draw(st.integers(4, 30), label="n_ops")):
        op = data.draw(OPS, label="op")
        if op == "add" and pending:
            seq_id = data.draw(st.sampled_from(sorted(pending)), label="add")
            engine.add(pending.pop(seq_id))
        elif op == "step":
            for _ in range(data.draw(st.integers(1, 12), label="steps")):
                done.update({r.seq_id: r for r in engine.step()})
        elif op == "abort":
            live = sorted([r.req.seq_id for r in engine.running] + [w.seq_id for w in engine.waiting])
            if live:
                park(engine.abort(data.draw(st.lists(st.sampled_from(live), unique=True), label="abort")))
        elif op == "offload":
            park(engine.offload())
            engine = _engine(model, path, max_batch=data.draw(st.integers(1, 4), label="max_batch"))
    for req in pending.values():
        engine.add(req)
    while engine.has_work():
        done.update({r.seq_id: r for r in engine.step()})
    return done


@pytest.mark.parametrize("path", FP32_PATHS)
@settings(
    max_examples=12,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_interleavings_resume_identically(model, path, data):
    _skip_unbuilt(path)
    n = data.draw(st.integers(2, 5), label="n_seqs")
    prompts = _prompts(n, seed=data.draw(st.integers(0, 10_000), label="prompt_seed"))
    stops = data.draw(st.sampled_from([(), (2, 3), (4, 9, 17)]), label="stop_ids")
    sampling = SamplingParams(temperature=0.0, max_new_tokens=data.draw(st.integers(20, 70)), stop_ids=stops)
    reqs = [GenRequest(f"s{i}", p, sampling) for i, p in enumerate(prompts)]
    reference = _engine(model, path, max_batch=8, initial_cache_len=256).generate(reqs)

    got = _drive(model, path, data, prompts, sampling)
    assert set(got) == {r.seq_id for r in reference}
    for ref in reference:
        res = got[ref.seq_id]
        assert res.generated_ids == ref.generated_ids, ref.seq_id
        assert res.finish_reason == ref.finish_reason
        assert torch.allclose(torch.tensor(res.logprobs), torch.tensor(ref.logprobs), atol=1e-4)
