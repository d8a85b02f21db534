"""The vLLM role context on the fake vllm: weights fetched to the host, vLLM's share computed from measured
free memory (not a fixed 0.5), a resident engine parked by sleeping and woken on the way back."""

from __future__ import annotations

import pytest

from pivotrl.engines.gpu_budget import DeviceMemory, GiB
from pivotrl.runtime.messages import WorkItem


class Env:
    def __init__(self, gps, device: str) -> None:
        self.gps, self.device, self.name = gps, device, "0"


@pytest.fixture
def store(tmp_path, debug_model_dir):
    from pivotrl.engines.checkpoints import load_state_dict
    from pivotrl.gps import ParameterStore

    with ParameterStore(tmp_path / "gps", device_tier_bytes=0) as gps:
        gps.publish("policy", 0, load_state_dict(debug_model_dir))
        gps.flush()
        yield gps


def spec(debug_model_dir) -> dict:
    return {"model": "policy", "version": 0, "hf_dir": str(debug_model_dir), "backend": "vllm",
            "kv_budget_tokens": 2048, "max_batch": 4, "dtype": "float32"}  # fmt: skip


def item(i: int) -> WorkItem:
    sampling = {"temperature": 0.0, "max_new_tokens": 8, "stop_ids": []}
    return WorkItem(id=f"g{i}", role="rollout", payload={"prompt_ids": [1, 7 + i, 9], "sampling": sampling})


def run(ctx) -> dict[str, list[int]]:
    for i in range(3):
        ctx.add(item(i))
    out = {}
    while ctx.has_work():
        done, _ = ctx.step()
        out.update({r.id: r.generated for r in done})
    return out


def test_vllm_share_comes_from_free_memory_and_passes_the_start_check(fake_vllm, store, debug_model_dir,
                                                                       monkeypatch):  # fmt: skip
    from pivotrl.runtime import vllm_budget
    from pivotrl.runtime.roles import GenerationContext

    # a GPU with 30 of 80 GiB free (a trainer, the tier, a sleeping engine hold the rest)
    fake_vllm.FAKE_DEVICE = (80 * GiB, 30 * GiB)
    monkeypatch.setattr(vllm_budget, "read_cuda_memory", lambda device: DeviceMemory(80 * GiB, 30 * GiB))
    with pytest.raises(ValueError, match="Free memory on device"):  # the old fixed share fails to start
        fake_vllm.LLM(str(debug_model_dir), gpu_memory_utilization=0.5)
    ctx = GenerationContext("rollout", spec(debug_model_dir))
    env = Env(store, "cuda:0")
    state = ctx.fetch(env, 0)
    assert {t.device.type for t in state.values()} == {"cpu"}  # vLLM reads pushed weights from the host
    ctx.load(env, state)
    assert ctx.budget.gpu_memory_utilization * 80 * GiB <= 30 * GiB
    assert ctx.budget.gpu_memory_utilization == pytest.approx(28 / 80, abs=1e-3)
    assert ctx.engine.llm.kwargs["gpu_memory_utilization"] == ctx.budget.gpu_memory_utilization
    assert len(run(ctx)) == 3
    ctx.offload()
    assert fake_vllm.LIVE_ENGINES == []


def test_a_parked_vllm_context_sleeps_and_wakes_with_the_same_tokens(fake_vllm, store, debug_model_dir):
    from pivotrl.runtime.role_host import Resident
    from pivotrl.runtime.roles import GenerationContext

    ctx = GenerationContext("rollout", spec(debug_model_dir))
    env = Env(store, "cpu")
    ctx.load(env, ctx.fetch(env, 0))
    before = run(ctx)
    assert isinstance(ctx, Resident) and ctx.parkable()
    ctx.park()
    assert ctx.engine.sleeping and ctx.engine.llm.asleep  # vLLM released its memory
    assert ctx.unpark(env) is True
    assert run(ctx) == before
    ctx.offload()


def test_train_and_torch_generation_contexts_free_the_cuda_cache_on_offload(
    monkeypatch, store, debug_model_dir
):
    from pivotrl.runtime import roles

    calls = []
    monkeypatch.setattr(roles, "free_cuda_cache", lambda: calls.append(1) or False)
    common = {"model": "policy", "version": 0, "hf_dir": str(debug_model_dir), "kv_budget_tokens": 512}
    env = Env(store, "cpu")
    for cls in (roles.TrainContext, roles.GenerationContext):
        ctx = cls("train", dict(common))
        ctx.load(env, ctx.fetch(env, 0))
        ctx.offload()
    assert len(calls) == 2
