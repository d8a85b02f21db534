"""The sharded optimizer owner on a real LocalCluster: the rendezvous through the scheduler's
`pivotrl_train_*` handlers, ranks as Dask tasks on the device workers, a group re-formed (and the
optimizer state re-sharded from the store) when membership changes, a departed device's flushed sum
folded in — bit-identical to the driver-owned update in fp32 — and no policy tensor in the driver."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pivotrl.engines.checkpoints import PAD_ID, create_model, from_pretrained
from pivotrl.engines.grpo_loss import GradSum, compute_grad_sum, reduce
from pivotrl.gps import ParameterStore
from pivotrl.grpo import make_trainer
from pivotrl.runtime.messages import GradResult, GradStats
from pivotrl.runtime.train_plugin import TrainGroupPlugin
from pivotrl.runtime.train_worker import publish_initial
from pivotrl.sharded_updater import ShardedUpdater
from tests.engines.test_trainer import random_samples
from tests.tiny import tiny_config

SETS = ["train.lr=0.05", "train.grad_clip=0.5", "train.warmup_steps=2", "train.weight_decay=0.01"]


class CountOps(TorchDispatchMode):
    """Counts every aten op run in this thread (a tensor allocated here would be one)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def cluster() -> Any:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as lc, \
            Client(lc) as client:
        client.register_plugin(TrainGroupPlugin())
        yield client


def _flush(store: ParameterStore, worker: str, name: str, gs: GradSum) -> GradResult:
    v = max(store.versions(name), default=-1) + 1 if name in store.models() else 0
    store.publish(name, v, gs.grads)
    store.flush()
    return GradResult(model=name, version=v, items=[], stats=GradStats.of(gs), worker=worker)


def _setup(cluster: Any, tmp_path: Path) -> tuple:
    """A tiny config and policy, its version 0 published by a worker, the driver-owned trainer (the
    reference update) and a `ShardedUpdater` over the cluster's two workers."""
    cfg = tiny_config(tmp_path, SETS)
    hf = create_model("debug", tmp_path / "policy")
    gps = {"root": str(tmp_path / "gps")}
    store = ParameterStore(gps["root"], device_tier_bytes=0)
    name = cfg.models.policy.name
    workers = sorted(cluster.scheduler_info()["workers"])
    assert cluster.submit(publish_initial, name, str(hf), gps, workers=workers[:1]).result() > 0
    ref = make_trainer(cfg, from_pretrained(hf), PAD_ID)
    up = ShardedUpdater(cfg, cluster, gps, str(hf), PAD_ID, timeout_s=120)
    return cfg, hf, gps, store, name, workers, ref, up


def test_sharded_steps_equal_the_driver_owned_ones(cluster: Any, tmp_path: Path) -> None:
    _cfg, _hf, _gps, store, name, workers, ref, up = _setup(cluster, tmp_path)
    # step 1: one device trains (world 1); step 2: both (re-formed group, re-sharded optimizer state);
    # step 3: both, plus the sum of a device that left the train role (folded in by rank 0)
    plans = [[workers[0]], workers, [*workers, "tcp://departed:1"]]
    for step, flushers in enumerate(plans):
        sums = [compute_grad_sum(ref.model, random_samples(5, 10 * step + i), pad_id=PAD_ID, micro_batch=3,
                                 version=ref.version) for i in range(len(flushers))]
        grads = [_flush(store, w, f"grad-w{i}", gs) for i, (w, gs) in enumerate(zip(flushers, sums,
                                                                                      strict=True))]
        # the group's summation order: rank 0's own sum, the departed one it folds in, then rank 1's
        ref.apply(reduce([sums[0], *sums[2:], *sums[1:2]]))
        del sums
        gc.collect()
        with CountOps() as ops:
            v = up.apply(grads, step)
        assert ops.ops == []  # the driver thread ran no tensor op at all during the step
        assert all(isinstance(x, int | float | str | bool) for x in up.last_stats.values())  # no tensors
        assert v == ref.version == step + 1
        assert up.last_stats["world"] == min(2, len(flushers))
        got = store.fetch(name, v)
        assert all(torch.equal(got[k], t) for k, t in ref.model.state_dict().items()), step
    up.settle()  # the optimizer state is written behind the barrier
    opt = store.fetch(f"{name}.optim", 3)
    for n, p in ref.params.items():
        assert torch.equal(opt[f"exp_avg/{n}"], ref.optimizer.state[p]["exp_avg"])


def test_a_restarted_cluster_resumes_the_sharded_optimizer_exactly(cluster: Any, tmp_path: Path) -> None:
    """Two steps, every worker process killed (`Client.restart`: the ranks and their optimizer shards in
    memory are gone), then a third step by a fresh group from the store's `<policy>.optim` alone."""
    cfg, hf, gps, store, name, workers, ref, up = _setup(cluster, tmp_path)
    for step in range(3):
        if step == 2:
            up.settle()
            state = up.checkpoint_state()
            cluster.restart()
            workers = sorted(cluster.scheduler_info()["workers"])
            up = ShardedUpdater(cfg, cluster, gps, str(hf), PAD_ID, timeout_s=120)
            up.restore_version(state["version"])
        sums = [compute_grad_sum(ref.model, random_samples(5, 7 * step + i), pad_id=PAD_ID, micro_batch=3,
                                 version=ref.version) for i in range(2)]
        grads = [_flush(store, w, f"grad-w{i}", gs) for i, (w, gs) in enumerate(zip(workers, sums,
                                                                                  strict=True))]
        ref.apply(reduce(sums))
        assert up.apply(grads, step) == ref.version
    got = store.fetch(name, 3)
    assert all(torch.equal(got[k], t) for k, t in ref.model.state_dict().items())


def _flush_here(gps: dict[str, Any], name: str, gs: GradSum) -> int:
    """On a worker: what `TrainContext.flush` does with `hand_over` set — the sum persisted, then kept in
    this process for the rank that runs here."""
    from pivotrl.runtime.handover import hand_over

    with ParameterStore(gps["root"], device_tier_bytes=0, write_behind=False) as store:
        v = max(store.versions(name), default=-1) + 1 if name in store.models() else 0
        store.publish(name, v, gs.grads)
    hand_over(name, v, gs)
    return v


def test_a_rank_takes_its_own_devices_sum_from_memory(cluster: Any, tmp_path: Path) -> None:
    """Sums flushed on the ranks' own workers are taken from memory (`local_sums`), not read back from the
    store, and the step is still bit-identical to the driver-owned one."""
    _cfg, _hf, gps, store, name, workers, ref, up = _setup(cluster, tmp_path)
    for step in range(2):
        sums = [compute_grad_sum(ref.model, random_samples(5, 40 + 10 * step + i), pad_id=PAD_ID,
                                 micro_batch=3, version=ref.version) for i in range(2)]
        vs = [cluster.submit(_flush_here, gps, f"grad-w{i}", gs, workers=[w], pure=False).result()
              for i, (w, gs) in enumerate(zip(workers, sums, strict=True))]
        grads = [GradResult(model=f"grad-w{i}", version=v, items=[], stats=GradStats.of(gs), worker=w)
                 for i, (w, v, gs) in enumerate(zip(workers, vs, sums, strict=True))]
        ref.apply(reduce(sums))
        assert up.apply(grads, step) == ref.version
        assert up.last_stats["local_sums"] == 2  # both ranks took their own device's sum from memory
        got = store.fetch(name, ref.version)
        assert all(torch.equal(got[k], t) for k, t in ref.model.state_dict().items()), step
