"""The Dask wiring of the paired plugins, in one process (distributed's `gen_cluster`): the handlers turn
plain messages into typed ones, the worker plugin's role host syncs over the worker's own RPC, and a
session of another id is told to stand by."""

from __future__ import annotations

import asyncio

from distributed.utils_test import gen_cluster

from pivotrl.runtime.messages import Collected, SyncReply, SyncReport, WorkRequest
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
