"""The work-item ledger: where every item is, and the transitions that move it exactly once. No Dask.

Core decides *which* replica runs a sequence; this ledger is the mechanism that gets the item there and
back: into a worker's outbox, delivered, aborted (its partial tokens kept), finished, and for train items
accumulated into a device's local gradient sum and done only when that sum is flushed. Each method is one
transition and returns what happened, so the caller can tell core.

    WAITING ──assign──▶ ASSIGNED ──deliver──▶ RUNNING ──finish──▶ DONE (rollout, reward)
       ▲                   │                     │  └──finish──▶ ACCUMULATED ──flush──▶ DONE (train)
       └────── abort / worker lost (tokens kept) ┘◀───────── worker lost ─────┘

An item dispatched to a new worker while its abort is still in flight on the old one waits for its partial
(`next_worker`), so no item ever runs twice at once, and a late report from a worker the item has left is
ignored, so no result is counted twice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from pivotrl.core import Role, Sequence
from pivotrl.runtime.messages import (
    GradResult,
    ItemResult,
    ItemState,
    Partial,
    Progress,
    WorkItem,
    WorkRequest,
)

_ROLES = {str(r): r for r in Role}  # a role's name → the enum, without the enum's call per item


def sequence_of(req: WorkRequest, generated: int = 0) -> Sequence:
    """The core view of a work item. A train item's work is its token count, "generated" like tokens, and
    known exactly: it is also the item's expected work (without it core would assume half)."""
    if req.role == "train":
        return Sequence(req.id, Role.TRAIN, prompt_tokens=0, max_new_tokens=max(1, req.est_tokens),
                        expected_new_tokens=float(max(1, req.est_tokens)),
                        iteration=req.iteration, group_id=req.group_id)
    return Sequence(req.id, _ROLES.get(req.role) or Role(req.role), prompt_tokens=req.prompt_tokens,
                    max_new_tokens=max(1, req.max_new_tokens), generated=generated,
                    expected_new_tokens=float(req.est_tokens) if req.est_tokens else None,
                    iteration=req.iteration, group_id=req.group_id)


LIVE = (ItemState.WAITING, ItemState.ASSIGNED, ItemState.RUNNING)
ON_WORKER = (ItemState.ASSIGNED, ItemState.RUNNING, ItemState.ACCUMULATED)


@dataclass
class Item:
    request: WorkRequest
    state: ItemState = ItemState.WAITING
    worker: str | None = None
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    attempts: int = 0
    next_worker: str | None = None  # dispatched there while its abort is still in flight

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def role(self) -> str:
        return self.request.role

    @property
    def iteration(self) -> int:
        return self.request.iteration


