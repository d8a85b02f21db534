"""`keep_freed_memory`: a process that frees and re-allocates the same large buffers every step (an engine
step) stops page-faulting them in again. Run in fresh interpreters with Dask's worker setting
MALLOC_TRIM_THRESHOLD_=65536, since the settings are process-wide and read at start-up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

STEPS = """
import resource, sys
import torch
from pivotrl.malloc import keep_freed_memory
ok = keep_freed_memory() if sys.argv[1] == "keep" else None
x = torch.ones(256, 256)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):  # a step's activations: allocated, used, freed
    a = torch.empty(1 << 20)  # 4 MiB
    a.fill_(1.0)
    b = a * 2.0
    del a, b
print(ok, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> tuple[str, int]:
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], env=env, capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_buffers_are_reused_without_page_faults():
    ok, kept = faults("keep")
    _, default = faults("default")
    assert ok == "True"
    # default: every 4 MiB buffer is mmap'd and faulted in again (~2,000 faults per step here)
    assert default > 100_000, default
    assert kept < default / 20, (kept, default)
