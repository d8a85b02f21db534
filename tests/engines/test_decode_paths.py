"""The engine's fast paths compute what the plain path computes: packed prefill, the native decode kernels
(`kernels.py`, where they build), and bf16 inference (greedy tokens, abort/resume identity)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pivotrl.engines import kernels
from pivotrl.engines.checkpoints import from_pretrained, init_state_dict, make_config
from pivotrl.engines.generation import GenerationEngine, GenRequest, SamplingParams
from pivotrl.engines.kv_cache import KVSlots
from pivotrl.engines.model import CausalLM

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40, stop_ids=())
NATIVE = kernels.native()
needs_native = pytest.mark.skipif(NATIVE is None, reason="native kernels do not build here (no compiler?)")


def _prompts(n, seed=0, lo=3, hi=20):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 99) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _reqs(prompts, sampling=GREEDY, prefix="s"):
    return [GenRequest(f"{prefix}{i}", p, sampling) for i, p in enumerate(prompts)]


def _close(got: torch.Tensor, expected: torch.Tensor, tol: float = 1e-4) -> bool:
    """Equal up to fp32 summation order: max |diff| <= tol, relative to the values' scale when it is > 1."""
    return (got - expected).abs().max().item() <= tol * max(1.0, expected.abs().max().item())


def _spread_model(seed: int, dtype=torch.float32, head_dim: int | None = None) -> CausalLM:
    """A debug-size model with spread-out weights (non-trivial logits), fused projections on; `head_dim`
    sets the hidden size to the debug preset's heads times it."""
    config = make_config("debug")
    if head_dim is not None:
        config = type(config)(**{**config.to_dict(), "hidden_size": config.num_attention_heads * head_dim})
    model = CausalLM.from_config(config).eval()
    sd = init_state_dict(config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    model.load_state_dict(
        {k: v * 5 if v.abs().sum() else v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in sd.items()}
    )
    model.to(dtype)
    model.pack_for_inference()
    return model


def test_packed_prefill_then_decode_match_full_forward_torch_ops():
    _prefill_then_decode_match_full_forward(native=False)


def test_packed_prefill_then_decode_match_full_forward_on_every_isa(kernel_isa):
    _prefill_then_decode_match_full_forward(native=True)


def _prefill_then_decode_match_full_forward(native: bool) -> None:
    model = _spread_model(1)
    model.native = NATIVE if native else None
    ids = torch.randint(4, model.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    lens = [13, 5, 9]
    cache = KVSlots(model.config, slots=3, max_len=32, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        full = model(ids)
        first = model.prefill_packed([ids[i, :n].tolist() for i, n in enumerate(lens)], cache, slot0=0)
        for i, n in enumerate(lens):
            assert _close(first[i], full[i, n - 1])
        pos = torch.tensor(lens)
        for _ in range(8):
            logits = model.decode(ids[torch.arange(3), pos], pos, cache)
            assert _close(logits, full[torch.arange(3), pos])
            pos = pos + 1


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_packed_prefill_of_repeated_lengths_equals_each_sequence_alone(native):
    """Sequences of one length attend as one batch (`_equal_lengths`): in any order, mixed with lengths
    that occur once, each sequence's logits and cached keys/values equal those of its prefill alone."""
    if native and NATIVE is None:
        pytest.skip("native kernels do not build here")
    model = _spread_model(3)
    model.native = NATIVE if native else None
    rng = random.Random(5)
    for trial in range(6):
        lengths = [rng.choice([1, 2, 7, 7, 7, 12, 12, rng.randint(1, 20)]) for _ in range(rng.randint(1, 14))]
        seqs = [[1] + [rng.randrange(4, 99) for _ in range(n - 1)] for n in lengths]
        width = max(lengths) + 1
        packed = KVSlots(model.config, slots=len(seqs), max_len=width, device="cpu", dtype=torch.float32)
        alone = KVSlots(model.config, slots=len(seqs), max_len=width, device="cpu", dtype=torch.float32)
        with torch.no_grad():
            logits = model.prefill_packed(seqs, packed, slot0=0)
            for i, s in enumerate(seqs):
                assert _close(logits[i], model.prefill_packed([s], alone, slot0=i)[0]), (trial, lengths, i)
        for i, n in enumerate(lengths):
            got, want = packed.kv[:, :, i, :, :n], alone.kv[:, :, i, :, :n]
            assert _close(got, want), (trial, lengths, i)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_decode_equals_torch_decode_and_stores_the_same_cache(dtype, kernel_isa):
    ids = torch.randint(4, 100, (4, 30), generator=torch.Generator().manual_seed(2))
    lens = [20, 7, 11, 1]
    runs = {}
    for name, run_dtype, native in (
        ("exact", torch.float32, None),
        ("torch", dtype, None),
        ("native", dtype, NATIVE),
    ):
        model = _spread_model(2, run_dtype)
        model.native = native
        cache = KVSlots(model.config, slots=4, max_len=64, device="cpu", dtype=run_dtype)
        with torch.no_grad():
            model.prefill_packed([ids[i, :n].tolist() for i, n in enumerate(lens)], cache, slot0=0)
            pos, logits = torch.tensor(lens), []
            for _ in range(6):
                logits.append(model.decode(ids[torch.arange(4), pos], pos, cache).float())
                pos = pos + 1
        runs[name] = (torch.stack(logits), cache)
    (exact, _), (plain, plain_cache), (native, native_cache) = runs["exact"], runs["torch"], runs["native"]
    if dtype == torch.float32:
        assert _close(native, plain)
        assert _close(native_cache.kv, plain_cache.kv)
    else:  # both round to bf16 between ops, at different points: as close to fp32 as the torch path is
        err_native, err_plain = (native - exact).abs().mean().item(), (plain - exact).abs().mean().item()
        assert err_native <= 1.5 * err_plain + 1e-3
        assert (native.argmax(-1) == exact.argmax(-1)).float().mean().item() >= 0.9


@needs_native
@pytest.mark.parametrize("head_dim", [16, 48, 80, 144, 256])
def test_native_decode_equals_torch_decode_at_every_head_size(head_dim, kernel_isa):
    """Decode attention's vector paths cover every head size that is a multiple of 16 on every instruction
    set: 16 (the quickstart's models, where AVX-512 once fell back to scalar RoPE and weighted sum, 3x slower
    than AVX2), one partial column group (48, 80), a group of 128 and a remainder (144), two groups (256)."""
    ids = torch.randint(4, 100, (3, 24), generator=torch.Generator().manual_seed(5))
    lens = [17, 4, 9]
    runs = {}
    for native in (None, NATIVE):
        model = _spread_model(5, head_dim=head_dim)
        model.native = native
        cache = KVSlots(model.config, slots=3, max_len=48, device="cpu", dtype=torch.float32)
        with torch.no_grad():
            model.prefill_packed([ids[i, :n].tolist() for i, n in enumerate(lens)], cache, slot0=0)
            pos, logits = torch.tensor(lens), []
            for _ in range(5):
                logits.append(model.decode(ids[torch.arange(3), pos], pos, cache))
                pos = pos + 1
        runs[native is not None] = (torch.stack(logits), cache.kv)
    (plain, plain_kv), (ours, our_kv) = runs[False], runs[True]
    # 1e-3 of the scale: at hidden sizes up to 1,024 the spread weights' activations carry fp32 summation
    # order to ~2e-4 on every path (the scalar one included); a wrong lane or column is off by O(1)
    assert _close(ours, plain, tol=1e-3) and _close(our_kv, plain_kv, tol=1e-3)


@needs_native
@pytest.mark.parametrize("dim", [64, 40], ids=["dim64", "dim40"])  # 40: AVX2 vectors, scalar on AVX-512
def test_native_norm_and_swiglu_follow_the_reference_formulas(kernel_isa, dim):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, dim, generator=gen) * 3
    delta = torch.randn(5, dim, generator=gen)
    w = torch.rand(dim, generator=gen) + 0.5
    gate_up = torch.randn(5, 2 * dim + 6, generator=gen) * 4  # an inner size with a tail on every path
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        xs, ds, ws, gs = (t.to(dtype) for t in (x, delta, w, gate_up))
        summed = xs + ds
        h = summed.float()
        ref = ws * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        inplace = xs.clone()
        got = NATIVE.add_rms_norm(inplace, ds, ws, 1e-6)
        assert torch.equal(inplace, summed)  # the residual add happened in place, in x's dtype
        assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol)
        assert torch.allclose(
            NATIVE.add_rms_norm(xs.clone(), None, ws, 1e-6).float(),
            (
                ws * (xs.float() * torch.rsqrt(xs.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
            ).float(),
            rtol=tol,
            atol=tol,
        )
        gate, up = gs.chunk(2, dim=-1)
        assert torch.allclose(NATIVE.silu_mul(gs).float(), (F.silu(gate) * up).float(), rtol=tol, atol=tol)


@needs_native
def test_engine_with_and_without_native_kernels_generates_the_same(debug_model_dir, kernel_isa):
    prompts = _prompts(6, seed=3)
    runs = []
    for native in (True, False):
        engine = GenerationEngine(
            from_pretrained(debug_model_dir),
            kv_budget_tokens=4096,
            max_batch=4,
            native_kernels=native,
        )
        assert engine.native_kernels is native
        # kernels on: the matmuls are the native ones where this CPU has them; off: oneDNN's
        head = engine.model.lm_head.__dict__["_packed"][0]
        assert (head.native is not None) is (native and bool(NATIVE.has_linear_fp32()))
        runs.append(engine.generate(_reqs(prompts)))
    for a, b in zip(*runs):
        assert a.generated_ids == b.generated_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_bf16_greedy_matches_fp32_on_most_positions(debug_model_dir):
    prompts = _prompts(8, seed=4)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        engine = GenerationEngine(
            from_pretrained(debug_model_dir), kv_budget_tokens=4096, max_batch=8, dtype=dtype
        )
        assert engine.dtype == dtype
        out[dtype] = engine.generate(_reqs(prompts))
    pairs = [
        (a, b)
        for fa, fb in zip(out[torch.float32], out[torch.bfloat16])
        for a, b in zip(fa.generated_ids, fb.generated_ids)
    ]
    assert len(pairs) == 8 * 40
    assert sum(a == b for a, b in pairs) / len(pairs) >= 0.9
    for r in out[torch.bfloat16]:  # sampling and log-probs stay fp32, computed from the bf16 logits
        assert all(lp <= 0.0 for lp in r.logprobs) and isinstance(r.logprobs[0], float)


def test_bf16_abort_then_resume_on_another_engine_is_identical_torch_ops(debug_model_dir):
    _bf16_abort_then_resume_is_identical(debug_model_dir, native=False)


def test_bf16_abort_then_resume_on_another_engine_is_identical_on_every_isa(debug_model_dir, kernel_isa, amx):
    _bf16_abort_then_resume_is_identical(debug_model_dir, native=True)


def _bf16_abort_then_resume_is_identical(debug_model_dir, native: bool) -> None:

    def engine(max_batch):
        return GenerationEngine(
            from_pretrained(debug_model_dir),
            kv_budget_tokens=4096,
            max_batch=max_batch,
            dtype=torch.bfloat16,
            native_kernels=native,
        )

    prompts = _prompts(6, seed=1)
    reference = engine(8).generate(_reqs(prompts))
    first = engine(4)  # 4 run, 2 wait: abort mid-batch while others keep going
    for r in _reqs(prompts):
        first.add(r)
    for _ in range(7):
        first.step()
    partials = first.abort(["s1", "s3", "s5"])
    assert {len(p.generated_ids) for p in partials} == {7, 0}
    finished = {}
    while first.has_work():
        finished.update({r.seq_id: r for r in first.step()})
    second = engine(3)  # others already running there
    for r in _reqs(_prompts(2, seed=9), prefix="other"):
        second.add(r)
    second.step()
    finished.update({r.seq_id: r for r in second.generate([p.as_request(GREEDY) for p in partials])})
    for ref in reference:
        got = finished[ref.seq_id]
        assert got.generated_ids == ref.generated_ids, ref.seq_id
        # bf16 logits: the resumed prefix is recomputed by prefill, so its log-probs match to bf16 precision
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=5e-2)


def test_native_kernels_switched_off_fall_back_to_torch_ops(monkeypatch, debug_model_dir):
    monkeypatch.setenv("PIVOTRL_NATIVE_KERNELS", "0")
    assert kernels.native() is None
    engine = GenerationEngine(from_pretrained(debug_model_dir), kv_budget_tokens=1024, max_batch=2)
    assert engine.native_kernels is False and engine.model.native is None
    out = engine.generate(_reqs(_prompts(2, seed=5)))
    assert [len(r.generated_ids) for r in out] == [40, 40]


def test_decode_on_every_isa_equals_transformers(kernel_isa):
    """Prefill then decode steps through the native kernels of each path give transformers' logits
    (<= 1e-4, fp32) at every position."""
    from transformers import Qwen2ForCausalLM

    model = _spread_model(3)
    model.native = NATIVE
    hf = Qwen2ForCausalLM(model.config).eval()
    hf.load_state_dict(model.state_dict())
    ids = torch.randint(4, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(3))
    lens = [17, 3, 30]
    cache = KVSlots(model.config, slots=3, max_len=48, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        assert expected.abs().max() > 1.0
        first = model.prefill_packed([ids[i, :n].tolist() for i, n in enumerate(lens)], cache, slot0=0)
        for i, n in enumerate(lens):
            assert _close(first[i], expected[i, n - 1])
        pos = torch.tensor(lens)
        for _ in range(9):
            got = model.decode(ids[torch.arange(3), pos], pos, cache)
            assert _close(got, expected[torch.arange(3), pos])
            pos = pos + 1


def test_forcing_an_isa_the_cpu_lacks_is_an_error(monkeypatch):
    monkeypatch.setenv("PIVOTRL_KERNEL_ISA", "avx3000")
    with pytest.raises(ValueError, match="PIVOTRL_KERNEL_ISA"):
        kernels.requested_isa()
    if NATIVE is not None:
        missing = [i for i in kernels.ISAS if i not in NATIVE.supported_isas()]
        for name in missing:
            with pytest.raises(RuntimeError, match="this CPU runs only"):
                NATIVE.set_isa(name)
        assert NATIVE.supported_isas()[-1] == "scalar"
