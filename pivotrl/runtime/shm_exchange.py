"""The reduce-scatter's transport between train ranks on one host: shared memory instead of sockets.

Why: gloo has no shared-memory transport, so two CPU ranks on one host moved each gradient byte through
the loopback TCP stack — a copy into the kernel and one out, in 1 MB messages: ~0.1 s for the 126 MB a
rank of the 63 M `medium` policy sends (benchmarks/train_step.py), and a fresh receive buffer each step.
Here each rank has one segment, mapped by every rank of the group for the group's lifetime; a step copies
each bucket the rank sends into its segment once, one small all-reduce says every segment is written, and
each owner sums the parts straight from the senders' segments, in the same order and with the same
arithmetic as over gloo (bit-identical). What NCCL does between GPUs of one node, for CPU ranks.

The segments' pages stay mapped across steps (no page faults after the first), and their files are
unlinked as soon as every rank mapped them, so a crash leaves nothing in /dev/shm. Reuse is safe without
locks: a rank rewrites its segment only in its next step, after the clip's all-reduce of this step, which
no rank enters before it has summed its parts.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import uuid
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

SHM_DIR = Path("/dev/shm")
_ALIGN = 64
#: Set to "0" to keep every rank on the process group's own transport (tests compare the two).
ENV_SWITCH = "PIVOTRL_TRAIN_SHM"


def host_id() -> int:
    """This host's identity, 48 bits (exact in the fp64 all-reduce that compares them): host name and
    kernel boot id, so two containers with one name on different machines do not match."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    low = zlib.crc32(f"{socket.gethostname()}|{boot}".encode())
    return low | (zlib.adler32(boot.encode()) & 0xFFFF) << 32


def layout(buckets: Sequence[tuple[int, int]], nbytes: Sequence[int], world: int) -> list[dict[int, int]]:
    """Per rank, the offset in its segment of every bucket it sends (a bucket goes whole to its owner, so
    every rank sends every bucket it does not own), in bucket order, 64-byte aligned. The same on every
    rank: each one computes where to read its parts without asking."""
    out: list[dict[int, int]] = [{} for _ in range(world)]
    ends = [0] * world
    for b, (owner, _run) in enumerate(buckets):
        for r in range(world):
            if r != owner:
                out[r][b] = ends[r]
                ends[r] += -(-nbytes[b] // _ALIGN) * _ALIGN
    return out


class ShmExchange:
    """The mapped segments of one group: `out(b)` is where this rank writes bucket `b`, `part(src, b)` the
    bucket as rank `src` wrote it. Build with `open`; None there means: use the process group."""

    def __init__(self, maps: list[mmap.mmap], offsets: list[dict[int, int]], sizes: Sequence[tuple[int, Any]],
                 rank: int) -> None:
        self._maps, self._offsets, self._sizes, self.rank = maps, offsets, sizes, rank

    def _view(self, r: int, b: int) -> torch.Tensor:
        numel, dtype = self._sizes[b]
        return torch.frombuffer(self._maps[r], dtype=dtype, count=numel, offset=self._offsets[r][b])

    def out(self, b: int) -> torch.Tensor:
        return self._view(self.rank, b)

    def part(self, src: int, b: int) -> torch.Tensor:
        return self._view(src, b)

    @classmethod
    def open(cls, group: Any, buckets: Sequence[tuple[int, int]], sizes: Sequence[tuple[int, Any]]
             ) -> ShmExchange | None:
        """Map every rank's segment, or None (every rank gets the same answer) when the group is one rank,
        not on CPU, not on one host, switched off, or a segment could not be made or mapped."""
        world, rank = group.world, group.rank
        if world < 2 or str(group.device) != "cpu" or os.environ.get(ENV_SWITCH, "1") == "0" \
                or not SHM_DIR.is_dir():
            return None
        ids = torch.zeros(world, dtype=torch.float64)
        ids[rank] = float(host_id())
        group.allreduce_(ids, "all-reduce of the ranks' host ids")
        if not bool((ids == ids[0]).all()):
            return None
        token = group.broadcast_str(uuid.uuid4().hex[:16])
        nbytes = [numel * dtype.itemsize for numel, dtype in sizes]
        offsets = layout(buckets, nbytes, world)
        lengths = [max(_ALIGN, max((o + nbytes[b] for b, o in offs.items()), default=0)) for offs in offsets]
        path = SHM_DIR / f"pivotrl-train-{token}-r{rank}"
        maps: list[mmap.mmap | None] = [None] * world
        ok = torch.ones(1, dtype=torch.float64)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                # Reserve the pages now: a tmpfs too small for the segment (a container's 64 MB /dev/shm)
                # fails here, and the group stays on the process group, instead of a SIGBUS mid-step.
                os.posix_fallocate(fd, 0, lengths[rank])
                maps[rank] = mmap.mmap(fd, lengths[rank])
            finally:
                os.close(fd)
        except OSError:
            ok.zero_()
        group.allreduce_(ok, "shared-memory segments created")
        if int(ok) == world:
            for r in range(world):
                if r == rank:
                    continue
                try:
                    fd = os.open(SHM_DIR / f"pivotrl-train-{token}-r{r}", os.O_RDWR)
                    try:
                        maps[r] = mmap.mmap(fd, lengths[r])
                    finally:
                        os.close(fd)
                except (OSError, ValueError):
                    ok.zero_()
                    break
            ok.fill_(1.0 if all(m is not None for m in maps) else 0.0)
            group.allreduce_(ok, "shared-memory segments mapped")
        with contextlib.suppress(OSError):
            path.unlink()  # every rank mapped it (or gave up): nothing is left in /dev/shm
        if int(ok) != world:
            for m in maps:
                if m is not None:
                    m.close()
            return None
        return cls([m for m in maps if m is not None], offsets, sizes, rank)
