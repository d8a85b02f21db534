"""The Dask wiring of the paired plugins, in one process (distributed's `gen_cluster`): the handlers turn
plain messages into typed ones, the worker plugin's role host syncs over the worker's own RPC, and a
session of another id is told to stand by."""

from __future__ import annotations

import asyncio

from distributed.utils_test import gen_cluster

from pivotrl.core.types import ShiftTimings
from pivotrl.runtime.messages import Collected, ShiftDone, SyncReply, SyncReport, WorkRequest
from pivotrl.runtime.scheduler_plugin import PivotSchedulerPlugin
from pivotrl.runtime.worker_plugin import PivotWorkerPlugin
from tests.runtime.fakes import token
from tests.runtime.test_mechanism import manual, specs


async def collect_until(c, ids: set[str], timeout_s: float = 30.0) -> dict:
    got: dict = {}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not ids <= set(got):
        out = Collected.from_wire(await c.scheduler.pivotrl_collect())
        for r in out.results:
            assert r.id not in got
            got[r.id] = r
        assert loop.time() < deadline, sorted(ids - set(got))
        await asyncio.sleep(0.02)
    return got


async def rollout_and_reward_workers(c, s) -> PivotSchedulerPlugin:
    """Install the paired plugins (core's manual policy) and wait until the two workers hold rollout and
    reward; returns the scheduler's plugin."""
    await c.register_plugin(PivotSchedulerPlugin(manual(["rollout", "reward"]), specs(), tick_s=0.05,
                                                 session="t"))
    await c.register_plugin(PivotWorkerPlugin(session="t", pin_cores=False, idle_poll_s=0.005))
    plugin = s.plugins["pivotrl"]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while sorted(w.role or "" for w in plugin.orch.workers.values()) != ["reward", "rollout"]:
        assert loop.time() < deadline, {w.name: (w.role, w.status) for w in plugin.orch.workers.values()}
        await asyncio.sleep(0.02)
    return plugin


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=90)
async def test_plugins_run_items_and_shift_through_the_handlers(c, s, a, b):
    plugin = await rollout_and_reward_workers(c, s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    items = [WorkRequest(f"x{i}", "rollout", {"target_len": 7}, max_new_tokens=7).to_wire() for i in range(6)]
    assert await c.scheduler.pivotrl_submit(items=items) == 6
    got = await collect_until(c, {f"x{i}" for i in range(6)})
    assert all(r.generated == [token(i, j) for j in range(7)] for i, r in got.items())
    assert {r.worker for r in got.values()} == {w.addr for w in plugin.orch.workers.values()
                                                if w.role == "rollout"}
    judge = next(w.addr for w in plugin.orch.workers.values() if w.role == "reward")
    shift_id = await c.scheduler.pivotrl_shift(worker=judge, role="train")
    assert shift_id
    while plugin.orch.workers[judge].role != "train":
        assert loop.time() < deadline + 30
        await asyncio.sleep(0.02)
    done = [e for e in plugin.orch.events if e["kind"] == "shift_done" and e["shift"] == shift_id]
    assert done and done[0]["src"] == "reward" and done[0]["total"] == sum(done[0]["timings"].values())


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_a_sync_from_another_session_is_told_to_stand_by(c, s, a):
    await c.register_plugin(PivotSchedulerPlugin(manual(["rollout"]), specs(), session="mine"))
    stranger = SyncReport(worker=a.address, session="theirs").to_wire()
    reply = SyncReply.from_wire(await c.scheduler.pivotrl_sync(report=stranger))
    assert reply.unknown and not reply.assign and reply.shift is None
    own = SyncReply.from_wire(await c.scheduler.pivotrl_sync(report={**stranger, "session": "mine"}))
    assert not own.unknown and own.shift is not None and own.shift.role == "rollout"


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=90)
async def test_a_collect_is_held_until_output_arrives_and_no_longer(c, s, a, b):
    """`pivotrl_collect(wait_s)` returns as soon as a result is there, holds an empty call up to `wait_s`,
    and returns at once while output waits."""
    await rollout_and_reward_workers(c, s)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    empty = Collected.from_wire(await c.scheduler.pivotrl_collect(wait_s=0.3))
    assert not empty.results and loop.time() - t0 >= 0.29
    item = WorkRequest("y0", "rollout", {"target_len": 3}, max_new_tokens=3).to_wire()
    await c.scheduler.pivotrl_submit(items=[item])
    t0 = loop.time()
    out = Collected.from_wire(await c.scheduler.pivotrl_collect(wait_s=20.0))
    held = loop.time() - t0
    assert [r.id for r in out.results] == ["y0"] and held < 0.5  # not the 1 s cap: the result woke it
    # output that waits already is handed over without holding the call
    await c.scheduler.pivotrl_submit(items=[{**item, "id": "y1"}])
    while not s.plugins["pivotrl"].orch.ledger.has_output():
        await asyncio.sleep(0.005)
    t0 = loop.time()
    out = Collected.from_wire(await c.scheduler.pivotrl_collect(wait_s=20.0))
    assert [r.id for r in out.results] == ["y1"] and loop.time() - t0 < 0.5


