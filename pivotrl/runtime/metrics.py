"""Per-iteration metrics of a run, the live progress line, and the xarray → Zarr record.

What is measured: reward and verifier accuracy of the iteration's samples, tokens processed (rollout and
judge tokens generated, train tokens) per second of wall time and per device, the share of device-time
each role held, the role shifts with the time of each phase (abort, offload, fetch, load). The controller's
timeline (role of each device, queue depths, tokens) is saved alongside for replay and the dashboard.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

PHASES = ("abort", "offload", "fetch", "load", "total")  # the shift phases shown, and their sum


def shift_phase(event: dict[str, Any], phase: str, default: float = 0.0) -> float:
    """One phase of a `shift_done` event, or its total (derived by the scheduler, never a phase)."""
    if phase == "total":
        return float(event.get("total", default))
    return float(event["timings"].get(phase, default))
ROLE_CODES: dict[str | None, int] = {None: -1, "rollout": 0, "reward": 1, "train": 2, "shifting": 3}
ROLES = ("rollout", "reward", "train")


DEVICE_TIME_KEYS = ("rollout", "reward", "train", "flush", "shifting", "sync", "idle")


def device_times(state: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Cumulative device time per device name from a `pivotrl_state` snapshot: engine-step seconds per
    role, gradient-flush seconds, shifting seconds, and the scheduler clock."""
    out = {}
    for w in state["workers"].values():
        d = {k: float(v) for k, v in (w.get("busy") or {}).items()}
        d["shifting"] = float(w.get("shifting_s", 0.0))
        d["sync"] = float(w.get("sync_s", 0.0))
        d["t"] = float(state["t"])
        out[str(w["name"])] = d
    return out


