"""The train group's pure rules: membership → ranks, tensor runs per rank, all-reduce buckets."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pivotrl.core.train_group import buckets, decide_group, owner_buckets, owner_of, shard_ranges
from tests.core._hyp import CI

sizes_st = st.lists(st.integers(0, 10_000), min_size=0, max_size=60)


@CI
@given(sizes=sizes_st, k=st.integers(1, 16))
def test_shard_ranges_partition_the_tensors(sizes: list[int], k: int) -> None:
    runs = shard_ranges(sizes, k)
    assert len(runs) == k
    assert [i for run in runs for i in run] == list(range(len(sizes)))
    total = sum(sizes)
    biggest = max(sizes, default=0)
    at = 0
    for r, run in enumerate(runs):
        at += sum(sizes[i] for i in run)
        # every boundary is within one tensor of the even cut
        assert abs(at - total * (r + 1) / k) <= biggest + 1e-9


@CI
@given(sizes=sizes_st, k=st.integers(1, 16))
def test_owner_of_agrees_with_the_runs(sizes: list[int], k: int) -> None:
    runs = shard_ranges(sizes, k)
    for i in range(len(sizes)):
        assert i in runs[owner_of(runs, i)]


def test_even_sizes_are_cut_evenly() -> None:
    assert shard_ranges([5] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert shard_ranges([1, 100, 1], 2) in ([range(0, 1), range(1, 3)], [range(0, 2), range(2, 3)])


@CI
@given(sizes=sizes_st, cap=st.integers(1, 20_000))
def test_buckets_cover_in_order_and_respect_the_cap(sizes: list[int], cap: int) -> None:
    bs = buckets(sizes, cap)
    assert [i for b in bs for i in b] == list(range(len(sizes)))
    for b in bs:
        assert len(b) >= 1
        assert len(b) == 1 or sum(sizes[i] for i in b) <= cap


@CI
@given(sizes=sizes_st, k=st.integers(1, 6), cap=st.integers(1, 20_000))
def test_owner_buckets_cover_in_order_within_one_owner(sizes: list[int], k: int, cap: int) -> None:
    runs = shard_ranges(sizes, k)
    bs = owner_buckets(runs, sizes, cap)
    assert [i for _, b in bs for i in b] == list(range(len(sizes)))
    for owner, b in bs:
        assert len(b) >= 1 and all(owner_of(runs, i) == owner for i in b)  # never two owners
        assert len(b) == 1 or sum(sizes[i] for i in b) <= cap


@CI
@given(devs=st.lists(st.sampled_from([f"w{i}" for i in range(6)]), min_size=1, max_size=8),
       more=st.lists(st.sampled_from([f"w{i}" for i in range(6)]), min_size=1, max_size=8))
def test_a_new_group_only_when_membership_changes(devs: list[str], more: list[str]) -> None:
    g = decide_group(None, devs, step=0)
    assert g.group_id == 0 and list(g.members) == sorted(set(devs))
    assert [g.rank_of(d) for d in g.members] == list(range(g.world))
    same = decide_group(g, reversed(devs), step=3)
    assert same is g
    nxt = decide_group(g, more, step=4)
    if set(more) == set(devs):
        assert nxt is g
    else:
        assert nxt.group_id == 1 and nxt.step == 4 and nxt.world == len(set(more))
