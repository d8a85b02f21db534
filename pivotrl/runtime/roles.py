"""Role contexts: what a device holds while it serves one role.

Every context has the same life cycle, which is what makes shifting one code path for every pair of roles:

    ctx = Context(role, spec)          # spec: GPS model name, version, HF dir (config), engine options
    state = ctx.fetch(env, version)    # weights from the Global Parameter Storage (timed as "fetch")
    ctx.load(env, state)               # build the model/engine on the device        (timed as "load")
    ... ctx.add(item) / ctx.step() / ctx.abort(ids) / ctx.progress() / ctx.flush() ...
    ctx.offload()                      # free weights and caches                      (timed as "offload")

Items come in as `WorkItem`s and leave as `ItemResult`s, `Partial`s, `StepSample`s and `GradResult`s
(`pivotrl.runtime.messages`): plain lists and numbers (never tensors), since a host may send them through
Dask comms, and typed, so a host in this process (`pivotrl.runtime.local_session.LocalSession`) and a
Dask role host run the same contexts. `GenerationContext` serves rollout (policy) and reward (GenRM
judge): both are token generation.
`TrainContext` computes GRPO gradient sums for micro-batches and hands its local sum to the GPS on `flush`.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from pivotrl.engines.device_memory import free_cuda_cache
from pivotrl.runtime.messages import GradResult, GradStats, ItemResult, Partial, StepSample, WorkItem


def available_host_bytes() -> int:
    """Host memory available now (what a level-1 vLLM sleep copies the weights into): MemAvailable, which
    counts reclaimable page cache, else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _build_model(spec: dict[str, Any], device: str, state: dict[str, torch.Tensor]) -> Any:
    """The model with `state` loaded, built without a random initialisation (most of a shift's load time
    for a small model on CPU would otherwise go to initialising weights that are overwritten at once)."""
    from pivotrl.engines.checkpoints import load_config
    from pivotrl.engines.model import CausalLM

    dtype = getattr(torch, spec.get("dtype", "float32"))
    config = load_config(spec["hf_dir"])
    try:
        model = CausalLM.empty(config, device=device, dtype=dtype)
        model.load_state_dict(state)
        return model
    except (AttributeError, RuntimeError, TypeError):
        model = CausalLM.from_config(config, device=device, dtype=dtype)
        model.load_state_dict(state)
        return model


class _Weights:
    """Fetch from GPS: the version a role needs, on this device."""

    version: int | None

    def __init__(self, role: str, spec: dict[str, Any]) -> None:
        self.role = role
        self.spec = spec
        self.version = spec.get("version")

    def fetch(self, env: Any, version: int | None) -> dict[str, torch.Tensor]:
        """Read-only tensors (`copy=False`: the device tier's own, when it has them): `load_state_dict`
        copies anyway, and a second copy of a version on the GPU is memory outside any engine's budget."""
        want = "latest" if version is None else int(version)
        sd = env.gps.fetch(self.spec["model"], want, device=self.fetch_device(env), copy=False)
        self.version = env.gps.latest(self.spec["model"]) if version is None else int(version)
        return sd

    def fetch_device(self, env: Any) -> str:
        return env.device