async def ready_by_hand(c, s, worker: str, role: str = "rollout") -> PivotSchedulerPlugin:
    """The scheduler plugin alone (no worker plugin): `worker` is driven by hand through its first shift
    and is then a ready `role` host with free slots."""
    await c.register_plugin(PivotSchedulerPlugin(manual([role]), specs(), tick_s=0.05, session="h"))
    first = SyncReply.from_wire(await c.scheduler.pivotrl_sync(report=SyncReport(worker, "h").to_wire()))
    assert first.shift is not None and first.shift.role == role
    done = ShiftDone(first.shift.id, role, None, ShiftTimings())
    report = SyncReport(worker, "h", free=8, shift_done=done, acked=first.seq).to_wire()
    ready = SyncReply.from_wire(await c.scheduler.pivotrl_sync(report=report))
    assert ready.empty()
    plugin = s.plugins["pivotrl"]
    assert plugin.orch.workers[worker].role == role
    return plugin


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_an_idle_hosts_sync_is_held_until_work_arrives(c, s, a):
    """A sync asking for a hold returns when an item is dispatched to its host, not at the hold's end; the
    item's reply is acknowledged like any other (the empty reply that was never sent costs nothing)."""
    plugin = await ready_by_hand(c, s, a.address)
    loop = asyncio.get_running_loop()
    idle = SyncReport(a.address, "h", free=8, hold_s=5.0, acked=0).to_wire()
    held = asyncio.ensure_future(c.scheduler.pivotrl_sync(report=idle))
    await asyncio.sleep(0.3)
    assert not held.done()  # nothing to do: the reply waits
    t0 = loop.time()
    await c.scheduler.pivotrl_submit(items=[WorkRequest("h0", "rollout", {"target_len": 2},
                                                        max_new_tokens=2).to_wire()])
    reply = SyncReply.from_wire(await held)
    assert [i.id for i in reply.assign] == ["h0"] and loop.time() - t0 < 1.0
    # acknowledging that reply redelivers nothing: the item stays running where it went
    after = SyncReport(a.address, "h", free=7, acked=reply.seq).to_wire()
    again = SyncReply.from_wire(await c.scheduler.pivotrl_sync(report=after))
    assert again.empty()
    assert plugin.orch.ledger.items["h0"].worker == a.address
    assert not [e for e in plugin.orch.events if e["kind"] == "redeliver"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)], timeout=60)
async def test_a_held_sync_ends_at_its_hold_the_cap_or_a_command(c, s, a):
    """With nothing to do a held sync answers empty after its hold (never longer than the cap); a reply
    with a command is never held; closing the plugin answers held syncs at once."""
    from pivotrl.runtime.scheduler_plugin import MAX_SYNC_HOLD_S

    plugin = await ready_by_hand(c, s, a.address)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    reply = SyncReply.from_wire(await c.scheduler.pivotrl_sync(
        report=SyncReport(a.address, "h", free=8, hold_s=0.3).to_wire()))
    assert reply.empty() and 0.29 <= loop.time() - t0 < 0.29 + MAX_SYNC_HOLD_S
    assert 0.29 <= reply.held_s <= loop.time() - t0  # the host counts this part as idle, not blocked
    t0 = loop.time()
    reply = SyncReply.from_wire(await c.scheduler.pivotrl_sync(
        report=SyncReport(a.address, "h", free=8, hold_s=1e6).to_wire()))
    assert reply.empty() and loop.time() - t0 < MAX_SYNC_HOLD_S + 0.5
    # a shift asked for while the host is not syncing reaches it with its next sync, held or not
    shift_id = await c.scheduler.pivotrl_shift(worker=a.address, role="reward")
    t0 = loop.time()
    reply = SyncReply.from_wire(await c.scheduler.pivotrl_sync(
        report=SyncReport(a.address, "h", free=8, hold_s=5.0).to_wire()))
    assert reply.shift is not None and reply.shift.id == shift_id and loop.time() - t0 < 1.0
    # a shift asked for during the hold ends it
    done = ShiftDone(shift_id, "reward", "rollout", ShiftTimings())
    await c.scheduler.pivotrl_sync(report=SyncReport(a.address, "h", free=8, shift_done=done,
                                                     acked=reply.seq).to_wire())
    held = asyncio.ensure_future(c.scheduler.pivotrl_sync(
        report=SyncReport(a.address, "h", free=8, hold_s=5.0).to_wire()))
    await asyncio.sleep(0.2)
    assert not held.done()
    t0 = loop.time()
    second = await c.scheduler.pivotrl_shift(worker=a.address, role="rollout")
    reply = SyncReply.from_wire(await held)
    assert reply.shift is not None and reply.shift.id == second and loop.time() - t0 < 1.0
    # closing the plugin answers a held sync now
    held = asyncio.ensure_future(c.scheduler.pivotrl_sync(
        report=SyncReport(a.address, "h", free=8, hold_s=5.0).to_wire()))
    await asyncio.sleep(0.2)
    t0 = loop.time()
    await plugin.close()
    await held
    assert loop.time() - t0 < 1.0
