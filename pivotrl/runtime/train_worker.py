"""One train rank's step, run as a Dask task on a device worker (the sharded optimizer owner).

The rank's `TrainRank` (its weights, its optimizer shard, its process group) stays in this worker process
between steps, keyed by the policy name, and is rebuilt only when the group changes — then the optimizer
shard it now owns is read from the store (`<policy>.optim` at the current version): a re-shard reads only
the tensors the rank owns, whatever the world size that wrote them.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any

from pivotrl.core.train_group import TrainGroupPlan
from pivotrl.runtime.handover import take

_RANKS: dict[str, Any] = {}  # policy → _Held (this process's rank of that policy's train group)


@dataclass(frozen=True)
class SumRef:
    """A flushed gradient sum in the store, and its statistics (`GradStats.as_kwargs()`)."""

    model: str
    version: int
    stats: dict[str, Any]


@dataclass(frozen=True)
class RankStep:
    """What the driver sends each rank: the group, the step, whose sums it reduces. Plain data only."""

    policy: str
    version: int  # the policy version the sums are gradients of
    plan: TrainGroupPlan
    rank: int
    sums: tuple[SumRef, ...]  # this rank's share: its own flushed sum(s); rank 0 also the departed ones
    hf_dir: str
    dtype: str
    pad_id: int
    cfg: Any  # the run's PipelineConfig (its `train` section sets the optimizer)
    keep_last: int = 3
    timeout_s: float = 60.0
    optim_behind: bool = True
    formation: str = ""  # the driver's token of this group formation: a new one rebuilds every rank
    gps: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Held:
    formation: str
    rank: Any
    kv: Any


_STORES: dict[str, Any] = {}  # store root → this process's client (kept: background writes use it)


def _store(job: RankStep) -> Any:
    from pivotrl.gps import ParameterStore

    opts = dict(job.gps)
    root = opts.pop("root")
    if root not in _STORES:
        _STORES[root] = ParameterStore(root, device_tier_bytes=0, write_behind=False,
                                       **{k: v for k, v in opts.items() if k == "host_tier"})
    return _STORES[root]


def _kv(job: RankStep, address: Any) -> Any:
    """Rank 0 hosts the group's key-value store and posts its address through the scheduler plugin; the
    other ranks look it up there."""
    from torch import distributed as dist

    policy, gid, token = job.policy, job.plan.group_id, job.formation
    if job.rank == 0:
        host = socket.gethostbyname(socket.gethostname()) if address is None else address
        kv = dist.TCPStore(host, 0, job.plan.world, is_master=True, wait_for_workers=False,
                           timeout=_td(job.timeout_s))
        _call("pivotrl_train_post", policy=policy, token=token, address=f"{host}:{kv.port}")
        return kv
    addr = _call("pivotrl_train_lookup", policy=policy, token=token, timeout_s=job.timeout_s)
    if addr is None:
        from pivotrl.runtime.train_group import TrainGroupLost

        raise TrainGroupLost(f"train group {gid}: rank 0 posted no address within {job.timeout_s:g}s")
    host, port = addr.rsplit(":", 1)
    return dist.TCPStore(host, int(port), job.plan.world, is_master=False, timeout=_td(job.timeout_s))


def _td(s: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=s)


def _call(name: str, **kw: Any) -> Any:
    from distributed import get_worker
    from distributed.utils import sync

    w = get_worker()
    return sync(w.loop, getattr(w.scheduler, name), **kw)


def _build(job: RankStep, store: Any, kv: Any) -> Any:
    import torch

    from pivotrl.engines.trainer import GRPOTrainer
    from pivotrl.malloc import keep_freed_memory
    from pivotrl.runtime.roles import _build_model
    from pivotrl.runtime.train_group import TrainRank, form_group

    # A step allocates and frees model-sized buffers (reduce buckets, clip, AdamW temporaries): with glibc's
    # defaults each is mmap'd and page-faulted in afresh every step. The worker plugin sets this already in
    # a pivotrl run (idempotent); a rank hosted by any other worker needs it as much.
    keep_freed_memory()
    state = store.fetch(job.policy, job.version)
    model = _build_model({"hf_dir": job.hf_dir, "dtype": job.dtype}, "cpu", state)
    del state
    trainer = GRPOTrainer.from_train_config(job.cfg.train, model, job.pad_id)
    trainer.version = job.version
    group = form_group(kv, job.plan, job.rank, device="cpu", timeout_s=job.timeout_s)
    rank = TrainRank(trainer, group)
    if f"{job.policy}.optim" in store.models() and job.version in store.versions(f"{job.policy}.optim"):
        rank.load_optim(store, job.policy, job.version)
    torch.set_grad_enabled(True)
    return rank


def run_rank_step(job: RankStep, host: str | None = None) -> dict[str, Any]:
    """Reduce, step and publish as rank `job.rank`; returns the step's statistics (plain numbers)."""
    started = time.time()  # wall clock: the driver compares it with its submit time (dispatch latency)
    out = _step(job, _store(job), host)
    out["started_at"] = started
    return out


