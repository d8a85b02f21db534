"""The native matmul (`csrc/kernels_impl.h`, used through `cpu_pack.PackedWeight`) computes x @ W^T + b for
every shape the engine gives it (row and column tails, N-D inputs), and a model running on it never decodes
with stale weights (the per-step plan of `cpu_pack.plan` follows in-place updates and `load_state_dict`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pivotrl.engines import kernels
from pivotrl.engines.checkpoints import from_pretrained, init_state_dict, make_config
from pivotrl.engines.cpu_pack import AMX_MIN_MACS, PackedWeight
from pivotrl.engines.generation import GenerationEngine, GenRequest, SamplingParams
from pivotrl.engines.kv_cache import KVSlots
from pivotrl.engines.model import CausalLM

NATIVE = kernels.native()
needs_native = pytest.mark.skipif(NATIVE is None, reason="native kernels do not build here (no compiler?)")
DTYPES = [torch.float32, torch.bfloat16]


def _supported(dtype: torch.dtype) -> bool:
    return NATIVE is not None and bool(
        NATIVE.has_linear_fp32() if dtype == torch.float32 else NATIVE.has_linear_bf16()
    )


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("m", [1, 8, 9, 33])
@pytest.mark.parametrize("n", [1, 16, 17, 49, 99])
def test_native_linear_equals_reference_on_every_tail(dtype, m, n, kernel_isa):
    # Every path computes any packed weight (where it has no fast matmul of its own, the scalar one does).
    gen = torch.Generator().manual_seed(m * 1000 + n)
    for k in (2, 64, 384):
        x = torch.randn(m, k, generator=gen).to(dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
        b = torch.randn(n, generator=gen).to(dtype)
        packed = NATIVE.pack_linear(w)
        ref = F.linear(x.double(), w.double())
        tol = 1e-5 if dtype == torch.float32 else 2**-7  # one bf16 rounding of the output
        scale = ref.abs().max().item() + 1.0
        got = NATIVE.linear(x, packed, None, n)
        assert got.dtype == dtype and got.shape == (m, n)
        assert (got.double() - ref).abs().max().item() <= tol * scale
        got = NATIVE.linear(x, packed, b, n)
        assert (got.double() - (ref + b.double())).abs().max().item() <= tol * (scale + b.abs().max().item())


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_packed_weight_takes_nd_and_strided_inputs(dtype):
    if not _supported(dtype):
        pytest.skip(f"no native {dtype} matmul on this CPU")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=gen).to(dtype)
    packed = PackedWeight(w, NATIVE)
    assert packed.native is NATIVE  # the native path, not oneDNN
    x = torch.randn(2, 3, 128, generator=gen).to(dtype)[..., ::2]  # [2, 3, 64], not contiguous
    got = packed(x, None)
    assert got.shape == (2, 3, 40)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    ref = F.linear(x.double(), w.double())
    assert (got.double() - ref).abs().max().item() <= tol * (ref.abs().max().item() + 1)


def _model(seed: int, dtype: torch.dtype, native) -> CausalLM:
    config = make_config("debug")
    model = CausalLM.from_config(config).eval()
    model.load_state_dict(init_state_dict(config, seed))
    model.to(dtype)
    model.native = native
    model.pack_for_inference()
    return model


def _decode_logits(model: CausalLM, ids: torch.Tensor, lens: list[int]) -> torch.Tensor:
    cache = KVSlots(model.config, slots=len(lens), max_len=64, device="cpu", dtype=model.lm_head.weight.dtype)
    with torch.no_grad():
        model.prefill_packed([ids[i, :n].tolist() for i, n in enumerate(lens)], cache, slot0=0)
        pos = torch.tensor(lens)
        return model.decode(ids[torch.arange(len(lens)), pos], pos, cache).float()


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_native_decode_follows_weight_updates(dtype, kernel_isa):
    """In-place updates (an optimizer step, `load_state_dict`) and a fresh model with the same weights decode
    alike: the plan is rebuilt when a parameter's version or storage moves."""
    ids = torch.randint(4, 100, (3, 24), generator=torch.Generator().manual_seed(5))
    lens = [9, 4, 13]
    model = _model(1, dtype, NATIVE)
    before = _decode_logits(model, ids, lens)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mlp.down_proj" in name or "self_attn.q_proj" in name:
                p.mul_(-2.0)  # in place: the version moves, the storage does not
    after = _decode_logits(model, ids, lens)
    fresh = _model(1, dtype, NATIVE)
    fresh.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    assert not torch.allclose(after, before)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(after, _decode_logits(fresh, ids, lens), atol=tol)
    model.load_state_dict(_model(2, dtype, None).state_dict())  # new weights copied in
    assert torch.allclose(
        _decode_logits(model, ids, lens), _decode_logits(_model(2, dtype, NATIVE), ids, lens), atol=tol
    )


