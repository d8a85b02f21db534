"""The item ledger alone: each transition, and random interleavings of every transition (hypothesis) that
must never run an item twice at once, never count a result twice, and train every train item exactly once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.runtime.items import LIVE, ItemLedger
from pivotrl.runtime.messages import (
    GradResult,
    GradStats,
    ItemResult,
    ItemState,
    Partial,
    Progress,
    WorkRequest,
)


def req(i: str, role: str = "rollout", it: int = 0) -> WorkRequest:
    return WorkRequest(i, role, {}, iteration=it)


def grad(ids: list[str]) -> GradResult:
    return GradResult("g", 0, list(ids), GradStats(tokens=len(ids), samples=len(ids), version=0))


def test_assign_deliver_finish() -> None:
    led = ItemLedger()
    led.add(req("a"))
    assert led.assign("a", "w0")
    assert led.assign("a", "w0")  # again: nothing changes
    assert led.assign("a", "w1")  # undelivered: it moves
    assert led.deliver("w0") == []
    assert led.assign("a", "w0")
    [w] = led.deliver("w0")
    assert w.id == "a" and led.items["a"].state is ItemState.RUNNING
    assert led.progress("w0", Progress("a", 0, [5, 6], [-1.0, -1.0])) is not None
    assert led.progress("w1", Progress("a", 0, [9], [-1.0])) is None  # not its item
    assert led.finished("w1", ItemResult("a", [1])) is None
    assert led.finished("w0", ItemResult("a", [5, 6, 7], [-1.0] * 3)) is not None
    assert led.finished("w0", ItemResult("a", [5, 6, 7])) is None  # a late duplicate
    results, _ = led.take_results()
    assert [(r.id, r.worker, r.role) for r in results] == [("a", "w0", "rollout")]
    led.check()


def test_abort_in_flight_goes_to_the_next_worker_with_its_tokens() -> None:
    led = ItemLedger()
    led.add(req("a"))
    led.assign("a", "w0")
    led.deliver("w0")
    assert led.request_abort("a") is None  # running: the worker aborts it
    assert not led.assign("a", "w1")  # dispatched elsewhere while the abort is in flight
    assert led.take_aborts("w0") == ["a"]
    led.aborted("w0", Partial("a", [1, 2], [-0.1, -0.2]))
    assert led.items["a"].state is ItemState.ASSIGNED and led.items["a"].worker == "w1"
    [w] = led.deliver("w1")
    assert w.generated == [1, 2] and w.attempt == 1
    led.check()


def test_a_later_abort_drops_the_target_an_earlier_dispatch_gave_an_item_in_flight() -> None:
    """Core moved a running item to w1, then (before its partial came back) aborted it again and kept it
    waiting: w1 may be shifting to another role by then. The partial must come back to WAITING, for core
    to place, not follow the stale target into w1's outbox (where a shifting worker lost it: a hung run)."""
    led = ItemLedger()
    led.add(req("a"))
    led.assign("a", "w0")
    led.deliver("w0")
    assert not led.assign("a", "w1")  # migrating: the abort is in flight, w1 is the target
    assert led.request_abort("a") is None  # a later decision aborts it again and dispatches it nowhere
    led.aborted("w0", Partial("a", [1], [-0.1]))
    assert led.items["a"].state is ItemState.WAITING and led.items["a"].worker is None
    assert led.deliver("w1") == []
    assert led.assign("a", "w2")  # core places it when it can
    [w] = led.deliver("w2")
    assert w.generated == [1]
    led.check()


def test_items_of_a_lost_reply_go_out_again_first_and_their_aborts_are_asked_again() -> None:
    led = ItemLedger()
    for i in "abc":
        led.add(req(i))
        led.assign(i, "w0")
    lost = [w.id for w in led.deliver("w0")]
    led.add(req("d"))
    led.assign("d", "w0")  # a newer assignment, not yet delivered
    led.finished("w0", ItemResult("b", [1]))  # b did reach the worker (an earlier reply's, say)
    assert led.redeliver("w0", lost) == ["a", "c"]  # b is done: nothing to send again
    assert [w.id for w in led.deliver("w0")] == ["a", "c", "d"]
    led.reabort("w0", ["a", "b", "zz"])  # only what still runs there
    assert led.take_aborts("w0") == ["a"]
    led.check()


def test_train_items_are_done_only_when_their_sum_is_flushed() -> None:
    led = ItemLedger()
    for i in range(3):
        led.add(req(f"t{i}", "train"))
        led.assign(f"t{i}", "w0")
    led.deliver("w0")
    led.finished("w0", ItemResult("t0"))
    led.finished("w0", ItemResult("t1"))
    assert led.flush_holders(0) == set()  # t2 still running
    led.finished("w0", ItemResult("t2"))
    assert led.flush_holders(0) == {"w0"}
    assert led.flushed("w0", grad(["t0", "t1", "t2"])) == ["t0", "t1", "t2"]
    assert not led.items


