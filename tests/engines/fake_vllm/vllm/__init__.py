"""A fake `vllm` for CPU tests of `pivotrl.engines.vllm_engine`: the real signatures, and the real rules.

Not a language model: the next token is a checksum of the loaded weights and the context, so greedy
generation is deterministic, resumable, and changes when the weights do. What it enforces is what broke
(or would break) the real engine, so that drift is caught in CI:

* `LLM(**kwargs)` takes the keyword names the real `LLM`/`EngineArgs` take and no others (TypeError).
* It refuses to start its engine core under a daemonic process (CPython's multiprocessing assertion),
  unless `VLLM_ENABLE_V1_MULTIPROCESSING=0` (in-process engine); it records the start method.
* A start-up memory check like vLLM's: `gpu_memory_utilization × total` must not exceed free memory,
  with the device given by `FAKE_DEVICE = (total_bytes, free_bytes)` (None: no check).
* `worker_extension_cls` is a qualified *name*, imported and mixed into the worker class.
* `collective_rpc(method)` takes a method name only (a callable is refused as msgpack refuses it on
  >= 0.9), and its arguments cross a msgpack-like boundary: tuples become lists, a torch tensor becomes
  the bare `[dtype, shape, index]` list the real decoder produces for untyped arguments, anything else
  that is not msgpack-native raises TypeError.
* `sleep(level)` with level 1 or 2 only, and only with `enable_sleep_mode=True`; `wake_up(tags)` with tags
  from {weights, kv_cache, scheduling}; generating with released memory or dropped weights raises.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "RequestOutputKind", "SamplingParams"]
__version__ = "0.0.0+fake"

FAKE_DEVICE: tuple[int, int] | None = None
LLM_KWARGS = {
    "model",
    "tokenizer",
    "tokenizer_mode",
    "skip_tokenizer_init",
    "trust_remote_code",
    "tensor_parallel_size",
    "dtype",
    "quantization",
    "revision",
    "seed",
    "gpu_memory_utilization",
    "swap_space",
    "cpu_offload_gb",
    "enforce_eager",
    "max_model_len",
    "max_num_seqs",
    "enable_sleep_mode",
    "worker_extension_cls",
    "enable_prefix_caching",
    "distributed_executor_backend",
    "max_num_batched_tokens",
    "kv_cache_dtype",
}
WAKE_TAGS = {"weights", "kv_cache", "scheduling"}
LIVE_ENGINES: list[LLM] = []  # engines started and not shut down (a leak shows here)


def _msgpack_boundary(obj: Any) -> Any:
    """What the other side of vLLM's untyped msgpack channel receives for `obj` (or TypeError)."""
    import torch

    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return bytes(obj)
    if isinstance(obj, (list, tuple)):
        return [_msgpack_boundary(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _msgpack_boundary(v) for k, v in obj.items()}
    if isinstance(obj, torch.Tensor):  # typed only where the decoder knows the type: here it does not
        return [str(obj.dtype).removeprefix("torch."), list(obj.shape), 1]
    raise TypeError(
        f"Object of type {type(obj)} is not serializable. Set VLLM_ALLOW_INSECURE_SERIALIZATION=1 to allow "
        "fallback to pickle-based serialization."
    )


class FakeModel:
    """Holds named weights; `load_weights` as vLLM's models have it (an iterable of (name, tensor))."""

    def __init__(self, weights: dict[str, Any]) -> None:
        self.weights = dict(weights)
        self.digest: int | None = self._digest()
        self.loads = 0

    def _digest(self) -> int:
        total = sum(float(t.double().sum()) for t in self.weights.values())
        return zlib.crc32(f"{total:.6e}".encode())

    def load_weights(self, weights) -> set[str]:
        import torch

        loaded = set()
        for name, t in weights:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
            if name not in self.weights or tuple(t.shape) != tuple(self.weights[name].shape):
                raise KeyError(f"{name}: not a parameter of this model (or wrong shape {tuple(t.shape)})")
            self.weights[name] = t.clone()
            loaded.add(name)
        self.digest = self._digest()
        self.loads += 1
        return loaded


class FakeWorker:
    def __init__(self, model: FakeModel) -> None:
        self.model_runner = type("ModelRunner", (), {})()
        self.model_runner.model = model


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    text: str = ""


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass
class _Req:
    rid: str
    context: list[int]
    params: SamplingParams
    n_out: int = 0


class ModelConfig:
    def __init__(self, max_model_len: int, hf_config: Any) -> None:
        self.max_model_len = max_model_len
        self.hf_config = hf_config


class EngineCoreClient:
    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.alive = True

    def shutdown(self) -> None:
        if self.alive and self.llm in LIVE_ENGINES:
            LIVE_ENGINES.remove(self.llm)
        self.alive = False


class LLMEngine:
    def __init__(self, llm: LLM, model_config: ModelConfig) -> None:
        self.llm = llm
        self.model_config = model_config
        self.engine_core = EngineCoreClient(llm)
        self.requests: dict[str, _Req] = {}

    def _live(self) -> None:
        if not self.engine_core.alive:
            raise RuntimeError("EngineCore is dead (shut down)")

    def add_request(self, request_id: str, prompt: dict, params: SamplingParams, **_: Any) -> str:
        self._live()
        if not isinstance(request_id, str) or request_id in self.requests:
            raise ValueError(f"request id {request_id!r}: not a new string id")
        ids = list(prompt["prompt_token_ids"])
        vocab = self.model_config.hf_config.vocab_size
        bad = [t for t in ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary")
        if len(ids) + params.max_tokens > self.model_config.max_model_len:
            raise ValueError("prompt + max_tokens exceeds max_model_len")
        self.requests[request_id] = _Req(request_id, ids, params)
        return request_id

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        self._live()
        if isinstance(request_ids, str) or not isinstance(request_ids, (list, tuple)):
            raise TypeError("abort_request takes a list of request ids")
        for rid in request_ids:
            self.requests.pop(rid, None)

    def step(self) -> list[RequestOutput]:
        self._live()
        self.llm._check_runnable()
        model = self.llm.worker.model_runner.model
        outs = []
        for rid, r in list(self.requests.items()):
            tail = ",".join(map(str, r.context[-4:]))
            vocab = self.model_config.hf_config.vocab_size
            if r.params.temperature == 0:
                tok = zlib.crc32(f"{model.digest}:{len(r.context)}:{tail}".encode()) % vocab
            else:
                tok = zlib.crc32(f"{model.digest}:{r.params.seed}:{len(r.context)}:{tail}".encode()) % vocab
            r.context.append(tok)
            r.n_out += 1
            lp = {tok: Logprob(-0.1 - (tok % 7) / 3.0, 1)} if r.params.logprobs is not None else None
            reason = None
            if tok in r.params.stop_token_ids:
                reason = "stop"
            elif r.n_out >= r.params.max_tokens:
                reason = "length"
            done = reason is not None
            outs.append(RequestOutput(rid, [CompletionOutput(0, [tok], [lp] if lp else None, reason)], done))
            if done:
                del self.requests[rid]
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = set(kwargs) - LLM_KWARGS
        if unknown:
            raise TypeError(
                f"EngineArgs.__init__() got an unexpected keyword argument {sorted(unknown)[0]!r}"
            )
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        if multiprocessing.current_process().daemon and not in_process:
            raise AssertionError("daemonic processes are not allowed to have children")
        self.start_method = None if in_process else os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork")
        self.kwargs = dict(kwargs, model=model)
        util = float(kwargs.get("gpu_memory_utilization", 0.9))
        if FAKE_DEVICE is not None and util * FAKE_DEVICE[0] > FAKE_DEVICE[1]:
            raise ValueError(
                f"Free memory on device ({FAKE_DEVICE[1]}) is less than desired GPU memory utilization "
                f"({util}, {util * FAKE_DEVICE[0]:.0f})"
            )
        from safetensors.torch import load_file
        from transformers import AutoConfig

        path = Path(model)
        hf_config = AutoConfig.from_pretrained(path)
        weights: dict[str, Any] = {}
        for f in sorted(path.glob("*.safetensors")):
            weights.update(load_file(f))
        if getattr(hf_config, "tie_word_embeddings", False):
            weights.pop("lm_head.weight", None)
        max_len = int(
            kwargs.get("max_model_len")
            or json.loads((path / "config.json").read_text()).get("max_position_embeddings", 2048)
        )
        cls: type = FakeWorker
        ext = kwargs.get("worker_extension_cls")
        if ext:
            if not isinstance(ext, str):
                raise TypeError("worker_extension_cls must be a qualified class name (a string)")
            module, _, name = ext.rpartition(".")
            cls = type(
                "WorkerWithExtension", (FakeWorker, getattr(importlib.import_module(module), name)), {}
            )
        self.worker = cls(FakeModel(weights))
        self.llm_engine = LLMEngine(self, ModelConfig(max_len, hf_config))
        self.asleep: set[str] = set()  # tags whose memory is released
        self.weights_dropped = False
        self.rpc_calls: list[str] = []
        LIVE_ENGINES.append(self)

    def _check_runnable(self) -> None:
        if self.asleep:
            raise RuntimeError(f"engine is sleeping ({sorted(self.asleep)} released); call wake_up()")
        if self.weights_dropped:
            raise RuntimeError("weights were discarded by sleep(level=2) and not loaded again")

    def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list[Any]:
        if not isinstance(method, str):
            _msgpack_boundary(object())  # what msgpack does with a function: TypeError
        self.llm_engine._live()
        wire_args = _msgpack_boundary(list(args))
        wire_kwargs = _msgpack_boundary(dict(kwargs or {}))
        if "weights" in self.asleep:
            raise RuntimeError("collective_rpc into released weight memory: wake_up(['weights']) first")
        fn = getattr(self.worker, method)  # AttributeError: no such worker(-extension) method
        self.rpc_calls.append(method)
        result = fn(*wire_args, **wire_kwargs)
        if method.endswith("load_weights"):
            self.weights_dropped = False
        return [result]

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return not self.llm_engine.requests

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if not self.kwargs.get("enable_sleep_mode"):
            raise ValueError("Sleep mode is not enabled (enable_sleep_mode=False)")
        if level not in (1, 2):
            raise ValueError(f"invalid sleep level {level}")
        self.llm_engine.requests.clear()
        self.asleep = {"weights", "kv_cache", "scheduling"}
        self.weights_dropped = level == 2

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is not None and (not isinstance(tags, list) or not set(tags) <= WAKE_TAGS):
            raise ValueError(f"wake_up tags must be a list from {sorted(WAKE_TAGS)}, got {tags!r}")
        self.asleep -= WAKE_TAGS if tags is None else set(tags)
        self.asleep.discard("scheduling")  # any wake_up resumes the scheduler (vLLM core.py)