def _step(job: RankStep, store: Any, host: str | None) -> dict[str, Any]:
    import contextlib

    from pivotrl.engines.grpo_loss import GradSum

    t_form = time.perf_counter()
    held = _RANKS.get(job.policy)
    if held is None or held.formation != job.formation:
        _RANKS.pop(job.policy, None)
        kv = _kv(job, host)
        held = _Held(job.formation, _build(job, store, kv), kv)
        _RANKS[job.policy] = held
    elif held.rank.trainer.version != job.version:
        _RANKS.pop(job.policy, None)
        raise RuntimeError(f"rank {job.rank} of formation {job.formation} holds version "
                           f"{held.rank.trainer.version}, the step is of {job.version}")
    rank = held.rank
    t0 = time.perf_counter()
    form_s = t0 - t_form
    sums, local_sums = [], 0
    for s in job.sums:
        handed = take(s.model, s.version)
        local_sums += handed is not None
        grads = handed.grads if handed is not None else _fetch_sum(store, s, job.timeout_s)
        sums.append(GradSum(grads=grads, **s.stats))
    local = sums[0] if sums else None
    t1 = time.perf_counter()

    def gc() -> None:  # behind the barrier (after the optimizer state): nothing waits for old versions to go
        for s in job.sums:
            with contextlib.suppress(Exception):
                store.gc(s.model, keep_last=1)
        if job.rank == 0:
            store.gc(job.policy, keep_last=job.keep_last)
            store.gc(f"{job.policy}.optim", keep_last=job.keep_last)

    try:
        stats = rank.step(local, sums[1:])
        t2 = time.perf_counter()
        if not stats.skipped:  # the rank's other tensors are never read here: no refresh needed
            rank.publish(store, job.policy, optim_behind=job.optim_behind, then=gc)
        else:
            for s in job.sums:
                with contextlib.suppress(Exception):
                    store.gc(s.model, keep_last=1)
    except Exception:
        _RANKS.pop(job.policy, None)  # a failed step leaves no half-stepped rank behind
        raise
    out = stats.as_dict()
    out.update(world=job.plan.world, fetch_s=t1 - t0, step_s=t2 - t1, publish_s=time.perf_counter() - t2,
               local_sums=local_sums)
    phases = dict(rank.phases)
    phases.update(form=form_s, fetch=t1 - t0)
    out["phases"] = {k: round(v, 4) for k, v in phases.items()}
    return out


def _fetch_sum(store: Any, s: SumRef, timeout_s: float) -> Any:
    """A sum flushed by another device, from the store: a sum handed over in memory is written only when
    its rank does not take it (`handover.persist`, asked for by the driver as this step starts), so a
    version not there yet is waited for, at most `timeout_s`."""
    from pivotrl.gps import NotFoundError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return store.fetch(s.model, s.version)
        except NotFoundError:
            if time.monotonic() > deadline:
                raise NotFoundError(f"gradient sum {s.model!r} version {s.version} was not written within "
                                    f"{timeout_s:g}s (its device was lost?); nothing committed") from None
            time.sleep(0.01)  # another process's write: nothing to wait on but the store


def settle_rank(policy: str) -> bool:
    """Wait for this process's rank to finish writing its optimizer state (before a checkpoint names the
    version); False when this process holds no rank of `policy`."""
    held = _RANKS.get(policy)
    if held is None:
        return False
    held.rank.settle()
    return True


def publish_initial(policy: str, hf_dir: str, gps: dict[str, Any]) -> int:
    """Version 0 of the policy, read from its directory and published by a device worker (the driver
    never holds the weights); returns the bytes published."""
    from pivotrl.engines.checkpoints import load_state_dict
    from pivotrl.gps import ParameterStore

    opts = dict(gps)
    with ParameterStore(opts.pop("root"), device_tier_bytes=0, write_behind=False) as store:
        sd = load_state_dict(hf_dir)
        store.publish(policy, 0, sd)
        return sum(t.numel() * t.element_size() for t in sd.values())
