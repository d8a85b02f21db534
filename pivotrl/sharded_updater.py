"""The sharded optimizer owner, driver side: the train devices step, the driver only coordinates.

Same interface as `pivotrl.grpo.PolicyUpdater` (`version`, `slices`, `apply(grads, iteration)`,
`last_stats`), so the pipeline does not know which owner it has (`train.optimizer_owner`). `apply` asks
the scheduler's `pivotrl_train_plan` for the group (core decides ranks), sends each member its rank's job
(`pivotrl.runtime.train_worker.run_rank_step`: its own flushed sum; rank 0 also the sums of devices that
left the train role), and waits for their statistics — plain numbers. No weight, gradient or optimizer
tensor of the policy is ever allocated here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from pivotrl.config import PipelineConfig
from pivotrl.grpo import minibatch_slices
from pivotrl.runtime.handover import persist
from pivotrl.runtime.train_plugin import plan_from_wire
from pivotrl.runtime.train_worker import RankStep, SumRef, run_rank_step, settle_rank


class TrainStepFailed(RuntimeError):
    """The train group's step did not complete; nothing of it was committed."""


class ShardedUpdater:
    def __init__(self, cfg: PipelineConfig, client: Any, gps_options: dict[str, Any], hf_dir: str,
                 pad_id: int, version: int = 0, timeout_s: float = 120.0) -> None:
        self.cfg, self.client, self.gps_options = cfg, client, dict(gps_options)
        self.name = cfg.models.policy.name
        self.hf_dir, self.pad_id = str(hf_dir), int(pad_id)
        self._version = int(version)
        self.timeout_s = timeout_s
        self.last_stats: dict[str, Any] = {}  # plain numbers (they go into the run's records)
        #: per rank, seconds per phase of the last step (`TrainRank.phases`, plus `dispatch`: the task's
        #: start minus the submit) — where the barrier went (benchmarks/train_step.py)
        self.last_phases: list[dict[str, float]] = []
        self.first_step_at: float | None = None
        self.members: tuple[str, ...] = ()
        self._formation: tuple[int, str] | None = None  # (group id, token) of the ranks' process group

    @property
    def version(self) -> int:
        return self._version

    def slices(self, n: int) -> list[range]:
        return minibatch_slices(n, self.cfg.train.minibatches)

    def plan(self, devices: Sequence[str]) -> Any:
        wire = self.client.sync(self.client.scheduler.pivotrl_train_plan, policy=self.name,
                                step=self._version, devices=sorted(devices))
        return plan_from_wire(wire)

    def apply(self, grads: Sequence[Any], iteration: int) -> int:
        """One sharded step over the flushed sums `grads` (`GradResult`s); returns the version after it."""
        if self.first_step_at is None:
            self.first_step_at = time.monotonic()
        if not grads:
            self.last_stats = {"skipped": 1.0}
            return self._version
        t_plan = time.perf_counter()
        plan = self.plan(sorted({g.worker for g in grads}))
        t_submit, submitted_at = time.perf_counter(), time.time()
        share: dict[int, list[SumRef]] = {r: [] for r in range(plan.world)}
        # A member's own sum first (the one `run_rank_step` treats as local); a departed device's sum is
        # folded in by rank 0.
        folded = []
        for g in sorted(grads, key=lambda g: g.worker not in plan.members):
            r = plan.rank_of(g.worker) if g.worker in plan.members else 0
            share[r].append(SumRef(g.model, int(g.version), g.stats.as_kwargs()))
            if g.worker not in plan.members:
                folded.append(g)
        # A sum handed over in memory on a device that is not a member is written now, by its holder, for
        # rank 0 to read (rank 0 waits for it); a sum a member's rank takes is never written.
        # (A holder that is gone left nothing to write: its sum is in the store, or lost, and rank 0's wait
        # for it ends the step with one line.)
        alive = set(self.client.scheduler_info(n_workers=-1)["workers"]) if folded else set()
        persists = [self.client.submit(persist, g.model, int(g.version), workers=[g.worker],
                                       allow_other_workers=False, pure=False)
                    for g in folded if g.worker in alive]
        tag = uuid.uuid4().hex[:8]
        if self._formation is None or self._formation[0] != plan.group_id:  # (re)form the process group
            self._formation = (plan.group_id, tag)
        token = self._formation[1]
        futs = []
        for r, member in enumerate(plan.members):
            job = RankStep(self.name, self._version, plan, r, tuple(share[r]), self.hf_dir,
                           self.cfg.models.policy.dtype, self.pad_id, self.cfg,
                           keep_last=self.cfg.gps.keep_last, timeout_s=min(60.0, self.timeout_s),
                           gps=self.gps_options, formation=token)
            futs.append(self.client.submit(run_rank_step, job, key=f"pivotrl-train-{self._version}-{r}-{tag}",
                                           workers=[member], allow_other_workers=False, pure=False))
        try:
            from distributed import wait

            wait(futs + persists, timeout=self.timeout_s)
            results = self.client.gather(futs)
            self.client.gather(persists)
        except Exception as exc:
            self._formation = None  # the next step forms the group afresh
            for f in futs + persists:
                f.cancel()
            line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TrainStepFailed(f"train step at version {self._version} failed on a group of "
                                  f"{plan.world}: {type(exc).__name__}: {line}; nothing committed") from None
        self.members = plan.members
        stats = {k: v for k, v in results[0].items() if k not in ("phases", "started_at")}
        self.last_stats = dict(stats)
        self.last_stats["replica_sums"] = len(grads)
        # Where the barrier went, per rank: the driver's plan call, each task's dispatch latency (its start
        # minus the submit, one clock on one host; across hosts only roughly), then the rank's own phases.
        self.last_stats["plan_s"] = t_submit - t_plan
        self.last_stats["ranks_s"] = time.perf_counter() - t_submit
        self.last_stats["local_sums"] = sum(int(r.get("local_sums", 0)) for r in results)
        self.last_phases = [
            dict(r.get("phases", {}), dispatch=round(max(0.0, r.get("started_at", submitted_at)
                                                                - submitted_at), 4))
            for r in results]
        self._version = int(stats["version"])
        return self._version

    def checkpoint_state(self) -> dict[str, Any]:
        """What a run checkpoint keeps of this owner: the version only (weights and AdamW moments are
        versioned in the store, `<policy>` and `<policy>.optim`)."""
        return {"sharded": True, "version": self._version}

    def restore_version(self, version: int) -> None:
        self._version = int(version)

    def settle(self) -> None:
        """Wait until the last step's optimizer state is committed in the store (the ranks write it behind
        the barrier); a checkpoint naming the version calls this first."""
        futs = [self.client.submit(settle_rank, self.name, workers=[m], allow_other_workers=False, pure=False)
                for m in self.members]
        try:
            from distributed import wait

            wait(futs, timeout=self.timeout_s)
            self.client.gather(futs)
        except Exception as exc:
            raise TrainStepFailed(f"optimizer state of version {self._version} not committed: "
                                  f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
