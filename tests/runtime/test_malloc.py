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


def _thp_possible() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    release = tuple(int(p) for p in os.uname().release.split(".")[:2] if p.isdigit())
    return "[never]" not in mode and release >= (6, 1)  # MADV_COLLAPSE


def _anon_huge_kib(start: int, end: int) -> int:
    """AnonHugePages (KiB) of this process's mappings that overlap [start, end)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: "lo-hi perms ..."
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(2) huge pages")
def test_huge_pages_keep_contents_and_skip_small_buffers():
    import torch

    from pivotrl.malloc import MIN_HUGE_BYTES, huge_pages

    small = torch.arange(1024, dtype=torch.float32)
    assert huge_pages([(small.data_ptr(), small.numel() * 4)]) == 0  # under MIN_HUGE_BYTES: left alone
    big = torch.randn(3 * MIN_HUGE_BYTES // 4, generator=torch.Generator().manual_seed(0))
    expected = big.clone()
    start, nbytes = big.data_ptr(), big.numel() * 4
    collapsed = huge_pages([(start, nbytes)])
    assert torch.equal(big, expected)  # the pages moved, the contents did not
    if _thp_possible():
        assert collapsed >= 5, collapsed  # 12 MiB touch at least 6 chunks of 2 MiB, 5 of them whole
        assert _anon_huge_kib(start, start + nbytes) >= 5 * 2048