class ItemLedger:
    def __init__(self) -> None:
        self.items: dict[str, Item] = {}
        self.outbox: dict[str, list[str]] = {}  # worker → ids assigned, not yet delivered
        self.aborts: dict[str, list[str]] = {}  # worker → ids whose abort it must run
        self.results: list[ItemResult] = []
        self.grads: list[GradResult] = []
        # items per (role, state, iteration), kept by `_set`: the scheduler asks whether a role drained
        # after every sync that finishes an item, whether an iteration's train items are all in sums after
        # every train item, and for counts per state in every snapshot; each is a look at these few keys,
        # not a pass over every item
        self._count: Counter[tuple[str, ItemState, int]] = Counter()

    # -- new work -------------------------------------------------------------------------------------
    def add(self, request: WorkRequest) -> Item:
        if request.id in self.items:
            raise ValueError(f"duplicate item id {request.id!r}")
        item = Item(request, generated=list(request.generated), logprobs=list(request.logprobs))
        self.items[request.id] = item
        self._count[item.role, item.state, item.iteration] += 1
        return item

    def _set(self, item: Item, state: ItemState) -> None:
        """Every state change goes through here, so the counts stay exact."""
        self._uncount(item)
        self._count[item.role, state, item.iteration] += 1
        item.state = state

    def _done(self, item: Item) -> None:
        self._uncount(item)
        item.state = ItemState.DONE
        del self.items[item.id]

    def _uncount(self, item: Item) -> None:
        key = (item.role, item.state, item.iteration)
        n = self._count[key] - 1
        if n:
            self._count[key] = n
        else:  # no empty keys: the counts stay as few as the states of the iterations in flight
            del self._count[key]

    # -- placement ------------------------------------------------------------------------------------
    def assign(self, item_id: str, worker: str) -> bool:
        """Put a waiting item in `worker`'s outbox (an undelivered one moves there); an item still running
        (its abort in flight, or asked for now) goes there when its partial comes back. True if it is in
        the outbox now."""
        item = self.items.get(item_id)
        if item is None:
            return False
        if item.state is ItemState.RUNNING:
            self.request_abort(item_id)
            item.next_worker = worker
            return False
        if item.state is ItemState.ASSIGNED:
            if item.worker == worker:
                return True
            self.outbox[item.worker or ""].remove(item_id)
            self._set(item, ItemState.WAITING)
            item.worker = None
        if item.state is not ItemState.WAITING:
            return False
        self._set(item, ItemState.ASSIGNED)
        item.worker = worker
        self.outbox.setdefault(worker, []).append(item_id)
        return True

    def deliver(self, worker: str) -> list[WorkItem]:
        """The worker's outbox, handed over: its items are RUNNING from now on."""
        out = []
        for item_id in self.outbox.pop(worker, ()):
            item = self.items.get(item_id)
            if item is None or item.state is not ItemState.ASSIGNED or item.worker != worker:
                continue
            self._set(item, ItemState.RUNNING)
            out.append(WorkItem(item.id, item.role, item.request.payload, item.iteration,
                                list(item.generated), list(item.logprobs), item.attempts))
        return out

    def redeliver(self, worker: str, ids: Iterable[str]) -> list[str]:
        """Items delivered to `worker` in a reply it never received: back in its outbox, ahead of the rest,
        to go out with its next reply (it never ran them, so their tokens are what they were)."""
        back = [i for i in ids if (it := self.items.get(i)) is not None and it.worker == worker
                and it.state is ItemState.RUNNING]
        for item_id in back:
            self._set(self.items[item_id], ItemState.ASSIGNED)
        if back:
            self.outbox[worker] = [*back, *self.outbox.get(worker, [])]
        return back

    def reabort(self, worker: str, ids: Iterable[str]) -> None:
        """Aborts sent to `worker` in a reply it never received: asked again where the item still runs."""
        for item_id in ids:
            item = self.items.get(item_id)
            if item is not None and item.worker == worker and item.state is ItemState.RUNNING:
                self._queue_abort(item)

    def take_aborts(self, worker: str) -> list[str]:
        return self.aborts.pop(worker, [])

    # -- coming back ----------------------------------------------------------------------------------
    def request_abort(self, item_id: str) -> Item | None:
        """Stop an item where it is. An undelivered one is back to WAITING at once (returned); a running
        one is aborted by its worker, whose partial comes back through `aborted`."""
        item = self.items.get(item_id)
        if item is None or item.worker is None:
            return None
        # Core decides afresh where an aborted item goes: a target an earlier decision gave it while an
        # abort was in flight is stale (that replica may be gone, its worker shifting), and this decision's
        # own dispatch, applied after its aborts, sets the new one.
        item.next_worker = None
        if item.state is ItemState.ASSIGNED:
            box = self.outbox.get(item.worker, [])
            if item_id in box:
                box.remove(item_id)
            self._requeue(item)
            return item
        if item.state is ItemState.RUNNING:
            self._queue_abort(item)
        return None

    def _queue_abort(self, item: Item) -> None:
        """Ask the worker a running item is on to abort it (once)."""
        assert item.worker is not None
        queue = self.aborts.setdefault(item.worker, [])
        if item.id not in queue:
            queue.append(item.id)

    def aborted(self, worker: str, partial: Partial) -> Item | None:
        """A worker handed an item back with its partial tokens: WAITING again (or straight to the worker it
        was dispatched to meanwhile). None for a report about an item the worker no longer holds."""
        item = self.items.get(partial.id)
        if item is None or item.worker != worker or item.state not in (ItemState.RUNNING,
                                                                       ItemState.ASSIGNED):
            return None
        item.generated, item.logprobs = list(partial.generated), list(partial.logprobs)
        self._requeue(item)
        return item

    def progress(self, worker: str, report: Progress) -> Item | None:
        item = self.items.get(report.id)
        if item is None or item.worker != worker or item.state is not ItemState.RUNNING:
            return None
        if report.offset > len(item.generated):
            return None  # a gap: a report was lost; the next abort or finish carries every token
        item.generated[report.offset:] = report.tokens
        item.logprobs[report.offset:] = report.logprobs
        return item

    def finished(self, worker: str, result: ItemResult) -> Item | None:
        """An item finished on `worker`. Generation items are DONE and their result kept for the driver;
        train items are ACCUMULATED until the worker's gradient sum is flushed. None for a late duplicate."""
        item = self.items.get(result.id)
        if item is None or item.worker != worker or item.state not in (ItemState.RUNNING,
                                                                       ItemState.ASSIGNED):
            return None
        if item.state is ItemState.ASSIGNED:
            box = self.outbox.get(worker, [])
            if item.id in box:
                box.remove(item.id)
        item.next_worker = None
        if item.role == "train":
            self._set(item, ItemState.ACCUMULATED)
            return item
        result.role, result.iteration, result.worker = item.role, item.iteration, worker
        self.results.append(result)
        self._done(item)
        return item

    def flushed(self, worker: str, grad: GradResult) -> list[str]:
        """`worker` published its gradient sum: the ACCUMULATED items it covers are DONE. Returns them (an
        item the sum names but the ledger gave to someone else is not counted: it is trained elsewhere)."""
        ids = [i for i in grad.items
               if (it := self.items.get(i)) is not None and it.worker == worker
               and it.state is ItemState.ACCUMULATED]
        for item_id in ids:
            self._done(self.items[item_id])
        if ids:
            grad.items, grad.worker = ids, worker
            self.grads.append(grad)
        return ids

    def undeliver(self, worker: str) -> list[Item]:
        """Take back `worker`'s undelivered assignments (it is shifting): WAITING again."""
        back = []
        for item_id in self.outbox.pop(worker, ()):
            item = self.items.get(item_id)
            if item is not None and item.state is ItemState.ASSIGNED and item.worker == worker:
                self._requeue(item)
                back.append(item)
        self.aborts.pop(worker, None)
        return back

    def worker_lost(self, worker: str) -> list[tuple[Item, bool]]:
        """Every item on a lost worker goes back to WAITING with the tokens last reported; returns each
        with whether it was ACCUMULATED (finished once, but its gradient was never flushed: new work)."""
        self.outbox.pop(worker, None)
        self.aborts.pop(worker, None)
        back = []
        for item in self.items.values():
            if item.next_worker == worker:
                item.next_worker = None
            if item.worker == worker and item.state in ON_WORKER:
                accumulated = item.state is ItemState.ACCUMULATED
                self._requeue(item, follow=False)
                back.append((item, accumulated))
        for item, _ in back:
            self._follow(item)
        return back

    def _requeue(self, item: Item, follow: bool = True) -> None:
        self._set(item, ItemState.WAITING)
        item.worker = None
        item.attempts += 1
        if follow:
            self._follow(item)

    def _follow(self, item: Item) -> None:
        target, item.next_worker = item.next_worker, None
        if target is not None:
            self.assign(item.id, target)

    # -- barriers and views ---------------------------------------------------------------------------
    def flush_holders(self, upto: int) -> set[str]:
        """Workers whose gradient sums hold train items of iterations ≤ `upto`, once no such item is still
        waiting or running anywhere (empty before that)."""
        if any(role == "train" and state in LIVE and it <= upto for role, state, it in self._count):
            return set()
        return {item.worker for item in self.items.values() if item.role == "train" and item.iteration <= upto
                and item.state is ItemState.ACCUMULATED and item.worker is not None}

    def drained(self, roles: Iterable[str]) -> bool:
        """Has one of `roles` no item left waiting, assigned or running?"""
        live = {role for role, state, _ in self._count if state in LIVE}
        return bool(set(roles) - live)

    def counts(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (role, state, _), n in self._count.items():
            c = out.setdefault(role, {})
            c[str(state)] = c.get(str(state), 0) + n
        return out

    def has_output(self) -> bool:
        """Results or gradient sums are waiting for the driver."""
        return bool(self.results or self.grads)

    def take_results(self) -> tuple[list[ItemResult], list[GradResult]]:
        results, grads = self.results, self.grads
        self.results, self.grads = [], []
        return results, grads

    def check(self) -> None:
        """Every outbox entry is an ASSIGNED item of that worker, every ASSIGNED item is in its outbox."""
        boxed = {(w, i) for w, ids in self.outbox.items() for i in ids}
        assert len(boxed) == sum(len(v) for v in self.outbox.values()), "an item is boxed twice"
        for w, i in boxed:
            item = self.items[i]
            assert item.state is ItemState.ASSIGNED and item.worker == w, (i, item.state, item.worker, w)
        recount = Counter((item.role, item.state, item.iteration) for item in self.items.values())
        assert self._count == recount, (dict(self._count), dict(recount))
        for item in self.items.values():
            if item.state is ItemState.ASSIGNED:
                assert (item.worker, item.id) in boxed, item.id
            if item.state is ItemState.WAITING:
                assert item.worker is None, item.id
            if item.state in ON_WORKER:
                assert item.worker is not None, item.id
