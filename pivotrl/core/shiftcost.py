"""How long a shift takes, per (from_role, to_role), learned from the phase timings drivers report.

A shift is abort → offload → fetch weights (from the nearest GPS tier) → load → join; the driver times each
phase and reports them in `Controller.on_shift_done`. We keep an exponentially weighted mean of the total per
pair (and of each phase, for the log and dashboard). A pair never measured borrows the mean of its target
role (fetch + load dominate and depend on the model being loaded), then the configured prior. A first
placement (from no role) teaches only its own pair: it has nothing to abort or offload, and the simulator's
free placements at t = 0 report no time at all, which made every later shift into that role look free.

Fetch time depends on the device, not only on the pair: a device whose node (or own device tier) already
holds a role's weights fetches them in a fraction of the time of one that pulls them across the network.
With `locality` set (`pivotrl.core.locality.Locality`), `fetch_delta` says how much longer (or shorter) one
device's fetch is predicted to take than the role's measured mean, and the planner adds it to that donor's
shift duration, so φ prefers devices that already hold the weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from pivotrl.core.types import Role, ShiftTimings

if TYPE_CHECKING:
    from pivotrl.core.locality import Locality


class ShiftCostModel:
    def __init__(self, prior_s: float = 5.0, alpha: float = 0.3) -> None:
        if prior_s < 0 or not 0 < alpha <= 1:
            raise ValueError("shift cost prior must be >= 0 and alpha in (0, 1]")
        self.prior_s = float(prior_s)
        self.alpha = float(alpha)
        self._pair: dict[tuple[Role | None, Role], float] = {}
        self._to: dict[Role, float] = {}
        self.phases: dict[tuple[Role | None, Role], dict[str, float]] = {}
        self.samples: dict[tuple[Role | None, Role], int] = {}
        self.locality: Locality | None = None

    def observe(self, from_role: Role | None, to_role: Role, timings: ShiftTimings) -> float:
        """Record one measured shift; returns its duration (the sum of its phases)."""
        if not isinstance(timings, ShiftTimings):
            raise TypeError(f"shift timings must be a ShiftTimings, got {type(timings).__name__}")
        total = timings.total
        key = (from_role, to_role)
        a = self.alpha
        self._pair[key] = total if key not in self._pair else (1 - a) * self._pair[key] + a * total
        if from_role is not None:  # a first placement is no shift: it says nothing of leaving a role
            self._to[to_role] = total if to_role not in self._to else (1 - a) * self._to[to_role] + a * total
        ph = self.phases.setdefault(key, {})
        for name, v in timings.phases().items():
            ph[name] = v if name not in ph else (1 - a) * ph[name] + a * v
        self.samples[key] = self.samples.get(key, 0) + 1
        return total

    def averages(self) -> tuple[dict[tuple[Role | None, Role], float], dict[Role, float]]:
        """The running averages per (from, to) pair and per destination (copies), for a checkpoint."""
        return dict(self._pair), dict(self._to)

    def restore_pair(
        self, key: tuple[Role | None, Role], seconds: float, samples: int, phases: dict[str, float]
    ) -> None:
        """Put back one pair's average, sample count and phase averages from a checkpoint."""
        self._pair[key], self.samples[key], self.phases[key] = float(seconds), int(samples), dict(phases)

    def restore_destination(self, to_role: Role, seconds: float) -> None:
        """Put back the average shift into `to_role` (from any role) from a checkpoint."""
        self._to[to_role] = float(seconds)

    def duration(self, from_role: Role | None, to_role: Role) -> float:
        """Expected seconds a device is unproductive when moving from `from_role` to `to_role`."""
        got = self._pair.get((from_role, to_role))
        if got is not None:
            return got
        got = self._to.get(to_role)
        return self.prior_s if got is None else got

    def measured_fetch_s(self, to_role: Role) -> float | None:
        """The mean fetch phase of measured shifts into `to_role` (any source role); None if none."""
        vals = [ph["fetch"] for (_, t), ph in self.phases.items() if t == to_role and "fetch" in ph]
        return sum(vals) / len(vals) if vals else None

    def fetch_delta(self, devices: Iterable[str], to_role: Role) -> float:
        """Seconds a shift of these devices into `to_role` takes beyond `duration` because of where the
        weights are: the slowest device's predicted fetch minus the role's mean (measured, else predicted).
        0 without a locality model or when nothing is known about the role's weights."""
        if self.locality is None:
            return 0.0
        preds = [self.locality.fetch_s(d, to_role) for d in devices]
        if not preds or any(p is None for p in preds):
            return 0.0
        base = self.measured_fetch_s(to_role)
        if base is None:
            base = self.locality.mean_fetch_s(to_role) or 0.0
        return max(p for p in preds if p is not None) - base
