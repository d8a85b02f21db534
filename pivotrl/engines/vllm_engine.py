"""The `GenerationEngine` interface over vLLM (optional `gpu` extra), for real checkpoints on GPUs.

Why: on a GPU box vLLM's paged attention and CUDA graphs are far faster than our compact engine, and the
runtime should not care which one a device runs. This wrapper keeps the same contract — `add`, `step`,
`abort` returning partials, resume from `generated_ids`, `stats`, `load_state_dict`, `offload` — plus
vLLM's `sleep`/`wake_up` for parking a device without tearing the engine down.

**Never run against real vLLM here**: vLLM cannot be installed on the CPU-only development machine. The
module is written against vLLM's v1 `LLM`/`LLMEngine` API (>= 0.10.1, see pyproject.toml) and CI drives it
against a fake `vllm` (tests/engines/fake_vllm) that enforces the rules that broke it before: no start under
a daemonic parent process (a Dask worker is one unless `distributed.worker.daemon` is False), `collective_rpc`
takes a worker-extension method *name* and msgpack-native arguments only, `sleep(level)` / `wake_up(tags)`.
Importing this module never imports vllm; constructing `VLLMEngine` without vllm raises `VLLMUnavailable`.

Rules it follows so that it can run inside a Dask worker:
* EngineCore is started with `spawn` (`VLLM_WORKER_MULTIPROC_METHOD`), never `fork`: a fork after CUDA (or
  dask-cuda's driver context) is initialised breaks CUDA in the child.
* Weights are pushed through the worker extension `pivotrl.engines.vllm_worker.WeightLoader` in bounded
  chunks of raw bytes: no pickled function, no file in /dev/shm.
* `sleep`/`wake_up` let a device keep the engine resident across shifts (the runtime parks it), so a shift
  back costs a wake-up and a weight push instead of a rebuild (process spawn, load, compile, graph capture).

Semantics that differ from the compact engine (documented, not hidden):
* Sampling noise comes from vLLM's per-request generator. A resumed request is seeded with
  ``hash(seed, len(generated_ids))``, so resuming is deterministic, but a *sampled* continuation is not the
  one the uninterrupted run would have drawn. Greedy continuations are identical (up to kernel numerics).
* Log-probs are vLLM's `logprobs=0` values for the sampled token; vLLM v1 returns raw log-probs
  (temperature 1, before top-p) by default, like the compact engine.
* The KV budget is enforced at admission here (sum of reservations <= `kv_budget_tokens`); vLLM itself
  sizes its paged cache from `gpu_memory_utilization` and may preempt (recompute) under pressure.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pivotrl.engines.requests import FinishReason, GenRequest, GenResult, RequestBook
from pivotrl.engines.vllm_worker import LOAD_METHOD, WORKER_EXTENSION, wire_chunks
from pivotrl.errors import UserError

INSTALL_HINT = "vllm is not installed: pip install 'pivotrl[gpu]' on a machine with a CUDA GPU"
WAKE_TAGS = frozenset({"weights", "kv_cache", "scheduling"})  # vLLM's CuMemAllocator tags (+ the scheduler)
DAEMON_HINT = (
    "vllm: this process is daemonic (a Dask worker by default) and vLLM starts its engine core as a child "
    "process, which daemonic processes may not have; start the workers with "
    "DASK_DISTRIBUTED__WORKER__DAEMON=False (pivotrl's LocalCUDACluster does), or set "
    "VLLM_ENABLE_V1_MULTIPROCESSING=0 for an in-process engine"
)


class VLLMUnavailable(UserError, ImportError):
    """vllm (the optional `gpu` extra) is missing; the message says how to install it."""


def import_vllm():
    """Import vllm on demand; a clear one-line error when it is absent."""
    try:
        import vllm
    except ImportError as exc:
        raise VLLMUnavailable(f"{INSTALL_HINT} ({exc})") from None
    return vllm


def resume_seed(seed: int, n_generated: int) -> int:
    """Deterministic seed for a request resumed after `n_generated` tokens."""
    return zlib.crc32(f"{seed}:{n_generated}".encode()) if n_generated else seed


@dataclass
class _Track:
    req: GenRequest
    reserve: int
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def check_process_may_start_vllm() -> None:
    """Fail with the fix, before vLLM fails with an assertion deep in its start-up (v1 multiprocess mode)."""
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    if multiprocessing.current_process().daemon and not in_process:
        raise UserError(DAEMON_HINT)


class VLLMEngine(RequestBook):
    """`GenerationEngine`'s interface backed by a synchronous vLLM `LLMEngine`."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        kv_budget_tokens: int,
        max_batch: int,
        device: str = "cuda",
        dtype: str = "auto",
        max_seq_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = True,
        seed: int = 0,
        **llm_kwargs: Any,
    ) -> None:
        vllm = import_vllm()
        if kv_budget_tokens < 1 or max_batch < 1:
            raise ValueError("kv_budget_tokens and max_batch must be >= 1")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={gpu_memory_utilization}: expected a fraction in (0, 1]"
            )
        check_process_may_start_vllm()
        # spawn, not fork: this process may already hold a CUDA context (torch's, or dask-cuda's own)
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        self._vllm = vllm
        self.model_path = str(model_path)
        self.kv_budget_tokens = kv_budget_tokens
        self.max_batch = max_batch
        self.device = device
        kwargs = dict(
            model=self.model_path,
            dtype=dtype,
            max_num_seqs=max_batch,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            seed=seed,
            skip_tokenizer_init=True,
            worker_extension_cls=WORKER_EXTENSION,
        )
        if max_seq_len is not None:
            kwargs["max_model_len"] = max_seq_len
        kwargs.update(llm_kwargs)
        self.llm = vllm.LLM(**kwargs)
        self.engine = self.llm.llm_engine
        self.max_seq_len = int(max_seq_len or self.engine.model_config.max_model_len)
        self.running: dict[str, _Track] = {}
        self.waiting: deque[GenRequest] = deque()
        self.reserved_tokens = 0
        self.released: set[str] = set()  # memory tags given back by sleep() and not woken since
        self.weights_dropped = False  # sleep(level=2): the weights must be pushed before the next step
        self._ready: list[GenResult] = []
        self.tokens_generated = 0
        self.busy_time_s = 0.0
        self.steps = 0
        self.samples: deque[tuple[int, float]] = deque(maxlen=4096)

    # -- same interface as GenerationEngine -------------------------------------------------------------
    def add(self, req: GenRequest) -> None:
        self._check_live()
        if not req.prompt_ids:
            raise ValueError(f"{req.seq_id}: empty prompt")
        if len(req.prompt_ids) + len(req.generated_ids) >= self.max_seq_len:
            raise ValueError(f"{req.seq_id}: prompt+generated does not fit max_seq_len={self.max_seq_len}")
        if req.seq_id in self.running or any(w.seq_id == req.seq_id for w in self.waiting):
            raise ValueError(f"{req.seq_id}: already queued on this engine")
        gen = req.generated_ids
        if len(gen) >= req.sampling.max_new_tokens or (gen and gen[-1] in req.sampling.stop_ids):
            reason: FinishReason = "stop" if gen and gen[-1] in req.sampling.stop_ids else "length"
            self._ready.append(
                GenResult(req.seq_id, list(req.prompt_ids), list(gen), list(req.logprobs), reason)
            )
            return
        self.waiting.append(req)

    def step(self) -> list[GenResult]:
        self._check_live()
        if self.sleeping or self.weights_dropped:
            raise RuntimeError(
                "engine is asleep (or its weights were dropped); wake_up() / load_state_dict()"
            )
        done, self._ready = self._ready, []
        self._admit()
        if not self.running:
            return done
        t0 = time.perf_counter()
        outputs = self.engine.step()
        dt = time.perf_counter() - t0
        produced = 0
        for out in outputs:
            track = self.running.get(out.request_id)
            if track is None:
                continue
            completion = out.outputs[0]
            new_ids = list(completion.token_ids)
            produced += len(new_ids)
            track.generated += new_ids
            for tok, lp in zip(new_ids, completion.logprobs or []):
                track.logprobs.append(float(lp[tok].logprob))
            if out.finished:
                reason = (
                    completion.finish_reason if completion.finish_reason in ("stop", "length") else "abort"
                )
                done.append(self._finish(out.request_id, reason))
        self.busy_time_s += dt
        self.steps += 1
        self.tokens_generated += produced
        self.samples.append((len(self.running) + len(done), dt))
        return done

    def abort(self, seq_ids) -> list[GenResult]:
        wanted = set(seq_ids)
        out = self._take_queued(wanted)
        ids = [s for s in wanted if s in self.running]
        if ids:
            self.engine.abort_request(ids)
            out += [self._finish(s, "abort") for s in ids]
        return out

    def load_state_dict(self, state_dict, chunk_bytes: int | None = None) -> int:
        """Push new weights (HF names) into every vLLM worker through the worker extension, in chunks of raw
        bytes (no file, no pickled code); returns the number of tensors sent. Drops stale prefix-cache
        entries: versions change only once the context has drained, so a refused reset is a bug."""
        self._check_live()
        if "weights" in self.released:  # the weights' memory must be mapped again before it is written
            self.wake_up(["weights"])
        tied = getattr(self.engine.model_config.hf_config, "tie_word_embeddings", False)
        skip = ("lm_head.weight",) if tied else ()
        sent = 0
        kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
        for chunk in wire_chunks(state_dict, skip=skip, **kw):
            self.llm.collective_rpc(LOAD_METHOD, args=(chunk,))
            sent += len(chunk)
        self.weights_dropped = False
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")
        return sent

    def sleep(self, level: int = 1) -> list[GenResult]:
        """Abort everything and park the engine (level 1: weights to host memory; level 2: weights dropped,
        so `load_state_dict` must run before the next step); returns the partials."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: vLLM has levels 1 and 2")
        self._check_live()
        partials = self.abort([*self.running, *(w.seq_id for w in self.waiting)]) + self._ready
        self._ready = []
        self.llm.sleep(level=level)
        self.released, self.weights_dropped = {"weights", "kv_cache"}, level == 2
        return partials

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Map the memory of `tags` again (None: all). Weights dropped at level 2 need `load_state_dict`."""
        if tags is not None and not set(tags) <= WAKE_TAGS:
            raise ValueError(f"wake_up tags {sorted(set(tags) - WAKE_TAGS)}: vLLM knows {sorted(WAKE_TAGS)}")
        self._check_live()
        self.llm.wake_up(tags)
        self.released -= WAKE_TAGS if tags is None else set(tags)

    @property
    def sleeping(self) -> bool:
        return bool(self.released)

    def offload(self) -> list[GenResult]:
        """Abort all, shut the vLLM engine down and free its GPU memory; returns the partials.

        The engine core is shut down explicitly rather than left to a garbage-collector finaliser: memory
        freed late trips the next engine's start-up memory check."""
        if self.llm is None:
            return []
        partials = self.abort([*self.running, *(w.seq_id for w in self.waiting)]) + self._ready
        self._ready = []
        core = getattr(self.engine, "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del self.engine
        self.llm = None
        import gc

        gc.collect()
        from pivotrl.engines.device_memory import free_cuda_cache

        free_cuda_cache()
        return partials

    def stats(self) -> dict:
        return {
            "tokens_generated": self.tokens_generated,
            "busy_time_s": self.busy_time_s,
            "tokens_per_s": self.tokens_generated / self.busy_time_s if self.busy_time_s else 0.0,
            "steps": self.steps,
            "running": self.num_running,
            "waiting": self.num_waiting,
            "reserved_tokens": self.reserved_tokens,
            "kv_budget_tokens": self.kv_budget_tokens,
            "samples": list(self.samples),
        }

    # -- internals ----------------------------------------------------------------------------------------
    def _check_live(self) -> None:
        if self.llm is None:
            raise RuntimeError("engine was offloaded; build a new one")

    def sampling_params(self, req: GenRequest):
        """vLLM `SamplingParams` for (the rest of) `req`."""
        from vllm.sampling_params import RequestOutputKind

        s = req.sampling
        return self._vllm.SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=s.max_new_tokens - len(req.generated_ids),
            stop_token_ids=list(s.stop_ids),
            ignore_eos=True,  # stop only on `stop_ids`, like the compact engine
            seed=resume_seed(s.seed, len(req.generated_ids)),
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            need = self.reservation(req)
            if self.running and self.reserved_tokens + need > self.kv_budget_tokens:
                break
            self.waiting.popleft()
            prompt = {"prompt_token_ids": list(req.prompt_ids) + list(req.generated_ids)}
            # booked only once vLLM took it: a phantom entry would make every later step() block forever
            self.engine.add_request(req.seq_id, prompt, self.sampling_params(req))
            self.reserved_tokens += need
            self.running[req.seq_id] = _Track(req, need, list(req.generated_ids), list(req.logprobs))

    def _finish(self, seq_id: str, reason: FinishReason) -> GenResult:
        track = self.running.pop(seq_id)
        self.reserved_tokens -= track.reserve
        req = track.req
        return GenResult(seq_id, list(req.prompt_ids), track.generated, track.logprobs, reason)
