"""`CoreControl`: pivotrl.core's Controller behind the runtime's `Control` protocol.

Core thinks in replicas; the runtime in Dask workers (devices). On CPU every replica is one device, so the
adapter keeps a replica ↔ device map, translates core's `Decision` (aborts per replica, dissolved replicas,
new replicas, dispatch) into device-level commands, and feeds worker events back as core events.
Multi-device replicas (tensor-parallel engines) are not supported by the runtime yet: config rejects them.
"""

from __future__ import annotations

import contextlib
from typing import Any

from pivotrl.runtime.control import Decision


class CoreControl:
    def __init__(
        self,
        mode: str,
        *,
        role_specs: dict[str, dict[str, Any]],
        horizon_s: float = 10.0,
        hysteresis: float = 0.05,
        cooldown_s: float = 2.0,
        static_split: dict[str, int] | None = None,
        initial_split: dict[str, int] | None = None,
        shift_prior_s: float = 1.0,
    ) -> None:
        from pivotrl.core import Controller, ControllerConfig, Role, RoleSpec, make_policy

        roles = {Role(r): RoleSpec(devices_per_replica=1, **spec) for r, spec in role_specs.items()}
        config = ControllerConfig(
            roles=roles,
            horizon_s=horizon_s,
            hysteresis=hysteresis,
            cooldown_s=cooldown_s,
            shift_prior_s=shift_prior_s,
        )
        policy = make_policy(mode, static_split=static_split, initial_split=initial_split)
        self.mode = mode
        self.ctl = Controller(policy, config=config)
        self.dev_of_rep: dict[str, str] = {}
        self.rep_of_dev: dict[str, str] = {}

    # -- events ---------------------------------------------------------------------------------------
    def add_device(self, dev: str, now: float) -> str | None:
        self.ctl.add_device(dev, now)
        return None  # core places free devices on its next tick

    def remove_device(self, dev: str, now: float) -> None:
        self.ctl.on_device_lost(dev, now)
        rid = self.rep_of_dev.pop(dev, None)
        if rid is not None:
            self.dev_of_rep.pop(rid, None)

    def begin_iteration(self, plan: dict[str, Any], now: float) -> None:
        from pivotrl.core import IterationPlan

        self.ctl.begin_iteration(IterationPlan(**plan), now)

    def submit(self, item: Any, now: float) -> None:
        from pivotrl.core import Role, Sequence

        if item.role == "train":  # a train item is "generation" of its token count (see docs/core-api.md)
            seq = Sequence(
                item.id,
                Role.TRAIN,
                prompt_tokens=0,
                max_new_tokens=max(1, item.est_tokens),
                iteration=item.iteration,
                group_id=item.group_id,
            )
        else:
            seq = Sequence(
                item.id,
                Role(item.role),
                prompt_tokens=item.prompt_tokens,
                max_new_tokens=max(1, item.max_new_tokens),
                generated=len(item.generated),
                expected_new_tokens=float(item.est_tokens) if item.est_tokens else None,
                iteration=item.iteration,
                group_id=item.group_id,
            )
        self.ctl.submit([seq], now)

    def requeue(self, item_id: str, generated: int, now: float) -> None:
        # core already re-queued it (it decided the abort, or saw the device die); only progress is news
        self.ctl.on_progress(item_id, generated, now)

    def on_progress(self, item_id: str, generated: int, now: float) -> None:
        self.ctl.on_progress(item_id, generated, now)

    def on_finished(self, item_id: str, generated: int, now: float) -> None:
        with contextlib.suppress(KeyError):  # a late duplicate
            self.ctl.on_finished(item_id, now, generated=generated)

    def on_step(self, dev: str, concurrency: int, step_time_s: float, tokens: int, now: float) -> None:
        rid = self.rep_of_dev.get(dev)
        if rid is not None:
            self.ctl.on_step(rid, concurrency, step_time_s, now, tokens=tokens)

    def on_shift_started(self, dev: str, role: str | None, now: float) -> None:
        return None

    def on_shift_done(
        self, dev: str, role: str | None, timings: dict[str, float], now: float
    ) -> Decision | None:
        rid = self.rep_of_dev.get(dev)
        if rid is None or role is None:
            return None
        from pivotrl.core.types import ShiftTimings

        phases = {k: float(timings[k]) for k in ShiftTimings.PHASES if k in timings}  # "total" is derived
        try:
            dec = self.ctl.on_shift_done(rid, now, ShiftTimings(**phases, warm=bool(timings.get("warm"))))
        except KeyError:
            return None  # superseded by a later decision
        return self._convert(dec)

    # -- decisions ------------------------------------------------------------------------------------
    def dispatch(self, now: float, free: dict[str, int]) -> list[tuple[str, str]]:
        return [
            (a.seq_id, self.dev_of_rep[a.replica_id])
            for a in self.ctl.dispatch(now)
            if a.replica_id in self.dev_of_rep
        ]

    def tick(self, now: float) -> Decision | None:
        dec = self.ctl.tick(now)
        return None if dec is None else self._convert(dec)

    def _convert(self, dec: Any) -> Decision:
        freed: list[str] = []
        for rid in dec.dissolved:
            dev = self.dev_of_rep.pop(rid, None)
            if dev is not None:
                self.rep_of_dev.pop(dev, None)
                freed.append(dev)
        shifts: list[tuple[str, str | None]] = []
        for s in dec.shifts:
            for dev in s.devices:
                old = self.rep_of_dev.get(dev)
                if old is not None:
                    self.dev_of_rep.pop(old, None)
                self.rep_of_dev[dev] = s.replica_id
                self.dev_of_rep[s.replica_id] = dev
                shifts.append((dev, str(s.to_role)))
        moving = {d for d, _ in shifts}
        shifts += [(d, None) for d in freed if d not in moving]
        aborts = [sid for ids in dec.aborts.values() for sid in ids]
        dispatch = [
            (a.seq_id, self.dev_of_rep[a.replica_id]) for a in dec.dispatch if a.replica_id in self.dev_of_rep
        ]
        reasoning: dict[str, Any] = {"stimulus": dec.stimulus, "kind": dec.kind}
        if dec.reasoning is not None:
            reasoning.update(dec.reasoning.as_dict())
        return Decision(
            id=f"core-{dec.decision_id}", aborts=aborts, shifts=shifts, dispatch=dispatch, reasoning=reasoning
        )

    def snapshot(self) -> dict[str, Any]:
        snap = self.ctl.snapshot()
        if self.ctl.last_reasoning is not None:
            r = self.ctl.last_reasoning
            snap["tau"] = dict(r.tau)
            snap["shift_up_role"] = r.shift_up_role
        return snap
