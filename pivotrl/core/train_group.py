"""Who trains together at a step, and which part of the model each of them owns: pure decisions.

The runtime (`pivotrl.runtime.train_group`) executes these: it forms a `torch.distributed` group of the
plan's members, all-reduces gradient sums in the plan's buckets and steps the optimizer shard each rank
owns. Nothing here knows about torch, Dask or the store, so the rules are property-tested on their own
(tests/core/test_train_group_plan.py).

Why ownership is by whole tensors (contiguous runs of the model's parameter order) and not by an even
cut of the flat index space: a rank that owns whole tensors can write them to the parameter store as
complete, checksummed tensors of the store's existing format (one array per rank, one manifest committed
by rank 0), and its optimizer state is a set of named tensors that a new rank of a re-formed group fetches
by name — reading only the byte ranges it needs. The price is balance: a shard is at most the largest
tensor away from the even cut (for a transformer, the embedding), which `shard_ranges` minimises.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainGroupPlan:
    """Group `group_id` of `members` (rank r is `members[r]`), first formed for optimizer step `step`."""

    group_id: int
    members: tuple[str, ...]
    step: int

    @property
    def world(self) -> int:
        return len(self.members)

    def rank_of(self, device: str) -> int:
        """The rank of `device`; ValueError when it is not a member."""
        return self.members.index(device)


def decide_group(current: TrainGroupPlan | None, devices: Iterable[str], step: int) -> TrainGroupPlan:
    """The group for `step` given the devices in the train role at its barrier.

    Members are sorted by name, so every device computes the same ranks. The current group is kept when
    its membership is unchanged (forming a group costs a rendezvous); any change gives a new group id, so
    a collective of the old group can never be mistaken for one of the new.
    """
    members = tuple(sorted(set(devices)))
    if not members:
        raise ValueError("a train group needs at least one device")
    if current is not None and current.members == members:
        return current
    return TrainGroupPlan(group_id=0 if current is None else current.group_id + 1, members=members, step=step)


def shard_ranges(sizes: Sequence[int], k: int) -> list[range]:
    """Cut tensors of `sizes` elements (in model order) into `k` contiguous runs, one per rank.

    The runs partition `range(len(sizes))` (some may be empty when k exceeds the tensor count). Boundary r
    is the tensor boundary nearest to r/k of the elements, kept monotone; so each run's size is within
    one tensor of the even cut. Deterministic: every rank computes the same cut.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if any(s < 0 for s in sizes):
        raise ValueError("tensor sizes must be >= 0")
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + int(s))
    total = prefix[-1]
    cuts = [0]
    j = 0
    for r in range(1, k):
        target = total * r / k
        while j < n and prefix[j + 1] <= target:
            j += 1
        # j: the last boundary at or below target; j + 1 the first above it. Take the nearer one.
        best = j + 1 if j < n and prefix[j + 1] - target < target - prefix[j] else j
        cuts.append(max(cuts[-1], min(best, n)))
    cuts.append(n)
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def buckets(sizes: Sequence[int], bucket_elems: int) -> list[range]:
    """Consecutive tensors grouped into all-reduce buckets of at most `bucket_elems` elements (a larger
    tensor is a bucket alone). Why buckets: one collective per tensor pays its latency ~200 times; one
    for the whole model needs a second model-sized buffer."""
    if bucket_elems < 1:
        raise ValueError(f"bucket_elems must be >= 1, got {bucket_elems}")
    out: list[range] = []
    start, fill = 0, 0
    for i, s in enumerate(sizes):
        if i > start and fill + s > bucket_elems:
            out.append(range(start, i))
            start, fill = i, 0
        fill += s
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def owner_of(ranges: Sequence[range], index: int) -> int:
    """The rank whose run holds tensor `index`."""
    for r, run in enumerate(ranges):
        if index in run:
            return r
    raise ValueError(f"tensor {index} is in no run")


def owner_buckets(runs: Sequence[range], sizes: Sequence[int], bucket_elems: int) -> list[tuple[int, range]]:
    """The reduce-scatter's buckets: each rank's run (`shard_ranges`) cut by `buckets`, as (owner, tensor
    range) in model order. A bucket never spans two owners, so each goes whole to the one rank that steps
    its tensors; every rank computes the same list, so the k-1 messages of a bucket match by position."""
    out: list[tuple[int, range]] = []
    for r, run in enumerate(runs):
        for b in buckets([sizes[i] for i in run], bucket_elems):
            out.append((r, range(run.start + b.start, run.start + b.stop)))
    return out
