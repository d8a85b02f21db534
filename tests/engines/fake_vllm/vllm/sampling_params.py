"""The fake's `vllm.sampling_params`: the real field names (unknown ones raise TypeError)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError("output_kind must be a RequestOutputKind")
        if self.output_kind is not RequestOutputKind.DELTA:
            raise NotImplementedError("the fake streams DELTA outputs only (what pivotrl asks for)")