def test_a_lost_worker_gives_back_accumulated_items_as_new_work() -> None:
    led = ItemLedger()
    led.add(req("t0", "train"))
    led.assign("t0", "w0")
    led.deliver("w0")
    led.finished("w0", ItemResult("t0"))
    [(item, accumulated)] = led.worker_lost("w0")
    assert item.id == "t0" and accumulated and item.state is ItemState.WAITING
    assert led.flushed("w0", grad(["t0"])) == []  # a sum from the dead worker never counts


OPS = st.lists(st.tuples(st.sampled_from(["assign", "deliver", "abort", "return", "finish", "lose",
                                          "flush", "undeliver", "progress"]),
                         st.integers(0, 7), st.integers(0, 2)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(1, 8))
def test_random_interleavings_keep_every_item_exactly_once(ops, n_items) -> None:
    led = ItemLedger()
    ids = [f"i{k}" for k in range(n_items)]
    for k, i in enumerate(ids):
        led.add(req(i, "train" if k % 2 else "rollout", it=k % 3))
    held: dict[str, set[str]] = {}  # what each worker really runs (delivered, not handed back)
    sums: dict[str, list[str]] = {}  # a worker's unflushed gradient sum
    done: list[str] = []

    def run(op: str, k: int, w: int) -> None:
        worker = f"w{w}"
        item_id = ids[k % n_items]
        if op == "assign":
            led.assign(item_id, worker)
        elif op == "deliver":
            for wi in led.deliver(worker):
                assert all(wi.id not in h for h in held.values()), "delivered while running elsewhere"
                held.setdefault(worker, set()).add(wi.id)
        elif op == "abort":
            led.request_abort(item_id)
        elif op == "return":
            for i in led.take_aborts(worker):
                if i in held.get(worker, set()):
                    held[worker].discard(i)
                    led.aborted(worker, Partial(i, [1], [-1.0]))
        elif op == "finish":
            if item_id in held.get(worker, set()):
                held[worker].discard(item_id)
                if led.finished(worker, ItemResult(item_id)) is not None and led.items.get(item_id):
                    sums.setdefault(worker, []).append(item_id)
        elif op == "lose":
            held.pop(worker, None)
            sums.pop(worker, None)
            led.worker_lost(worker)
        elif op == "flush":
            if sums.get(worker):
                done.extend(led.flushed(worker, grad(sums.pop(worker))))
        elif op == "undeliver":
            led.undeliver(worker)
        elif op == "progress" and item_id in held.get(worker, set()):
            led.progress(worker, Progress(item_id, 0, [3], [-1.0]))
        led.check()  # includes: the per-role counts equal a recount of the items
        for role in ("train", "rollout"):
            live = any(it.role == role and it.state in LIVE for it in led.items.values())
            assert led.drained([role]) is not live
        for upto in range(3):  # against a pass over every item, as the ledger once computed it
            train = [it for it in led.items.values() if it.role == "train" and it.iteration <= upto]
            want = set() if any(it.state in LIVE for it in train) else {
                it.worker for it in train if it.state is ItemState.ACCUMULATED}
            assert led.flush_holders(upto) == want

    for op, k, w in ops:
        run(op, k, w)
    # settle: every worker gives back what it holds, then one worker runs everything to the end
    for w in range(3):
        run("return", 0, w)
        for i in list(held.get(f"w{w}", ())):
            held[f"w{w}"].discard(i)
            led.aborted(f"w{w}", Partial(i))
        led.undeliver(f"w{w}")
        if sums.get(f"w{w}"):
            done.extend(led.flushed(f"w{w}", grad(sums.pop(f"w{w}"))))
    for _ in range(4):
        for i in list(led.items):
            led.assign(i, "w9")
        for wi in led.deliver("w9"):
            led.finished("w9", ItemResult(wi.id))
        for i in led.take_aborts("w9"):
            led.aborted("w9", Partial(i))
    done.extend(led.flushed("w9", grad([i for i, it in led.items.items()
                                        if it.state is ItemState.ACCUMULATED])))
    results, grads = led.take_results()
    finished = [r.id for r in results] + done
    assert sorted(finished) == sorted(ids), (finished, {i: it.state for i, it in led.items.items()})
    assert not led.items
    assert sum(len(g.items) for g in grads) == len(done)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(tokens=st.integers(0, 100_000))
def test_a_train_items_work_is_its_token_count_for_core(tokens: int) -> None:
    """A train item's size is known exactly: core counts all of it as work to do, not half a budget."""
    from pivotrl.runtime.items import sequence_of

    s = sequence_of(WorkRequest("t", "train", {}, est_tokens=tokens))
    assert s.remaining_estimate() == max(1, tokens)
