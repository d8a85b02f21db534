"""Small role contexts for runtime mechanism tests: real (tiny) torch work, deterministic tokens.

`CountingGen` "generates" token i of sequence s as a hash of (s, i), so a sequence aborted on one worker and
resumed on another must end identical to an uninterrupted one — which the tests check. Each step does a
small matmul so steps take real time. `SumTrain` accumulates a number per item and reports it at flush (as
the gradient sum's `loss_sum`), so the tests can prove each train item lands in exactly one sum. Both speak
the typed `RoleContext` interface (`WorkItem` in; `ItemResult`, `StepSample`, `Partial`, `GradResult` out).
"""

from __future__ import annotations

import os
import time
import zlib
from typing import Any

import torch

from pivotrl.runtime.messages import GradResult, GradStats, ItemResult, Partial, StepSample, WorkItem


def token(seq_id: str, index: int) -> int:
    return zlib.crc32(f"{seq_id}:{index}".encode()) % 97


class CountingGen:
    def __init__(self, role: str, spec: dict[str, Any]) -> None:
        self.role = role
        self.spec = spec
        self.version = spec.get("version")
        self.max_batch = int(spec.get("max_batch", 8))
        self.step_s = float(spec.get("step_s", 0.01))
        self.running: dict[str, dict[str, Any]] = {}
        self.w: torch.Tensor | None = None

    def fetch(self, env: Any, version: int | None) -> Any:
        return torch.randn(64, 64, generator=torch.Generator().manual_seed(int(version or 0)))

    def load(self, env: Any, state: Any) -> None:
        self.w = state.clone()
        delay = float(self.spec.get("load_s", 0.0))
        if delay:
            time.sleep(delay)  # stands in for a big model's load in shift-ordering tests only

    def set_version(self, env: Any, version: int) -> None:
        self.version = version
        self.load(env, self.fetch(env, version))

    def offload(self) -> None:
        self.w = None

    def add(self, item: WorkItem) -> None:
        self.running[item.id] = {"item": item, "gen": list(item.generated), "lp": list(item.logprobs)}

    def has_work(self) -> bool:
        return bool(self.running)

    def free_slots(self) -> int:
        return self.max_batch - len(self.running)

    def step(self) -> tuple[list[ItemResult], StepSample]:
        t0 = time.perf_counter()
        assert self.w is not None
        x = self.w
        end = t0 + self.step_s
        while time.perf_counter() < end:  # real work, sized in time so tests stay fast and stable
            x = torch.tanh(x @ self.w)
        finished = []
        n = len(self.running)
        for sid, st in list(self.running.items()):
            st["gen"].append(token(sid, len(st["gen"])))
            st["lp"].append(-0.5)
            if len(st["gen"]) >= int(st["item"].payload["target_len"]):
                del self.running[sid]
                finished.append(ItemResult(sid, st["gen"], st["lp"], "length"))
        return finished, StepSample(n, time.perf_counter() - t0, n)

    def abort(self, ids: list[str] | None) -> list[Partial]:
        out = []
        for sid in list(self.running) if ids is None else ids:
            st = self.running.pop(sid, None)
            if st is not None:
                out.append(Partial(sid, st["gen"], st["lp"]))
        return out

    def progress(self) -> dict[str, tuple[list[int], list[float]]]:
        return {sid: (st["gen"], st["lp"]) for sid, st in self.running.items()}

    def flush(self) -> GradResult | None:
        return None


class SumTrain(CountingGen):
    """Train replica stand-in: one step consumes up to `max_batch` items into a local sum."""

    _flushes = 0

    def __init__(self, role: str, spec: dict[str, Any]) -> None:
        super().__init__(role, spec)
        self.queue: list[WorkItem] = []
        self.total = 0.0
        self.done: list[str] = []

    def add(self, item: WorkItem) -> None:
        self.queue.append(item)

    def has_work(self) -> bool:
        return bool(self.queue)

    def free_slots(self) -> int:
        return self.max_batch - len(self.queue)

    def step(self) -> tuple[list[ItemResult], StepSample]:
        t0 = time.perf_counter()
        batch, self.queue = self.queue[: self.max_batch], self.queue[self.max_batch :]
        end = t0 + self.step_s
        x = self.w
        while time.perf_counter() < end:
            x = torch.tanh(x @ self.w)
        for item in batch:
            self.total += float(item.payload["x"])
            self.done.append(item.id)
        return [ItemResult(i.id) for i in batch], StepSample(len(batch), time.perf_counter() - t0, len(batch))

    def abort(self, ids: list[str] | None) -> list[Partial]:
        back = [i for i in self.queue if ids is None or i.id in ids]
        self.queue = [i for i in self.queue if i not in back]
        return [Partial(i.id) for i in back]

    def flush(self) -> GradResult | None:
        if not self.done:
            return None
        SumTrain._flushes += 1
        stats = GradStats(tokens=len(self.done), samples=len(self.done), version=0, loss_sum=self.total)
        out = GradResult(f"sum-{os.getpid()}", SumTrain._flushes, list(self.done), stats)
        self.total, self.done = 0.0, []
        return out

    def progress(self) -> dict[str, tuple[list[int], list[float]]]:
        return {}
