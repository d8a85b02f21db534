"""Start or connect to the Dask cluster whose workers are pivotrl's devices.

- CPU: a `LocalCluster` of N worker processes, one thread each, every worker carrying the abstract resource
  `device=1`; the worker plugin pins each to its own core and sets torch's thread count.
- GPU: a `LocalCUDACluster` (one worker per GPU) when CUDA and the optional `dask_cuda` are present. Its
  workers are started non-daemonic (`distributed.worker.daemon: False`), because vLLM starts its engine core
  as a child process, which a daemonic process may not have; and on the GPUs the parent may use (its
  `CUDA_VISIBLE_DEVICES` is left to dask-cuda, which rotates it per worker, rather than replaced by 0..n-1).
- Remote: `--scheduler tcp://host:port` connects to a cluster someone else started (`dask scheduler` /
  `dask worker --resources device=1`, or on GPUs `DASK_DISTRIBUTED__WORKER__DAEMON=False dask cuda worker
  ... --resources device=1`), which pivotrl never closes. The workers are asked for their device
  (`probe_device`); the driver's own device never decides theirs (`pivotrl.core.devices.choose_device`).

The scheduler binds 127.0.0.1 unless told otherwise, so a laptop run is not reachable from the network.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pivotrl.core.devices import DeviceMismatch, WorkerDevice, choose_device
from pivotrl.errors import UserError
from pivotrl.machine import usable_cores

NON_DAEMONIC = {"distributed.worker.daemon": False}


def default_workers() -> int:
    """One device worker per usable core (`machine.usable_cores`)."""
    return usable_cores()


def driver_threads(cores: int, local_workers: int, worker_threads: int) -> int:
    """torch threads for the driver beside `local_workers` device workers of `worker_threads` threads each
    on this machine's `cores`: the cores they leave, at least one.

    Why: the driver's torch ops (the optimizer step, gradient sums) are small, and an OpenMP team of
    threads waits at each op's barrier for a core a busy worker holds. Measured on 2 cores with both
    cores busy: a 0.13M-parameter fused AdamW step took 0.3–0.5 ms (median) with 1 thread, and
    0.7–40 ms median, 85–140 ms p90, with 2 (docs/decisions.md, "The driver leaves the workers' cores")."""
    return max(1, cores - local_workers * worker_threads)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@dataclass
class ClusterHandle:
    client: Any
    cluster: Any | None  # None when we connected to a cluster we do not own
    device: str  # "cpu" | "cuda"

    @property
    def dashboard_link(self) -> str | None:
        try:
            return self.client.dashboard_link
        except Exception:
            return None

    def device_workers(self) -> list[str]:
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        return sorted(info)


def _local_cpu(n_workers: int, host: str, dashboard_address: str | None) -> Any:
    from distributed import LocalCluster

    return LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        processes=True,
        resources={"device": 1},
        host=host,
        dashboard_address=dashboard_address,
        memory_limit=0,  # weights and KV caches are managed by the engines, not by dask's spill logic
        silence_logs=40,
    )


def _local_cuda(n_workers: int | None, host: str, dashboard_address: str | None) -> Any:
    """A LocalCUDACluster; call it under `dask.config.set(NON_DAEMONIC)` (its nanny reads the flag each
    time it starts a worker process, restarts included, so the setting must outlive this call)."""
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as exc:
        raise UserError("cluster: GPUs found but dask_cuda is missing; install the `gpu` extra") from exc
    kwargs: dict[str, Any] = dict(
        threads_per_worker=1,
        resources={"device": 1},
        host=host,
        dashboard_address=dashboard_address,
        memory_limit=0,
    )
    if n_workers is not None:  # the first n of the GPUs the parent may use, not physical 0..n-1
        kwargs["n_workers"] = n_workers
    return LocalCUDACluster(**kwargs)


def probe_device(dask_worker: Any = None) -> WorkerDevice:
    """Run on a worker (`client.run` passes the worker as `dask_worker`): what this worker's torch sees."""
    address = str(getattr(dask_worker, "address", "local"))
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
        count = torch.cuda.device_count() if cuda else 0
        names = tuple(torch.cuda.get_device_name(i) for i in range(count))
    except ImportError:
        cuda, count, names = False, 0, ()
    return WorkerDevice(address, cuda, count, names, os.environ.get("CUDA_VISIBLE_DEVICES"))


def discover_device(client: Any, requested: str) -> str:
    """Ask every worker for its device and decide one kind for all (a clear error on a mixed cluster)."""
    if requested == "cpu":
        return "cpu"
    reports = list(client.run(probe_device).values())
    try:
        return choose_device(requested, reports)
    except DeviceMismatch as exc:
        raise UserError(f"cluster: {exc}") from None


@contextlib.contextmanager
def open_cluster(
    *,
    workers: int | None = None,
    scheduler: str | None = None,
    host: str = "127.0.0.1",
    dashboard_address: str | None = ":0",
    device: str = "auto",
    timeout_s: float = 60.0,
) -> Iterator[ClusterHandle]:
    """Yield a connected client; close what we started (and only that) on exit."""
    from distributed import Client

    if scheduler:
        if not scheduler.startswith(("tcp://", "tls://", "inproc://", "ucx://", "ws://", "wss://")):
            raise UserError(f"--scheduler {scheduler!r}: expected an address like tcp://127.0.0.1:8786")
        try:
            client = Client(scheduler, timeout=timeout_s)
        except OSError as exc:
            raise UserError(f"--scheduler {scheduler}: cannot connect ({exc.__class__.__name__})") from None
        try:
            if workers:
                client.wait_for_workers(workers, timeout=timeout_s)
            yield ClusterHandle(client, None, discover_device(client, device))
        finally:
            client.close()
        return

    use_cuda = device == "cuda" or (device == "auto" and cuda_available())
    with contextlib.ExitStack() as stack:
        if use_cuda:
            import dask

            stack.enter_context(dask.config.set(NON_DAEMONIC))
            cluster = _local_cuda(workers, host, dashboard_address)
        else:
            cluster = _local_cpu(workers or default_workers(), host, dashboard_address)
        client = Client(cluster)
        try:
            yield ClusterHandle(client, cluster, "cuda" if use_cuda else "cpu")
        finally:
            client.close()
            cluster.close()
