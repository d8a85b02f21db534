"""vLLM-backed engine: lazy import and a clear error without vllm; the real thing only where vllm runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pivotrl.engines.requests import GenRequest, SamplingParams
from pivotrl.errors import UserError


def test_importing_the_module_does_not_import_vllm():
    code = (
        "import sys, pivotrl.engines.vllm_engine as m; "
        "assert 'vllm' not in sys.modules, 'vllm imported eagerly'; print(m.VLLMEngine.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "VLLMEngine"


def test_constructing_without_vllm_raises_a_clear_error(monkeypatch, tmp_path):
    from pivotrl.engines import vllm_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail even where it is installed
    with pytest.raises(vllm_engine.VLLMUnavailable) as info:
        vllm_engine.VLLMEngine(tmp_path, kv_budget_tokens=1024, max_batch=4)
    assert isinstance(info.value, UserError) and isinstance(info.value, ImportError)
    assert "pip install 'pivotrl[gpu]'" in str(info.value)
    assert "\n" not in str(info.value)


def test_resume_seed_is_deterministic():
    from pivotrl.engines.vllm_engine import resume_seed

    assert resume_seed(7, 0) == 7
    assert resume_seed(7, 5) == resume_seed(7, 5) != resume_seed(7, 6)


# ---- below: only where vllm is installed and a CUDA GPU is present -----------------------------------------


@pytest.fixture(scope="module")
def vllm_engine_factory(tmp_path_factory):
    pytest.importorskip("vllm")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("vLLM tests need a CUDA GPU")
    from pivotrl.engines.checkpoints import create_model
    from pivotrl.engines.vllm_engine import VLLMEngine

    path = create_model("debug", tmp_path_factory.mktemp("vllm") / "debug", seed=0)

    def make(**kw):
        kw.setdefault("kv_budget_tokens", 8192)
        kw.setdefault("max_batch", 8)
        return VLLMEngine(path, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True, **kw)

    return path, make


@pytest.mark.vllm
@pytest.mark.gpu
def test_vllm_abort_then_resume_matches_uninterrupted(vllm_engine_factory):
    _, make = vllm_engine_factory
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32, stop_ids=())
    prompts = [[1, 20 + i, 30 + i, 40] for i in range(4)]
    engine = make()
    reference = engine.generate([GenRequest(f"r{i}", p, greedy) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        engine.add(GenRequest(f"s{i}", p, greedy))
    for _ in range(6):
        engine.step()
    partials = engine.abort(["s1", "s2"])
    assert {p.seq_id for p in partials} == {"s1", "s2"}
    rest = {}
    while engine.has_work():
        rest.update({r.seq_id: r for r in engine.step()})
    engine.offload()
    other = make()
    resumed = {r.seq_id: r for r in other.generate([p.as_request(greedy) for p in partials])}
    got = {**rest, **resumed}
    for i, ref in enumerate(reference):
        assert got[f"s{i}"].generated_ids == ref.generated_ids
        assert len(got[f"s{i}"].logprobs) == 32
    other.offload()


@pytest.mark.vllm
@pytest.mark.gpu
def test_vllm_weights_sleep_and_wake(vllm_engine_factory):
    from pivotrl.engines.checkpoints import load_state_dict

    path, make = vllm_engine_factory
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, stop_ids=())
    engine = make()
    before = engine.generate([GenRequest("a", [1, 5, 6, 7], greedy)])[0].generated_ids
    engine.load_state_dict({k: v * 3 for k, v in load_state_dict(path).items()})
    changed = engine.generate([GenRequest("b", [1, 5, 6, 7], greedy)])[0].generated_ids
    assert changed != before
    engine.load_state_dict(load_state_dict(path))
    engine.sleep(level=1)
    engine.wake_up()
    again = engine.generate([GenRequest("c", [1, 5, 6, 7], greedy)])[0].generated_ids
    assert again == before
    assert engine.stats()["tokens_generated"] >= 48
    engine.offload()
