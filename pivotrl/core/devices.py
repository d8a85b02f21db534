"""Which device kind the pivotrl workers run on, decided from what the workers report about themselves.

Why in core: the device of a worker is a fact of that worker (a `dask cuda worker` on a GPU node), not of
the driver, which may be a laptop without CUDA; before, remote mode ran every role on CPU because the
driver never asked. The mechanism (runtime/cluster.py) gathers the facts and executes this answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerDevice:
    """What one worker reports: whether torch sees CUDA there, how many devices, and their names."""

    address: str
    cuda: bool
    device_count: int = 0
    names: tuple[str, ...] = ()
    visible_devices: str | None = None  # the worker's CUDA_VISIBLE_DEVICES


class DeviceMismatch(ValueError):
    """The workers cannot all serve the requested device kind (the message names them)."""


def choose_device(requested: str, reports: Sequence[WorkerDevice]) -> str:
    """ "cuda" or "cpu" for every worker: `requested` ("auto", "cuda", "cpu") checked against the reports.

    "auto" is CUDA when every worker has it, CPU when none has; a mixed cluster is refused (one device kind
    per run: a role's throughput model and its engine options assume it)."""
    if requested not in ("auto", "cuda", "cpu"):
        raise DeviceMismatch(f"device {requested!r}: expected auto, cuda or cpu")
    if requested == "cpu":
        return "cpu"
    without = sorted(r.address for r in reports if not r.cuda)
    if requested == "cuda" and without:
        raise DeviceMismatch(f"device cuda: workers without CUDA: {', '.join(without[:4])}")
    if without and len(without) < len(reports):
        raise DeviceMismatch(
            f"device auto: {len(reports) - len(without)} workers have CUDA and {len(without)} do not "
            f"({', '.join(without[:4])}); start them alike or pass device cpu"
        )
    return "cpu" if without or not reports else "cuda"