class GenerationContext(_Weights):
    """A continuous-batching engine on this device (rollout: the policy; reward: the GenRM judge)."""

    def __init__(self, role: str, spec: dict[str, Any]) -> None:
        super().__init__(role, spec)
        self.engine: Any = None
        self.max_batch = int(spec.get("max_batch", 64))
        self.live: set[str] = set()  # ids added and not yet finished or aborted
        self.vllm = self.spec.get("backend", "torch") == "vllm"
        self.device = "cpu"
        self.budget: Any = None  # vLLM: the `gpu_budget.Budget` it was started with
        self.weights_bytes = 0

    def fetch_device(self, env: Any) -> str:
        """vLLM reads pushed weights from host memory: fetching them onto the GPU first would hold a copy
        outside its budget while it starts."""
        return "cpu" if self.vllm else env.device

    def load(self, env: Any, state: dict[str, torch.Tensor]) -> None:
        kv = int(self.spec.get("kv_budget_tokens", 65536))
        self.device = str(env.device)
        if self.vllm:  # GPU: same interface over vLLM (lazy import)
            from pivotrl.engines.vllm_engine import VLLMEngine
            from pivotrl.runtime.vllm_budget import vllm_utilization

            self.weights_bytes = sum(t.numel() * t.element_size() for t in state.values())
            self.budget, util = vllm_utilization(self.spec, env, self.weights_bytes, kv, self.role)
            self.engine = VLLMEngine(
                self.spec["hf_dir"],
                kv_budget_tokens=kv,
                max_batch=self.max_batch,
                device=env.device,
                dtype=self.spec.get("dtype", "auto"),
                gpu_memory_utilization=util,
                enable_sleep_mode=bool(self.spec.get("sleep_mode", True)),
            )
            self.engine.load_state_dict(state)  # the GPS version, not whatever the directory holds
            return
        from pivotrl.engines.generation import GenerationEngine

        model = _build_model(self.spec, env.device, state)
        self.engine = GenerationEngine(
            model, kv_budget_tokens=kv, max_batch=self.max_batch, device=env.device
        )

    def set_version(self, env: Any, version: int) -> None:
        """Move this replica to another version of the same model (rollout following the policy)."""
        self.reload(env, self.fetch(env, version))

    def reload(self, env: Any, state: dict[str, torch.Tensor]) -> None:
        """New weights into the built engine (a parked context waking up at another version)."""
        self.engine.load_state_dict(state)

    def parkable(self) -> bool:
        """Can the built engine stay resident while the device serves another role? The torch engine on
        CPU (its memory is host memory anyway), not on a GPU (it would keep all of its GPU memory); vLLM
        when it can sleep at level 1, i.e. its weights fit the host memory free now (`park`)."""
        if self.engine is None:
            return False
        if not self.vllm:
            return self.device == "cpu"
        from pivotrl.engines.gpu_budget import host_allows_sleep

        return bool(self.spec.get("sleep_mode", True)) and host_allows_sleep(
            self.weights_bytes, available_host_bytes()
        )

    def park(self) -> None:
        """vLLM: sleep at level 1 (weights to host memory, KV cache released); the torch engine: nothing."""
        if self.vllm and self.engine is not None:
            self.engine.sleep(level=1)

    def unpark(self, env: Any) -> bool:
        if not (self.vllm and self.engine is not None):
            return False
        self.engine.wake_up()
        return True

    def offload(self) -> None:
        if self.engine is not None:
            self.engine.offload()
        self.engine = None
        free_cuda_cache()

    def add(self, item: WorkItem) -> None:
        from pivotrl.engines.requests import GenRequest, SamplingParams

        p = item.payload
        s = dict(p.get("sampling") or {})
        if "stop_ids" in s:
            s["stop_ids"] = tuple(s["stop_ids"])
        self.live.add(item.id)
        self.engine.add(
            GenRequest(
                seq_id=item.id,
                prompt_ids=list(p["prompt_ids"]),
                sampling=SamplingParams(**s),
                generated_ids=list(item.generated),
                logprobs=list(item.logprobs),
            )
        )

    def has_work(self) -> bool:
        return self.engine is not None and self.engine.has_work()

    def free_slots(self) -> int:
        if self.engine is None:
            return 0
        return max(0, self.max_batch - self.engine.num_running - self.engine.num_waiting)

    def step(self) -> tuple[list[ItemResult], StepSample | None]:
        before, prefilled = self._tokens(), self._prefilled()
        t0 = time.perf_counter()
        done = self.engine.step()
        dt = time.perf_counter() - t0
        tokens = self._tokens() - before
        prefill = self._prefilled() - prefilled
        self.live.difference_update(r.seq_id for r in done)
        out = [
            ItemResult(
                id=r.seq_id,
                generated=[int(t) for t in r.generated_ids],
                logprobs=[float(x) for x in r.logprobs],
                finish_reason=r.finish_reason,
            )
            for r in done
        ]
        # concurrency: one token per running sequence per decode step, so the step's tokens
        return out, (StepSample(tokens, dt, tokens, prefill) if tokens else None)

    def _tokens(self) -> int:
        n = getattr(self.engine, "tokens_generated", None)
        return int(n if n is not None else self.engine.stats().get("tokens_generated", 0))

    def _prefilled(self) -> int:
        """Prompt tokens the engine has prefilled (0 for an engine that does not count them)."""
        return int(getattr(self.engine, "prefill_tokens", 0))

    def abort(self, ids: list[str] | None) -> list[Partial]:
        if self.engine is None:
            return []
        ids = sorted(self.live) if ids is None else list(ids)
        self.live.difference_update(ids)
        return [
            Partial(r.seq_id, [int(t) for t in r.generated_ids], [float(x) for x in r.logprobs])
            for r in self.engine.abort(ids)
        ]

    def progress(self) -> dict[str, tuple[list[int], list[float]]]:
        """Tokens generated so far by running sequences, so a lost worker's work is not all lost
        (empty for an engine without `partials`, e.g. vLLM's, or none built)."""
        partials = getattr(self.engine, "partials", None)
        return partials() if partials is not None else {}

    def flush(self) -> GradResult | None:
        return None


