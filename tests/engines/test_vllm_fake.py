"""`vllm_engine.py` driven against the fake `vllm` in tests/engines/fake_vllm, which enforces the real
signatures and rules (daemonic parent refused, `collective_rpc` of a method name with msgpack-native
arguments only, sleep levels and wake-up tags), so drift from vLLM's API is caught without a GPU.

The fake is put on sys.path by the `fake_vllm` fixture only, so the "vllm not installed" paths of every
other test still hold."""

from __future__ import annotations

import ast
import multiprocessing
import os
import sys
from pathlib import Path

import pytest

from pivotrl.engines.requests import GenRequest, SamplingParams
from pivotrl.errors import UserError
from tests.engines.conftest import FAKE

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, stop_ids=())


@pytest.fixture
def make(fake_vllm, debug_model_dir):
    from pivotrl.engines.vllm_engine import VLLMEngine

    def build(**kw):
        kw.setdefault("kv_budget_tokens", 4096)
        kw.setdefault("max_batch", 8)
        return VLLMEngine(debug_model_dir, dtype="float32", gpu_memory_utilization=0.2, **kw)

    return build


def prompts(n: int = 4) -> list[list[int]]:
    return [[1, 20 + i, 30 + i, 40] for i in range(n)]


def test_abort_then_resume_on_another_engine_matches_uninterrupted(make):
    engine = make()
    reference = engine.generate([GenRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts())])
    for i, p in enumerate(prompts()):
        engine.add(GenRequest(f"s{i}", p, GREEDY))
    for _ in range(6):
        engine.step()
    partials = engine.abort(["s1", "s2"])
    assert {p.seq_id for p in partials} == {"s1", "s2"}
    assert all(len(p.generated_ids) == 6 for p in partials)
    rest = {}
    while engine.has_work():
        rest.update({r.seq_id: r for r in engine.step()})
    engine.offload()
    other = make()
    resumed = {r.seq_id: r for r in other.generate([p.as_request(GREEDY) for p in partials])}
    got = {**rest, **resumed}
    for i, ref in enumerate(reference):
        assert got[f"s{i}"].generated_ids == ref.generated_ids
        assert len(got[f"s{i}"].logprobs) == GREEDY.max_new_tokens
    other.offload()


def test_engine_core_starts_with_spawn_and_is_shut_down_on_offload(make, fake_vllm):
    engine = make()
    assert engine.llm.start_method == "spawn"  # never fork after CUDA (or dask-cuda's context) is up
    assert [engine.llm] == fake_vllm.LIVE_ENGINES
    engine.offload()
    assert fake_vllm.LIVE_ENGINES == []  # shut down explicitly, not left to the garbage collector
    with pytest.raises(RuntimeError, match="offloaded"):
        engine.step()


def test_weight_push_goes_through_the_worker_extension_without_any_file(make, debug_model_dir):
    from pivotrl.engines.checkpoints import load_state_dict

    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    engine = make()
    before = engine.generate([GenRequest("a", [1, 5, 6, 7], GREEDY)])[0].generated_ids
    state = load_state_dict(debug_model_dir)
    sent = engine.load_state_dict({k: v * 3 for k, v in state.items()}, chunk_bytes=64 << 10)
    assert sent == len(state) - 1  # the tied lm_head stays behind
    calls = engine.llm.rpc_calls
    assert len(calls) > 1 and set(calls) == {"pivotrl_load_weights"}  # a method name, in bounded chunks
    changed = engine.generate([GenRequest("b", [1, 5, 6, 7], GREEDY)])[0].generated_ids
    assert changed != before
    engine.load_state_dict(state)
    assert engine.generate([GenRequest("c", [1, 5, 6, 7], GREEDY)])[0].generated_ids == before
    if os.path.isdir("/dev/shm"):
        assert set(os.listdir("/dev/shm")) <= shm  # nothing written there (the old push wrote the model)
    engine.offload()


def test_the_fake_refuses_what_real_vllm_refuses(make):
    engine = make()
    with pytest.raises(TypeError, match="not serializable"):
        engine.llm.collective_rpc(lambda worker: 1)  # vLLM >= 0.9 cannot send a function
    import torch

    with pytest.raises(TypeError, match="wire tensor"):  # a raw tensor arrives as an untyped list
        engine.llm.collective_rpc("pivotrl_load_weights", args=([("model.norm.weight", torch.ones(128))],))
    with pytest.raises(AttributeError):
        engine.llm.collective_rpc("no_such_method")
    with pytest.raises(ValueError, match="sleep level"):
        engine.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        engine.wake_up(["weights", "kv"])
    engine.offload()


