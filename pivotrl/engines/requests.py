"""The request interface every generation engine serves (torch's `GenerationEngine`, vLLM's
`VLLMEngine`): what a sequence asks for, what comes back, and the queue bookkeeping both share.

Why a module of its own: the runtime and the vLLM backend speak only these types, so they need not import
the CPU engine (its kernels, KV cache and packed weights) to talk to an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pivotrl.engines.checkpoints import EOS_ID

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. `max_new_tokens` counts every generated token, resumed ones included."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_ids: tuple[int, ...] = (EOS_ID,)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class GenRequest:
    """A sequence to generate. Non-empty `generated_ids` (with their `logprobs`) resume a partial one."""

    seq_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generated_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class GenResult:
    seq_id: str
    prompt_ids: list[int]
    generated_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason

    def as_request(self, sampling: SamplingParams) -> GenRequest:
        """The request that resumes this (partial) result."""
        return GenRequest(
            self.seq_id, list(self.prompt_ids), sampling, list(self.generated_ids), list(self.logprobs)
        )


class RequestBook:
    """Queue bookkeeping shared by every engine behind this interface (torch here, vLLM in
    `vllm_engine.py`): both keep `running`, `waiting`, finished-but-unreported `_ready` and `max_seq_len`."""

    running: Any
    waiting: Any
    _ready: list
    max_seq_len: int

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self._ready)

    def reservation(self, req: GenRequest) -> int:
        """KV tokens admission reserves for `req`: everything it could ever cache."""
        return min(len(req.prompt_ids) + req.sampling.max_new_tokens, self.max_seq_len)

    def _take_queued(self, wanted: set[str]) -> list[GenResult]:
        """Remove the wanted sequences that are not running (waiting, or finished but unreported) and
        return them as they stand: the part of `abort` that needs no engine."""
        out: list[GenResult] = []
        for req in [w for w in self.waiting if w.seq_id in wanted]:
            self.waiting.remove(req)
            out.append(
                GenResult(
                    req.seq_id, list(req.prompt_ids), list(req.generated_ids), list(req.logprobs), "abort"
                )
            )
        for res in [r for r in self._ready if r.seq_id in wanted]:
            self._ready.remove(res)
            out.append(res)
        return out

    def add(self, req: GenRequest) -> None:
        raise NotImplementedError

    def step(self) -> list[GenResult]:
        raise NotImplementedError

    def generate(self, reqs: list[GenRequest]) -> list[GenResult]:
        """Run `reqs` to completion (with whatever else is queued); results in the order of `reqs`."""
        for r in reqs:
            self.add(r)
        ids = {r.seq_id for r in reqs}
        got: dict[str, GenResult] = {}
        while len(got) < len(ids) and self.has_work():
            for res in self.step():
                if res.seq_id in ids:
                    got[res.seq_id] = res
        return [got[r.seq_id] for r in reqs]
