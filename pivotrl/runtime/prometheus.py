"""`pivotrl_*` Prometheus metrics on the Dask dashboard's `/metrics` endpoint (scheduler process).

Why there: Dask's `/metrics` handler serves `prometheus_client`'s default registry, and that is where Dask's
own collectors go; a collector registered on it by the scheduler plugin is scraped with them, so an
operator who already watches a Dask cluster gets pivotrl's state with no new port. The collector reads the
orchestrator when scraped (role per device, queues, tokens/s), folds its shift events into counters and a
histogram incrementally, and shows the driver's last iteration report (`IterationReport`).

`prometheus_client` is optional: without it `register` returns None and nothing is exported.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pivotrl.core.types import ShiftTimings
from pivotrl.runtime.messages import IterationReport

ROLES = ("rollout", "reward", "train")
SHIFT_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)  # seconds: CPU debug to 7B on GPU


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets, self.counts, self.sum, self.n = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, x: float) -> None:
        self.sum += x
        self.n += 1
        for i, b in enumerate(self.buckets):
            if x <= b:
                self.counts[i] += 1

    def as_buckets(self) -> list[tuple[str, float]]:
        return [(repr(b), float(c)) for b, c in zip(self.buckets, self.counts)] + [("+Inf", float(self.n))]


class PivotCollector:
    """A `prometheus_client` custom collector over the scheduler plugin's orchestrator."""

    def __init__(self, orchestrator: Any) -> None:
        self.retarget(orchestrator)

    def retarget(self, orchestrator: Any) -> None:
        """Export `orchestrator`'s state from now on, with fresh counters."""
        self.orch = orchestrator
        self.report: IterationReport | None = None
        self._seen = 0  # orchestrator events folded in so far
        self.shifts: dict[tuple[str, str], int] = {}
        self.phase = {ph: _Histogram(SHIFT_BUCKETS) for ph in (*ShiftTimings.PHASES, "total")}

    def _fold_events(self) -> None:
        events = self.orch.events
        for e in events[self._seen :]:
            if e.get("kind") != "shift_done" or e.get("src") is None:
                continue  # a device's first placement loads a role but shifts nothing
            pair = (str(e["src"]), str(e.get("role") or "none"))
            self.shifts[pair] = self.shifts.get(pair, 0) + 1
            for ph, seconds in (e.get("timings") or {}).items():
                if ph in self.phase:
                    self.phase[ph].observe(float(seconds))
            self.phase["total"].observe(float(e.get("total", 0.0)))
        self._seen = len(events)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        if self.orch is None:  # its scheduler plugin closed
            return
        self._fold_events()
        role = GaugeMetricFamily(
            "pivotrl_device_role", "1 for the role a device serves now", labels=["device", "role"]
        )
        for w in self.orch.workers.values():
            current = w.role if w.status == "ready" else "shifting"
            for r in (*ROLES, "shifting"):
                role.add_metric([str(w.name), r], 1.0 if current == r else 0.0)
        yield role
        snap = self.orch.ctl.snapshot()["roles"]
        queue = GaugeMetricFamily("pivotrl_queue_depth", "sequences waiting in the role's shared queue",
                                  labels=["role"])
        rate = GaugeMetricFamily("pivotrl_tokens_per_second", "the role's active replicas' token rate",
                                 labels=["role"])
        tokens = CounterMetricFamily("pivotrl_tokens", "tokens processed by the role", labels=["role"])
        for r in ROLES:
            s = snap.get(r, {})
            queue.add_metric([r], float(s.get("waiting", 0)))
            rate.add_metric([r], float(s.get("tokens_per_s", 0.0)))
            tokens.add_metric([r], float(self.orch.tokens.get(r, 0)))
        yield queue
        yield rate
        yield tokens
        shifts = CounterMetricFamily(
            "pivotrl_shifts", "role shifts done, by role pair", labels=["src", "dst"]
        )
        for (src, dst), n in sorted(self.shifts.items()):
            shifts.add_metric([src, dst], float(n))
        yield shifts
        hist = HistogramMetricFamily(
            "pivotrl_shift_phase_seconds", "seconds per shift phase", labels=["phase"]
        )
        for ph, h in self.phase.items():
            hist.add_metric([ph], h.as_buckets(), h.sum)
        yield hist
        rep = self.report
        if rep is not None:
            for name, doc, value in (
                ("pivotrl_iteration", "the last completed iteration", rep.iteration),
                ("pivotrl_iteration_seconds", "wall seconds of the last iteration", rep.seconds),
                ("pivotrl_reward_mean", "mean reward of the last iteration", rep.reward_mean),
                ("pivotrl_policy_version", "the policy version after the last iteration", rep.policy_version),
            ):
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], float(value))
                yield g
            c = CounterMetricFamily("pivotrl_judgments_unparseable", "judgments whose verdict did not parse")
            c.add_metric([], float(rep.unparseable))
            yield c
            c = CounterMetricFamily("pivotrl_judgments", "judgments parsed or not")
            c.add_metric([], float(rep.judged))
            yield c


_registered: PivotCollector | None = None


def register(orchestrator: Any) -> PivotCollector | None:
    """Point the process's one collector at `orchestrator`, registering it on the default registry (the
    one Dask's `/metrics` serves) the first time; None without `prometheus_client`.

    One collector per process, retargeted, as Dask's own are: a replaced plugin (or a second scheduler in
    the same process, as in tests) would otherwise register the same series twice, which the registry
    refuses."""
    global _registered
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return None
    if _registered is None:
        _registered = PivotCollector(orchestrator)
        REGISTRY.register(_registered)
    else:
        _registered.retarget(orchestrator)
    return _registered


def unregister(collector: PivotCollector | None, orchestrator: Any = None) -> None:
    """Detach `collector` from `orchestrator` (it then exports nothing) unless another took it over."""
    if collector is not None and (orchestrator is None or collector.orch is orchestrator):
        collector.orch = None