def test_only_method_names_are_sent_through_collective_rpc():
    """Static check of the source: every `collective_rpc` call names its method (no pickled function)."""
    import pivotrl.engines.vllm_engine as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "collective_rpc"
    ]
    assert calls
    for call in calls:
        first = call.args[0]
        assert isinstance(first, ast.Constant | ast.Name), ast.dump(first)
        if isinstance(first, ast.Name):
            assert first.id == "LOAD_METHOD"
    from pivotrl.engines.vllm_worker import LOAD_METHOD, WeightLoader

    assert callable(getattr(WeightLoader, LOAD_METHOD))


def test_sleep_and_wake_keep_a_resident_engine(make, debug_model_dir):
    from pivotrl.engines.checkpoints import load_state_dict

    engine = make()
    before = engine.generate([GenRequest("a", [1, 5, 6, 7], GREEDY)])[0].generated_ids
    engine.add(GenRequest("x", [1, 2, 3], GREEDY))
    engine.step()
    partials = engine.sleep(level=1)
    assert [p.seq_id for p in partials] == ["x"] and len(partials[0].generated_ids) == 1
    with pytest.raises(RuntimeError, match="asleep"):
        engine.step()
    engine.wake_up()
    assert engine.generate([GenRequest("b", [1, 5, 6, 7], GREEDY)])[0].generated_ids == before
    # level 2 drops the weights: weights woken first, pushed, then the KV cache
    engine.sleep(level=2)
    engine.wake_up(["weights"])
    engine.load_state_dict(load_state_dict(debug_model_dir))
    engine.wake_up(["kv_cache"])
    assert engine.generate([GenRequest("c", [1, 5, 6, 7], GREEDY)])[0].generated_ids == before
    engine.offload()


def test_a_request_vllm_refuses_is_not_booked(make):
    """A failed add_request used to leave a phantom running entry, on which every later step() blocks."""
    engine = make()
    engine.add(GenRequest("bad", [1, 10_000, 3], GREEDY))
    with pytest.raises(ValueError, match="out of vocabulary"):
        engine.step()
    assert "bad" not in engine.running and engine.reserved_tokens == 0
    out = engine.generate([GenRequest("ok", [1, 5, 6], GREEDY)])
    assert out[0].seq_id == "ok" and len(out[0].generated_ids) == GREEDY.max_new_tokens
    engine.offload()


def _start_in_daemon(path: str, fake: str, queue) -> None:
    sys.path.insert(0, fake)
    try:
        from pivotrl.engines.vllm_engine import VLLMEngine

        VLLMEngine(path, kv_budget_tokens=64, max_batch=1)
        queue.put("started")
    except BaseException as exc:  # report the class and message to the parent
        queue.put(f"{type(exc).__name__}: {exc}")


def test_a_daemonic_process_is_refused_with_the_fix(fake_vllm, debug_model_dir):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_start_in_daemon, args=(str(debug_model_dir), str(FAKE), queue), daemon=True)
    proc.start()
    got = queue.get(timeout=120)
    proc.join(30)
    assert got.startswith("UserError") and "DASK_DISTRIBUTED__WORKER__DAEMON=False" in got


def test_the_fake_itself_enforces_the_daemon_rule(fake_vllm, debug_model_dir, monkeypatch):
    class Daemonic:
        daemon = True

    monkeypatch.setattr(multiprocessing, "current_process", lambda: Daemonic())
    with pytest.raises(AssertionError, match="daemonic"):
        fake_vllm.LLM(str(debug_model_dir))
    from pivotrl.engines.vllm_engine import VLLMEngine

    with pytest.raises(UserError, match="daemonic"):
        VLLMEngine(debug_model_dir, kv_budget_tokens=64, max_batch=1)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: allowed
    engine = VLLMEngine(debug_model_dir, kv_budget_tokens=64, max_batch=1)
    assert engine.llm.start_method is None
    engine.offload()


def test_unknown_engine_arguments_are_refused_like_engine_args(make):
    with pytest.raises(TypeError, match="unexpected keyword"):
        make(no_such_vllm_option=1)
