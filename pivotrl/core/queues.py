"""One shared waiting queue per role.

Order: sequences that were aborted (and so carry generated tokens) come before every sequence that was never
started, and within each class the oldest submission first. Putting resumed work first is what makes the tail
shrink after a shift instead of being pushed behind fresh work. A heap keeps push/pop O(log N); removal of an
arbitrary sequence (a lost device's work is re-queued, a sequence cancelled) is lazy.
"""

from __future__ import annotations

import heapq

from pivotrl.core.types import Sequence


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int, str]] = []
        self._live: dict[str, tuple[int, int, str]] = {}
        self._seqs: dict[str, Sequence] = {}
        # what each waiting sequence added to the two sums below when it was pushed: (context, work)
        self._counted: dict[str, tuple[int, float]] = {}
        self.context_tokens = 0  # Σ tokens the waiting sequences prefill when they start (prompt + generated)
        self.work = 0.0  # Σ expected work of the waiting sequences (`Sequence.remaining_estimate`)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._live

    def push(self, seq: Sequence, order: int) -> None:
        """Queue `seq`; `order` is its submission number (smaller = older)."""
        if seq.seq_id in self._live:
            raise ValueError(f"sequence {seq.seq_id} is already waiting")
        key = (0 if seq.aborts > 0 else 1, order, seq.seq_id)
        self._live[seq.seq_id] = key
        self._seqs[seq.seq_id] = seq
        work = seq.remaining_estimate()  # nothing decodes it while it waits (`rework`)
        self._counted[seq.seq_id] = (seq.context_tokens, work)
        self.context_tokens += seq.context_tokens
        self.work += work
        heapq.heappush(self._heap, key)

    def _prune(self) -> None:
        heap = self._heap
        while heap and self._live.get(heap[0][2]) != heap[0]:
            heapq.heappop(heap)

    def peek(self) -> Sequence | None:
        self._prune()
        return self._seqs[self._heap[0][2]] if self._heap else None

    def pop(self) -> Sequence | None:
        self._prune()
        if not self._heap:
            return None
        key = heapq.heappop(self._heap)
        del self._live[key[2]]
        self._uncount(key[2])
        return self._seqs.pop(key[2])

    def remove(self, seq_id: str) -> Sequence | None:
        if seq_id not in self._live:
            return None
        del self._live[seq_id]
        self._uncount(seq_id)
        if len(self._heap) > 2 * len(self._live) + 64:  # compact so stale entries cannot pile up
            self._heap = sorted(self._live.values())
        return self._seqs.pop(seq_id)

    def rework(self, seq: Sequence) -> None:
        """A waiting sequence's expected work changed (a late progress report): keep `work` its sum."""
        if seq.seq_id in self._live:
            context, was = self._counted[seq.seq_id]
            work = seq.remaining_estimate()
            self.work += work - was
            self._counted[seq.seq_id] = (context, work)

    def _uncount(self, seq_id: str) -> None:
        context, work = self._counted.pop(seq_id)
        self.context_tokens -= context
        self.work = self.work - work if self._live else 0.0  # an empty queue owes nothing (no rounding left)

    def ids(self) -> list[str]:
        """Waiting sequence ids in dispatch order (O(N log N); for tests and inspection)."""
        return [k[2] for k in sorted(self._live.values())]

    def values(self) -> list[Sequence]:
        return list(self._seqs.values())