def device_time_delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Where each device's wall time went between two snapshots: busy per role, flush, shifting, idle
    (the rest: holding a role with nothing to step, or waiting for a command)."""
    out = {}
    for name, a in after.items():
        b = before.get(name, {})
        wall = a["t"] - b.get("t", a["t"])
        d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in DEVICE_TIME_KEYS if k != "idle"}
        d["idle"] = max(0.0, wall - sum(d.values()))
        d["wall"] = wall
        out[name] = {k: round(v, 4) for k, v in d.items()}
    return out


def barrier_before(state: dict[str, Any], iteration: int) -> float | None:
    """Seconds from the previous iteration's last train item finishing to this one's first request reaching
    the scheduler (its `iteration_edges`): the whole barrier as the runtime runs it. None where the previous
    iteration is unknown or still trained after this one began (bounded staleness overlaps them)."""
    edges = state.get("iteration_edges", {})
    this, prev = edges.get(str(iteration), {}), edges.get(str(iteration - 1), {})
    start, done = this.get("first_submit"), prev.get("last_train_done")
    if start is None or done is None or start < done:
        return None
    return float(start) - float(done)


class IterationMeter:
    def __init__(self, session: Any, log: Callable[[str], None]) -> None:
        self.session = session
        self.log = log
        self.prev: dict[str, float] = {}
        self.alloc: dict[str, float] = {}
        self.shifts: list[dict[str, Any]] = []
        self._t_poll = 0.0
        self._roles_now: dict[str, str | None] = {}
        self.n_devices = 0
        self._cpu_prev = time.process_time()

    # -- planning hints ---------------------------------------------------------------------------------
    def iteration_plan(self, it: int, samples: list[Any], cfg: Any) -> Any:
        """core's `IterationPlan`: the iteration's work per role, expected from the last iteration's
        lengths (the budgets' halves before any was measured); the run's last iteration says so."""
        from pivotrl.core import IterationPlan

        g = cfg.task.group_size
        resp = self.prev.get("response_tokens_mean") or cfg.rollout.sampling.max_new_tokens / 2
        judge = self.prev.get("judge_tokens_mean") or cfg.reward.sampling.max_new_tokens / 2
        prompt = sum(len(s.prompt_ids) for s in samples) / max(1, len(samples))
        return IterationPlan(iteration=it, rollout_seqs=len(samples), group_size=g,
                             rollout_tokens_per_seq=float(resp), reward_tokens_per_rollout=float(judge),
                             train_tokens_per_group=float(g * (prompt + resp)),
                             last_iteration=it == cfg.run.iterations - 1)

    # -- live -------------------------------------------------------------------------------------------
    def start(self, it: int) -> None:
        self.it = it
        self.t0 = time.monotonic()
        self._t_poll = self.t0
        self.alloc = {}
        self.shifts = []
        st = self.session.state()
        self.tokens0 = dict(st["tokens"])
        self._roles_now = {
            w["name"]: (w["role"] if w["status"] == "ready" else "shifting") for w in st["workers"].values()
        }
        self.n_devices = len(st["workers"])
        self.device_time0 = device_times(st)
        self.plan0 = (st.get("plan_s", 0.0), st.get("plans", 0))

    def poll(self, out: Any) -> None:
        """Called with each `collect` reply (a `Collected`) while an iteration runs."""
        state, events = out.state, out.events
        now = time.monotonic()
        dt = now - self._t_poll
        self._t_poll = now
        for role in self._roles_now.values():  # device-time per role since the last poll
            key = role or "idle"
            self.alloc[key] = self.alloc.get(key, 0.0) + dt
        self._roles_now = {
            w["name"]: (w["role"] if w["status"] == "ready" else "shifting")
            for w in state["workers"].values()
        }
        self.n_devices = max(self.n_devices, len(state["workers"]))
        self.last_state = state
        for e in events or ():
            if e["kind"] == "shift_done" and e.get("src") is not None:
                self.shifts.append(e)
                t = e["timings"]
                self.log(
                    f"  shift: device {e['name']} {e['src']} → {e['role']}  "
                    f"(abort {t.get('abort', 0):.2f}s, offload {t.get('offload', 0):.2f}s, "
                    f"fetch {t.get('fetch', 0):.2f}s, load {t.get('load', 0):.2f}s, "
                    f"total {e.get('total', 0):.2f}s{', warm' if e.get('warm') else ''})"
                )
            elif e["kind"] == "worker_lost":
                self.log(
                    f"  device {e['name']} lost; {e['requeued']} items re-queued "
                    f"({e['kept_tokens']} generated tokens kept)"
                )

    def finish(self, res: Any, train_stats: dict[str, Any], version: int) -> dict[str, Any]:
        seconds = time.monotonic() - self.t0
        st = self.session.state()
        tokens = {r: st["tokens"].get(r, 0) - self.tokens0.get(r, 0) for r in ROLES}
        samples = res.samples
        rewards = [s.reward for s in samples if s.reward is not None]
        total_alloc = sum(self.alloc.values()) or 1.0
        row: dict[str, Any] = {
            "iteration": res.iteration,
            "version": version,
            "seconds": seconds,
            "reward_mean": sum(rewards) / max(1, len(rewards)),
            "accuracy": 100.0 * sum(bool(s.data.get("correct")) for s in samples) / max(1, len(samples)),
            "response_tokens_mean": sum(len(s.response_ids) for s in samples) / max(1, len(samples)),
            "judge_tokens_mean": sum(s.data.get("judge_tokens", 0) for s in samples) / max(1, len(samples)),
            "tokens_rollout": tokens["rollout"],
            "tokens_reward": tokens["reward"],
            "tokens_train": tokens["train"],
            "tokens_per_s": sum(tokens.values()) / seconds if seconds > 0 else 0.0,
            "devices": self.n_devices,
            "shifts": len(self.shifts),
        }
        row["tokens_per_s_per_device"] = row["tokens_per_s"] / max(1, self.n_devices)
        judged = [s for s in samples if "judge_parsed" in s.data]
        row["judged"] = len(judged)
        row["judge_unparsed"] = sum(not s.data["judge_parsed"] for s in judged)
        # the judge's verdict (reward >= 0.5) against the verifier's, where both exist (measurement only)
        both = [s for s in judged if s.data["judge_parsed"] and "correct" in s.data]
        if both:
            agree = sum((float(s.reward or 0.0) >= 0.5) == bool(s.data["correct"]) for s in both)
            row["judge_agreement"] = 100.0 * agree / len(both)
        # what a simulator profile of this run needs (benchmarks.fidelity): every sample's lengths and core's
        # fitted step-time line per role (JSON summary only: not scalars)
        row["lengths"] = {
            "prompt": [len(s.prompt_ids) for s in samples],
            "response": [len(s.response_ids) for s in samples],
            "judge_prompt": [int(s.data.get("judge_prompt_tokens", 0)) for s in samples],
            "judge": [int(s.data.get("judge_tokens", 0)) for s in samples],
        }
        if "step_fits" in st.get("control", {}):
            row["step_fits"] = st["control"]["step_fits"]
        if "step_totals" in st.get("control", {}):  # cumulative: a window's are two rows' difference
            row["step_totals"] = st["control"]["step_totals"]
        per_dev = device_time_delta(self.device_time0, device_times(st))
        row["device_time"] = per_dev
        row["plan_s"] = st.get("plan_s", 0.0) - self.plan0[0]  # controller CPU time (scheduler process)
        row["plans"] = st.get("plans", 0) - self.plan0[1]
        # this process's CPU seconds since the previous completion: the driver, and the scheduler where it
        # runs in the driver's process (a local cluster), on the cores a CPU cluster's devices share
        cpu = time.process_time()
        row["driver_cpu_s"], self._cpu_prev = cpu - self._cpu_prev, cpu
        for key in DEVICE_TIME_KEYS:
            row[f"dev_{key}_s"] = sum(d.get(key, 0.0) for d in per_dev.values())
        for key in (*ROLES, "shifting", "idle"):
            row[f"alloc_{key}"] = self.alloc.get(key, 0.0) / total_alloc
        for ph in PHASES:
            vals = [shift_phase(e, ph) for e in self.shifts]
            row[f"shift_{ph}_s"] = sum(vals) / len(vals) if vals else math.nan
        for key in ("loss", "grad_norm", "skipped", "replica_sums", "clip_frac", "steps", "apply_s"):
            if key in train_stats:
                row[f"train_{key}"] = float(train_stats[key])
        for stage, t in res.stage_seconds.items():
            row[f"stage_{stage}_done_s"] = t
        gap = barrier_before(st, res.iteration)
        if gap is not None:
            row["barrier_before_s"] = gap
        self.prev = row
        return row

    @staticmethod
    def allocation(row: dict[str, Any]) -> str:
        parts = [
            f"{r[:2]} {row[f'alloc_{r}'] * 100:.0f}%" for r in (*ROLES, "shifting") if row[f"alloc_{r}"] > 0
        ]
        return "/".join(parts)

    def postfix(self, row: dict[str, Any]) -> str:
        epochs = f"epoch {row['epochs']:.3f} " if "epochs" in row else ""  # a dataset's, drawn so far
        agree = f"judge~verifier {row['judge_agreement']:.0f}% " if "judge_agreement" in row else ""
        return (
            f"{epochs}reward {row['reward_mean']:.2f} acc {row['accuracy']:.0f}% {agree}"
            f"{row['tokens_per_s']:.0f} tok/s roles[{self.allocation(row)}] shifts {row['shifts']}"
        )

    def line(self, row: dict[str, Any]) -> str:
        return f"iteration {row['iteration']}: {self.postfix(row)} ({row['seconds']:.1f}s)"


IN_MEMORY_ONLY = ("lengths",)  # per-sample lists: O(samples) per row, for in-process analysis only


def persisted(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row as written to summaries and checkpoints: without the per-sample lists (at 8k samples
    an iteration, 200 iterations of them would be tens of MB, rewritten by every checkpoint)."""
    return {k: v for k, v in row.items() if k not in IN_MEMORY_ONLY}


def write_metrics(result: Any, path: Path) -> Path:
    """Iterations, shifts and the controller timeline as one xarray Dataset in Zarr (+ a JSON summary)."""
    import numpy as np
    import xarray as xr

    data_vars: dict[str, Any] = {}
    rows = result.iterations
    if rows:
        keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float, bool))})
        for k in keys:
            data_vars[k if k != "iteration" else "iteration_index"] = (
                "iteration",
                np.array([float(r.get(k, math.nan)) for r in rows]),
            )
    shifts = result.shifts
    if shifts:
        for ph in PHASES:
            data_vars[f"shift_time_{ph}"] = (
                "shift",
                np.array([shift_phase(e, ph, math.nan) for e in shifts]),
            )
        data_vars["shift_t"] = ("shift", np.array([e["t"] for e in shifts]))
        data_vars["shift_from"] = ("shift", np.array([ROLE_CODES.get(e["src"], -1) for e in shifts], np.int8))
        data_vars["shift_to"] = ("shift", np.array([ROLE_CODES.get(e["role"], -1) for e in shifts], np.int8))
        data_vars["shift_device"] = ("shift", np.array([str(e["name"]) for e in shifts], dtype=object))
    tl = result.timeline
    if tl:
        data_vars["timeline_t"] = ("sample", np.array([s["t"] for s in tl]))
        for role in ROLES:
            data_vars[f"queue_depth_{role}"] = (
                "sample",
                np.array([s["queue_depth"].get(role, 0) for s in tl]),
            )
            data_vars[f"running_{role}"] = ("sample", np.array([s["running"].get(role, 0) for s in tl]))
            data_vars[f"tokens_{role}"] = ("sample", np.array([s["tokens"].get(role, 0) for s in tl]))
        names = sorted({n for s in tl for n in s["roles"]})
        data_vars["device_role"] = (
            ("sample", "device"),
            np.array([[ROLE_CODES.get(s["roles"].get(n), -1) for n in names] for s in tl], dtype=np.int8),
        )
    ds = xr.Dataset(
        data_vars,
        coords={"device": np.array(sorted({n for s in tl for n in s["roles"]}), dtype=object)}
        if tl
        else None,
    )
    ds.attrs.update(
        {
            "run_id": result.run_id,
            "wall_s": float(result.wall_s),
            "devices": int(result.devices),
            "role_codes": "-1 idle, 0 rollout, 1 reward, 2 train, 3 shifting",
            **{f"eval_{k}": float(v) for k, v in result.eval.items()},
        }
    )
    with warnings.catch_warnings():  # zarr v3 warns that variable-length strings are not in its spec yet
        warnings.simplefilter("ignore")
        ds.to_zarr(str(path), mode="w", consolidated=False)
    summary = {
        "run_id": result.run_id,
        "wall_s": result.wall_s,
        "devices": result.devices,
        "eval": result.eval,
        "iterations": [persisted(r) for r in rows],
        "shifts": shifts,
        "final_policy": str(result.final_policy) if result.final_policy else None,
    }
    (path.parent / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return path