@needs_native
def test_offload_drops_every_packed_copy(debug_model_dir):
    """An offloaded engine gives the packed weights back: nothing on the model still refers to them."""
    model = from_pretrained(debug_model_dir)
    engine = GenerationEngine(model, kv_budget_tokens=256, max_batch=2)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=4, stop_ids=())
    engine.generate([GenRequest("a", [1, 5, 9], sampling)])  # decodes: the plan is built
    assert "_plan_cache" in model.__dict__
    engine.offload()
    assert "_plan_cache" not in model.__dict__
    assert not any("_packed" in m.__dict__ for m in model.modules())
    assert all(f._state is None for m in model.modules() for f in vars(m).values() if hasattr(f, "_state"))


@needs_native
def test_every_vector_path_takes_the_native_fp32_matmul(kernel_isa):
    # AVX-512 and AVX2 both run their own fp32 matmul (faster than oneDNN's at decode sizes, docs/engine.md);
    # only the scalar path leaves fp32 to oneDNN.
    assert bool(NATIVE.has_linear_fp32()) is (kernel_isa != "scalar")
    w = torch.randn(40, 64)
    assert (PackedWeight(w, NATIVE).native is NATIVE) is (kernel_isa != "scalar")


@needs_native
@pytest.mark.parametrize("seed", range(12))
def test_native_fp32_linear_on_random_shapes(seed, kernel_isa):
    # Shapes drawn, not chosen: every row-block size, short and long K (the K steps that request the next
    # panels and those that do not run in separate loops), ragged N.
    gen = torch.Generator().manual_seed(seed)
    m, k, n = (int(torch.randint(lo, hi, (), generator=gen)) for lo, hi in ((1, 70), (1, 1100), (1, 200)))
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen)
    got = NATIVE.linear(x, NATIVE.pack_linear(w), b, n)
    ref = F.linear(x.double(), w.double(), b.double())
    assert (got.double() - ref).abs().max().item() <= 1e-5 * (ref.abs().max().item() + 1.0)


@needs_native
@pytest.mark.parametrize("seed", [*range(6), 4000])  # 4000: a 1,845 × 774 weight, past AMX_MIN_MACS
def test_amx_handoff_routes_large_bf16_calls_to_onednn(seed, amx):
    # On a CPU with AMX tiles a bf16 call of at least AMX_MIN_MACS multiply-accumulates goes to oneDNN's
    # copy, a smaller one to ours (bit for bit each); with PIVOTRL_AMX=off every call stays on ours.
    if not _supported(torch.bfloat16):
        pytest.skip("no native bf16 matmul on this CPU")
    gen = torch.Generator().manual_seed(seed)
    n, k = (int(torch.randint(lo, hi, (), generator=gen)) for lo, hi in ((8, 2100), (8, 1100)))
    k += k % 2  # the native bf16 matmul packs K in pairs
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen)
    packed = PackedWeight(w, NATIVE)
    if amx == "auto" and n * k >= AMX_MIN_MACS:  # every call, one row included, is oneDNN's: no copy of ours
        assert packed.native is None and packed.onednn is None
        x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
        want = torch.ops.mkldnn._linear_pointwise(x, packed.data, b, "none", [], "")
        assert torch.equal(packed(x, b), want)
        return
    assert packed.native is NATIVE and (packed.onednn is not None) is (amx == "auto")
    rows = max(1, -(-AMX_MIN_MACS // (n * k)))
    if amx == "auto":
        assert packed.onednn_rows == rows
    for m in sorted({1, max(rows - 1, 1), rows, rows + 3}):
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        got = packed(x, b)
        ref = F.linear(x.double(), w.double(), b.double())
        assert (got.double() - ref).abs().max().item() <= 2**-7 * (ref.abs().max().item() + 1)
        if amx == "auto" and m >= rows:
            assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, packed.onednn, b, "none", [], ""))
        else:
            assert torch.equal(got, NATIVE.linear(x, packed.data, b, n))
