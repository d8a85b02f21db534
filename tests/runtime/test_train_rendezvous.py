"""The scheduler-side rendezvous: one live formation per policy; a new formation never finds the old one's
key-value store, even for the same members and group id."""

from __future__ import annotations

import asyncio

from pivotrl.runtime.train_plugin import TrainRendezvous


def test_a_new_formation_waits_for_its_own_address() -> None:
    async def go() -> None:
        rv = TrainRendezvous()
        plan = rv.plan("policy", 0, ["b", "a"])
        assert plan.members == ("a", "b") and rv.plan("policy", 5, ["a", "b"]) is plan
        rv.post("policy", "t1", "h:1")
        assert await rv.lookup("policy", "t1", 1.0) == "h:1"
        waiting = asyncio.create_task(rv.lookup("policy", "t2", 5.0))  # same group, a new formation
        await asyncio.sleep(0)
        assert not waiting.done()
        rv.post("policy", "t2", "h:2")
        assert await waiting == "h:2"
        assert await rv.lookup("policy", "t1", 0.05) is None  # the old formation is gone
        assert await rv.lookup("other", "t2", 0.05) is None

    asyncio.run(go())
