"""Devices are discovered, not assumed: remote workers are asked for CUDA, the driver's device never decides
theirs, and a local GPU cluster starts non-daemonic workers on the GPUs the parent may use."""

from __future__ import annotations

import sys
import types

import dask
import pytest

from pivotrl.core.devices import DeviceMismatch, WorkerDevice, choose_device
from pivotrl.errors import UserError
from pivotrl.runtime import cluster as cluster_mod
from pivotrl.runtime.cluster import discover_device, open_cluster

GPU = [WorkerDevice("tcp://a", True, 1, ("H200",)), WorkerDevice("tcp://b", True, 1, ("H200",))]
CPU = [WorkerDevice("tcp://c", False), WorkerDevice("tcp://d", False)]


def test_choose_device_follows_the_workers_not_the_driver():
    assert choose_device("auto", GPU) == "cuda"
    assert choose_device("auto", CPU) == "cpu"
    assert choose_device("auto", []) == "cpu"
    assert choose_device("cpu", GPU) == "cpu"
    assert choose_device("cuda", GPU) == "cuda"
    with pytest.raises(DeviceMismatch, match=r"without CUDA: tcp://c"):
        choose_device("cuda", CPU)
    with pytest.raises(DeviceMismatch, match="1 workers have CUDA and 1 do not"):
        choose_device("auto", [GPU[0], CPU[0]])
    with pytest.raises(DeviceMismatch, match="expected auto"):
        choose_device("tpu", GPU)


class FakeClient:
    def __init__(self, reports):
        self.reports = reports

    def run(self, fn):
        assert fn is cluster_mod.probe_device
        return {r.address: r for r in self.reports}


def test_discover_device_asks_the_workers():
    assert discover_device(FakeClient(GPU), "auto") == "cuda"
    with pytest.raises(UserError, match="cluster: device cuda"):
        discover_device(FakeClient(CPU), "cuda")


def test_remote_mode_reports_the_workers_device():
    from distributed import LocalCluster

    lc = LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None)
    with lc, open_cluster(scheduler=lc.scheduler_address, workers=1) as handle:
        assert handle.cluster is None
        assert handle.device == ("cuda" if cluster_mod.cuda_available() else "cpu")
        (report,) = handle.client.run(cluster_mod.probe_device).values()
        assert isinstance(report, WorkerDevice) and report.address.startswith(("tcp://", "inproc://"))


def test_local_cuda_cluster_is_non_daemonic_and_keeps_the_parents_gpus(monkeypatch):
    from distributed import LocalCluster

    seen: dict = {}

    class FakeLocalCUDACluster(LocalCluster):
        def __init__(self, **kwargs):
            seen["kwargs"] = dict(kwargs)
            seen["daemon_at_start"] = dask.config.get("distributed.worker.daemon")
            kwargs.pop("memory_limit", None)
            kwargs.pop("host", None)  # in-process workers take no host
            super().__init__(processes=False, memory_limit=0, **kwargs)

    monkeypatch.setitem(
        sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=FakeLocalCUDACluster)
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with open_cluster(device="cuda", workers=2, dashboard_address=None) as handle:
        assert handle.device == "cuda"
        # restarts happen while the run lasts: the flag holds for the cluster's whole life
        assert dask.config.get("distributed.worker.daemon") is False
        assert len(handle.device_workers()) == 2
    assert seen["daemon_at_start"] is False
    assert seen["kwargs"]["n_workers"] == 2
    assert "CUDA_VISIBLE_DEVICES" not in seen["kwargs"]  # dask-cuda rotates the parent's "4,5" itself
    assert dask.config.get("distributed.worker.daemon") is not False


@pytest.mark.parametrize(
    ("cores", "workers", "threads", "expected"),
    [(2, 2, 1, 1), (2, 1, 1, 1), (16, 1, 1, 15), (16, 4, 2, 8), (4, 8, 1, 1), (1, 1, 1, 1)],
)
def test_the_driver_takes_the_cores_the_local_workers_leave(cores, workers, threads, expected):
    assert cluster_mod.driver_threads(cores, workers, threads) == expected
