"""The seam between the simulator (mechanism) and the controller (policy).

The simulator talks to exactly one object through this small protocol — events in, decisions out, time
passed in — the same shape as `pivotrl.core`'s Controller that the Dask scheduler plugin drives. When
`pivotrl.core` provides its Controller, `make_controller` wraps it (`sim/core_adapter.py`); until then (or
with ``--controller standin``) it uses `sim/standin.py`, a reference implementation of DESIGN.md §4 kept
only so the simulator runs end to end. Switching is this one function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pivotrl.sim.config import SimConfig


@dataclass(slots=True)
class WorkItem:
    """What the controller sees of a unit of work: never the true remaining length."""

    item_id: str
    role: str
    prompt_tokens: int  # context to prefill (reward: task prompt + response + judge template)
    generated: int = 0  # tokens already generated (a resumed, aborted sequence)
    group_id: str = ""
    iteration: int = 0
    train_tokens: int = 0  # train items: tokens to run forward/backward on


@dataclass(slots=True)
class ReplicaView:
    replica_id: str
    role: str
    devices: tuple[int, ...]
    max_batch: int
    kv_tokens: int


@dataclass(slots=True)
class Shift:
    replica_id: str
    to_role: str


@dataclass(slots=True)
class Decision:
    decision_id: int
    shifts: list[Shift]
    reason: str = ""
    expected_gain: float = 0.0
    penalty: float = 0.0
    extra: dict = field(default_factory=dict)


class Controller(Protocol):
    def add_replica(self, view: ReplicaView, now: float) -> None: ...
    def remove_replica(self, replica_id: str, now: float) -> None: ...
    def submit(self, items: list[WorkItem], now: float) -> None: ...
    def on_finished(self, replica_id: str, item_id: str, tokens: int, now: float) -> None: ...
    def on_aborted(self, replica_id: str, items: list[WorkItem], now: float) -> None: ...
    def on_step(self, replica_id: str, concurrency: int, step_time_s: float, now: float) -> None: ...
    def on_progress(self, replica_id: str, generated_tokens: int, now: float) -> None: ...
    def on_shift_done(self, replica_id: str, role: str, phases: dict[str, float], now: float) -> None: ...
    def dispatch(self, now: float) -> list[tuple[str, str]]: ...
    def tick(self, now: float) -> Decision | None: ...
    def initial_allocation(self, devices: int) -> dict[str, int]: ...


CONTROLLERS = ("auto", "core", "standin")


def core_available() -> bool:
    try:
        from pivotrl.sim import core_adapter

        return core_adapter.available()
    except ImportError:
        return False


def make_controller(
    cfg: SimConfig, mode: str, split: dict[str, int] | None = None, which: str = "auto"
) -> Controller:
    """The controller for `mode` (colocated | disaggregated | shiftable): core's when available."""
    if which == "core" or (which == "auto" and core_available()):
        from pivotrl.sim.core_adapter import CoreController

        return CoreController(cfg, mode, split)
    from pivotrl.sim.standin import StandinController

    return StandinController(cfg, mode, split)