class TrainContext(_Weights):
    """GRPO gradients for micro-batches of train items, summed locally until `flush`.

    Elastic: the sum of every replica's flushed sums equals the single-replica gradient (the trainer divides
    by the global token count once), so replicas may join or leave the train role at any moment; a replica
    leaving flushes first (its shift's abort phase)."""

    def __init__(self, role: str, spec: dict[str, Any]) -> None:
        super().__init__(role, spec)
        self.model: Any = None
        self.queue: list[WorkItem] = []
        self.sum: Any = None
        self.done: list[str] = []
        self.micro_batch = int(spec.get("micro_batch", 8))
        self.max_batch = int(spec.get("max_batch", 4 * self.micro_batch))
        self.kl_coef = float(spec.get("kl_coef", 0.0))
        self.ref_model: Any = None
        self.env: Any = None

    def load(self, env: Any, state: dict[str, torch.Tensor]) -> None:
        self.env = env
        self.model = _build_model(self.spec, env.device, state)
        if self.kl_coef > 0:  # the KL reference (an immutable GPS version) is part of this role's context
            ref_version = int(self.spec.get("ref_version", 0))
            ref_state = env.gps.fetch(self.spec["model"], ref_version, device=env.device)
            self.ref_model = _build_model(self.spec, env.device, ref_state).eval().requires_grad_(False)

    def set_version(self, env: Any, version: int) -> None:
        self.reload(env, self.fetch(env, version))

    def reload(self, env: Any, state: dict[str, torch.Tensor]) -> None:
        if self.sum is not None:
            raise RuntimeError("train replica asked to change version with an unflushed gradient sum")
        self.model.load_state_dict(state)

    def parkable(self) -> bool:
        """Nothing unflushed, and on CPU: on a GPU a parked trainer would hold its GPU memory."""
        on_cpu = self.env is None or str(self.env.device) == "cpu"
        return self.model is not None and self.sum is None and not self.queue and on_cpu

    def offload(self) -> None:
        self.model = self.ref_model = None
        if self.spec.get("hand_over") and self.env is not None:  # no rank will take it here now
            from pivotrl.runtime.handover import drop

            drop(self._sum_name())
        free_cuda_cache()  # the next role (vLLM above all) sees driver-free memory, not the cache

    def add(self, item: WorkItem) -> None:
        self.queue.append(item)

    def has_work(self) -> bool:
        return bool(self.queue)

    def free_slots(self) -> int:
        return max(0, self.max_batch - len(self.queue))

    def step(self) -> tuple[list[ItemResult], StepSample | None]:
        from pivotrl.engines.grpo_loss import LossConfig, TrainSample, compute_grad_sum

        batch, self.queue = self.queue[: self.micro_batch], self.queue[self.micro_batch :]
        samples = []
        for item in batch:
            p = item.payload
            samples.append(
                TrainSample(
                    prompt_ids=list(p["prompt_ids"]),
                    response_ids=list(p["response_ids"]),
                    advantage=float(p["advantage"]),
                    old_logprobs=list(p["logprobs"]) if p.get("logprobs") else None,
                )
            )
        t0 = time.perf_counter()
        loss = LossConfig(
            clip_eps=float(self.spec.get("clip_eps", 0.2)),
            kl_coef=self.kl_coef,
            temperature=float(self.spec.get("temperature", 1.0)),
        )
        gs = compute_grad_sum(
            self.model,
            samples,
            pad_id=int(self.spec.get("pad_id", 0)),
            micro_batch=self.micro_batch,
            loss=loss,
            ref_model=self.ref_model,
            version=int(self.version or 0),
        )
        self.sum = gs if self.sum is None else self.sum + gs
        self.done.extend(i.id for i in batch)
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        return [ItemResult(i.id) for i in batch], StepSample(len(batch), time.perf_counter() - t0, tokens)

    def abort(self, ids: list[str] | None) -> list[Partial]:
        back = [i for i in self.queue if ids is None or i.id in ids]
        self.queue = [i for i in self.queue if i not in back]
        return [Partial(i.id) for i in back]

    def progress(self) -> dict[str, tuple[list[int], list[float]]]:
        return {}

    def _sum_name(self) -> str:
        return f"{self.spec.get('grad_prefix', 'grad')}-w{self.env.name}"

    def flush(self) -> GradResult | None:
        """Hand in the local gradient sum's ref: persisted to the GPS first (the driver owns the optimizer),
        or kept in memory for the sharded owner's rank here, and written to the GPS only if another process
        needs it (`pivotrl.runtime.handover`). Only this device writes under its name."""
        from pivotrl.runtime.handover import flush_sum

        if self.sum is None:
            return None
        gs, items = self.sum, list(self.done)
        name = self._sum_name()
        version = flush_sum(self.env.gps, name, gs, hand_over=bool(self.spec.get("hand_over")))
        self.sum, self.done = None, []
        stats = GradStats.of(gs)
        return GradResult(model=name, version=version, items=items, stats=stats)
