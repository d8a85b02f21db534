"""One stage of an iteration in the whole-iteration model: when its items end, alone or fed by the stage
before it.

Why a model of its own: `pivotrl.core.iteration` predicts whole-iteration plans from these per-stage
answers (`pivotrl.core.makespan`), and each answer — when the short items end, when a late-arriving item
ends, when the last one can — is a separate, testable claim about continuous batching: a step costs
a + b·(work in the batch), an item takes one step per token, a prompt's prefill pauses its replica.
Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pivotrl.core.types import PIPELINE, Role

#: Fractions f at which a length profile holds the length exceeded by a fraction f of the items. With the
#: longest item they describe where a stage's tail is: the items that end a stage are the long ones that
#: started late, and those are counted per fraction (`Stage.points`). The two above the median say when
#: the short items end: with every item in one batch, nine tenths are still running until the shortest
#: tenth is decoded, not a tenth of the drain in (`Stage.emitted`).
TAIL_FRACTIONS = (0.9, 0.75, 0.5, 0.25, 0.1, 0.03, 0.01, 0.003, 0.001, 3e-4, 1e-4, 3e-5, 1e-5)
MEDIAN = TAIL_FRACTIONS.index(0.5)

#: Time steps of `Stage.last_end`'s integral (its error is under half a step of the stage's span).
LAST_END_STEPS = 48

#: Levels of the distribution of the longest item's length that `Stage.end_spread` reads.
LONGEST_LEVELS = tuple((j + 0.5) / 8 for j in range(8))

#: Rounds of slots `Stage.admitted` looks back one by one; beyond them only the earliest round counts.
ADMISSION_ROUNDS = 6


def arrived_at(counts: np.ndarray, times: np.ndarray, items: np.ndarray) -> np.ndarray:
    """When the `items`-th item arrived, piecewise linear between the points (`counts[j]` items arrived by
    `times[j]`, counts increasing; times has one row per point and a column per split)."""
    j = np.clip(np.searchsorted(counts, items, side="right") - 1, 0, counts.size - 2)
    lo, hi = counts[j], counts[j + 1]
    t_lo = np.take_along_axis(times, j[None], 0)[0]
    t_hi = np.take_along_axis(times, (j + 1)[None], 0)[0]
    w = np.clip((items - lo) / np.maximum(hi - lo, 1e-12), 0.0, 1.0)
    return t_lo + w * (t_hi - t_lo)


def arrival_points(up_emitted: dict[float, np.ndarray], n: float,
                   shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The upstream curve `up_emitted` (fraction still running -> when) as `arrived_at`'s points: items
    arrived by each point, from none at 0, and the times (one row per point, `shape` per row)."""
    fas = sorted(up_emitted, reverse=True)
    counts = np.asarray([0.0] + [(1.0 - fa) * n for fa in fas])
    times = np.stack([np.zeros(shape)] + [np.broadcast_to(up_emitted[fa], shape) for fa in fas])
    return counts, times


Segment = tuple[np.ndarray | float, np.ndarray, float]  # (start, end, share of the items arriving between)


def arrival_segments(arrivals: tuple[tuple[np.ndarray, float], ...]
                     ) -> tuple[list[Segment], np.ndarray | float, float]:
    """The `arrivals` points ((s, fs): all but fs arrived by s) as segments from all to come at 0, in
    order: (start, end, share of the items arriving between), and (the last point's time, the share
    still to come after it)."""
    segments = []
    prev_s: np.ndarray | float = 0.0
    prev_f = 1.0
    for s, fs in sorted(arrivals, key=lambda p: -p[1]):
        segments.append((prev_s, s, max(prev_f - fs, 0.0)))
        prev_s, prev_f = s, min(prev_f, fs)
    return segments, prev_s, prev_f


def still_to_come(tau: np.ndarray, arrivals: tuple[tuple[np.ndarray, float], ...]) -> np.ndarray:
    """The fraction of a stage's items not yet arrived at `tau`, piecewise linear between the `arrivals`
    points from all to come at 0; none after the last point. Each segment takes off its share as `tau`
    crosses it."""
    out = np.ones(np.shape(tau))
    segments, last, _ = arrival_segments(arrivals)
    for start, end, share in segments:
        out = out - share * np.clip((tau - start) / np.maximum(end - start, 1e-12), 0.0, 1.0)
    return np.where(tau > last, 0.0, np.clip(out, 0.0, 1.0)) if arrivals else out


def tail_lengths(lengths: np.ndarray) -> tuple[float, ...]:
    """The lengths exceeded by each of `TAIL_FRACTIONS` of `lengths` (empty for no lengths)."""
    if lengths.size == 0:
        return ()
    q = np.quantile(lengths, [1.0 - f for f in TAIL_FRACTIONS])
    return tuple(float(x) for x in q)


def length_at_fraction(fs: np.ndarray, ls: np.ndarray, f: np.ndarray) -> np.ndarray:
    """The length exceeded by a fraction `f` of the items of a length profile given as points (a fraction
    `fs[i]` of the items is at least `ls[i]` long, `fs` decreasing), log-interpolated between the points and
    clamped at their ends."""
    x = np.log(np.clip(f, fs[-1], 1.0))
    return np.interp(-x, -np.log(fs), ls)


@dataclass(frozen=True)
class Stage:
    """One role's iteration work in the model's terms (see `stages`)."""

    role: Role
    g: int
    seqs: float
    mean: float  # tokens per item
    longest: float  # tokens of the longest item
    a: float
    b: float
    k: float  # work per item per step (1 for decode, an item's tokens for train)
    cap: float  # items per replica at once
    shift_s: float  # seconds for a device to take up this role
    decode: bool  # a generation stage: an item takes one step per token
    prefill_s: float = 0.0  # seconds one replica pauses to prefill one item's prompt
    tail: tuple[float, ...] = ()  # lengths at TAIL_FRACTIONS (empty: only the mean and the longest known)
    group: int = 1  # items per group (the train stage's items arrive by whole groups)
    sync_fixed_s: float = 0.0  # after the stage's last item: sync(m) = fixed + shared / m (`RoleSpec`)
    sync_shared_s: float = 0.0
    dp_per_doubling: float = 1.0  # a replica's speed kept per doubling of replicas (`RoleSpec`; train)
    dp_ref: float = 1.0  # the replica count `a` and `b` were measured at (1: the prior, one replica's line)

    def dp_speed(self, m: np.ndarray) -> np.ndarray:
        """A train replica's speed with `m` replicas, relative to its speed at `dp_ref`: data-parallel
        replicas slow each other down, by `dp_per_doubling` per doubling. `timing` applies it to the train
        stage only; generation replicas run independently."""
        if self.dp_per_doubling >= 1.0:
            return np.ones(np.shape(m))
        doublings = np.log2(np.maximum(np.asarray(m, dtype=float), 1.0)) - math.log2(max(self.dp_ref, 1.0))
        return np.power(self.dp_per_doubling, doublings)

    def step(self, conc: np.ndarray) -> np.ndarray:
        return self.a + self.b * self.k * conc

    def sync(self, m: np.ndarray) -> np.ndarray:
        """Seconds between the stage's last item and the next iteration with `m` replicas."""
        return self.sync_fixed_s + self.sync_shared_s / np.maximum(np.asarray(m, dtype=float), 1.0)

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """(f, length): a fraction f of the items is at least `length` long, for the tail fractions that
        hold at least one item, down to the longest (f = 1 / seqs)."""
        n = max(self.seqs, 1.0)
        known = zip(TAIL_FRACTIONS, self.tail) if self.tail else [(0.5, self.mean)]
        fs, ls = [], []
        for f, x in known:
            if f * n > 1.0:
                fs.append(f)
                ls.append(x)
        fs.append(1.0 / n)
        ls.append(self.longest)
        return np.asarray(fs), np.maximum.accumulate(np.asarray(ls, dtype=float))

    @cached_property
    def longest_spread(self) -> np.ndarray:
        """How far the longest of the stage's n items may be from `longest`, in tokens: its length at
        `LONGEST_LEVELS` of its distribution (P(longest ≤ x) = (1 − f(x))^n, f read off the tail, past
        the 1/n point where the profile knows it), less their mean. Centred, so that pricing over it
        keeps the expected end and adds only the chance that the last item ends before or after
        something else (`end_spread`)."""
        n = max(self.seqs, 1.0)
        pts = [(1.0 / (n + 1.0), self.longest)]
        known = zip(TAIL_FRACTIONS, self.tail) if self.tail else [(0.5, self.mean)]
        pts += [(f, x) for f, x in known if f < 1.0]
        pts.sort(key=lambda p: -p[0])
        fs = np.asarray([p[0] for p in pts])
        ls = np.maximum.accumulate(np.asarray([p[1] for p in pts], dtype=float))
        want = -np.log(np.asarray(LONGEST_LEVELS)) / n  # 1 − p^(1/n), for n large
        x = np.interp(-np.log(want), -np.log(fs), ls)  # past either end: that end's length
        return x - x.mean()

    @cached_property
    def end_spread(self) -> tuple[float, ...]:
        """Seconds by which the stage's last item may end before or after its expected end, one per level
        of `longest_spread`: the tokens by which the longest item is longer or shorter are its last ones,
        decoded after every other item has ended, so alone, at one item's step."""
        lone = float(self.step(np.asarray(1.0)))
        return tuple(float(d) * lone for d in self.longest_spread)

    def length_at(self, f: np.ndarray) -> np.ndarray:
        """The length exceeded by a fraction `f` of the items (log-interpolated between the points)."""
        return length_at_fraction(*self.points(), f)

    def _batch(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        m = np.maximum(np.asarray(m, dtype=float), 1e-12)
        per = np.maximum(self.seqs / m, 1.0)  # items per replica
        conc = np.minimum(self.cap, per)
        return per, conc, self.step(conc)

    def timing(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(drain time of all its work, end time of its last item) with `m` replicas, items spread evenly
        and all available at once.

        Drain: every item's tokens at the full batch's rate, plus each item's prompt prefill, which pauses
        its replica (`prefill_s`). The items past the first batch start while the queue drains (the queued
        part of the drain, `q`); of the f·n items at least `length_at(f)` long, the last starts at about
        q·(1 − 1/(f·n + 1)) and then takes one step per token at the full batch's step time, after the
        first batch's prefill. A stage ends with its drain or with the latest of those (for the longest
        item alone: halfway through the queued part, as measured on the paper reconstruction's rollout).
        """
        per, conc, step = self._batch(m)
        m = np.maximum(np.asarray(m, dtype=float), 1e-12)
        rate = np.minimum(m, max(self.seqs, 1.0)) * conc * self.k / step  # work per second
        if not self.decode:
            speed = self.dp_speed(m)
            drain = self.seqs * self.mean / np.maximum(rate * speed, 1e-300)
            return drain, drain + step / speed
        drain = self.seqs * self.mean / np.maximum(rate, 1e-300)  # tokens over tokens/s
        drain = drain + per * self.prefill_s
        q = self.queued_until(drain, per, conc)
        first = conc * self.prefill_s
        end = drain
        fs, ls = self.points()
        n = max(self.seqs, 1.0)
        for f, length in zip(fs, ls):
            start = q * (1.0 - 1.0 / (f * n + 1.0))
            end = np.maximum(end, start + self.run_s(start, length, drain, per, conc) + first)
        return drain, end

    def queued_until(self, drain: np.ndarray, per: np.ndarray, conc: np.ndarray) -> np.ndarray:
        """When a replica starts its last queued item (0 if all of its `per` items fit one batch): the
        fluid share of the drain, 1 − conc / per of it, or, for the first stage, the renewal estimate
        where that is later.

        A slot frees only when its item ends. The first stage's items are all there at 0 and its first
        wave starts together, so by renewal theory a slot has ended x items after about
        mean · (x + (1 − cv²) / 2) steps (cv: the lengths' coefficient of variation; for x < 1 no later
        than the shortest x of the first wave), and every one of the `per` prompts has been prefilled by
        then, the first wave's too (the fluid share charges only its own share of them). On random draw
        45 (4 rollout replicas of 680 items, 256 at once, cv² 1.08) that puts the last start at 4.0 s
        against the simulator's 4.4 s; the fluid share said 3.3 s. Never before the fluid share: where
        lengths vary more, short items free their slots early, by more than the asymptote can say. Not
        for a downstream stage: its items arrive over the upstream's span and its slots do not cycle in
        step (applied to the judge stage too, random draw 21 went from 0.998 to 0.963 of its baseline)."""
        fluid = np.maximum(0.0, 1.0 - conc / per) * drain
        if not self.decode or self.role is not PIPELINE[0]:
            return fluid
        x = np.maximum(per - conc, 0.0) / np.maximum(conc, 1e-12)  # items a slot ends before the last starts
        steps = self.mean * (x + 0.5 * (1.0 - self._cv2))
        steps = np.where(x < 1.0, np.minimum(steps, self.length_at(np.clip(1.0 - x, 1e-12, 1.0))), steps)
        renewal = np.maximum(steps, 0.0) * self.step(conc) + self.prefill_s * per
        return np.where(per > conc, np.maximum(fluid, renewal), fluid)

    @cached_property
    def _survival(self) -> tuple[np.ndarray, np.ndarray]:
        """(x, `longer_than`(x)) on a grid from 0 to the longest item: what the length integrals read."""
        x = np.linspace(0.0, self.longest, 257)
        return x, self.longer_than(x)

    @cached_property
    def _moments(self) -> tuple[float, float]:
        """E[length] and E[length²] of the length profile (integrals of `longer_than`)."""
        x, p = self._survival
        return float(np.trapezoid(p, x)), float(np.trapezoid(2.0 * x * p, x))

    @cached_property
    def _cv2(self) -> float:
        """The squared coefficient of variation of the length profile."""
        first, second = self._moments
        return second / max(first * first, 1e-12) - 1.0

    def mean_position(self) -> float:
        """Tokens an item has generated before a decoded token, averaged over all decoded tokens:
        E[L(L − 1)] / (2 E[L]). A long item decodes more of the tokens, so this is past half the mean
        length by cv² / 2 of it; the batch's context per row, less its prompt."""
        first, second = self._moments
        return max(0.0, 0.5 * (second / max(first, 1e-12) - 1.0))

    def run_s(self, start: np.ndarray, length: float | np.ndarray, drain: np.ndarray, per: np.ndarray,
              conc: np.ndarray) -> np.ndarray:
        """Seconds an item of `length` tokens takes from `start` on a replica that drains its `per` items
        in `drain` seconds. With step = a + b·x, any span of steps takes a·steps + b·(tokens decoded in
        it): the item's `length` steps, and the tokens its batch decodes meanwhile — at most a full batch
        per step, and no more than the replica has left at `start` (a long item that outlives its batch
        runs alone at the short step of a small batch, where a full batch's step would price its tail
        ~25 % slow)."""
        left = per * self.mean * np.maximum(0.0, 1.0 - start / np.maximum(drain, 1e-12))
        return self.run_with(left, length, conc)

    def run_with(self, left: np.ndarray, length: float | np.ndarray, conc: np.ndarray) -> np.ndarray:
        """Seconds an item of `length` tokens takes on a replica with `left` tokens of other work to do
        meanwhile, in batches of at most `conc` (`run_s`)."""
        work = np.minimum(conc * length, np.maximum(length, left))
        return self.a * length + self.b * self.k * work

    def max_length_within(self, seconds: np.ndarray, left: np.ndarray, conc: np.ndarray) -> np.ndarray:
        """The longest item `run_with` finishes within `seconds` (its inverse: the run is piecewise linear
        and increasing in the length)."""
        a, bk = self.a, self.b * self.k
        x = np.maximum(seconds, 0.0)
        batched = x / (a + bk * conc)  # the batch decodes beside it all along
        outlived = (x - bk * left) / a  # the replica's other work ends before it
        alone = x / (a + bk)  # longer than all the other work: the rest of it runs alone
        return np.where(batched * conc <= left, batched, np.where(outlived <= left, outlived, alone))

    def longer_than(self, length: np.ndarray) -> np.ndarray:
        """The fraction of items longer than `length` (`length_at`'s inverse; linear from 1 at length 0
        to the first point, 0 from the longest on)."""
        fs, ls = self.points()
        x = np.asarray(length, dtype=float)
        f = np.exp(np.interp(x, ls, np.log(fs)))
        below = 1.0 - (1.0 - fs[0]) * np.clip(x / max(float(ls[0]), 1e-12), 0.0, 1.0)
        return np.where(x >= ls[-1], 0.0, np.where(x < ls[0], below, f))

    def emitted(self, m: np.ndarray, f: float) -> np.ndarray:
        """When all but a fraction `f` of the items have ended (the f·n last to end are still running): the
        drain's share of them, or, for each point (fp, length) with fp ≥ f, the (f·n)-th latest start
        among the fp·n items at least `length` long (q·(1 − f·n / (fp·n + 1)), starts uniform over the
        queued part q) plus its run (`run_s`). f = 1/n gives `timing`'s end."""
        return self._emitted(f, *self._queue(m))

    def emissions(self, m: np.ndarray) -> dict[float, np.ndarray]:
        """`emitted` at each of the stage's length points: the upstream curve `after` takes."""
        queue = self._queue(m)
        fs, _ = self.points()
        return {float(f): self._emitted(float(f), *queue) for f in fs}

    def _queue(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(drain, items per replica, batch, `queued_until`) with `m` replicas: what every `_emitted` call
        reads, computed once for all of a caller's fractions."""
        drain, _ = self.timing(m)
        per, conc, _ = self._batch(m)
        return drain, per, conc, self.queued_until(drain, per, conc)

    def _emitted(self, f: float, drain: np.ndarray, per: np.ndarray, conc: np.ndarray,
                 q: np.ndarray) -> np.ndarray:
        if f * max(self.seqs, 1.0) <= 1.0 + 1e-9:
            f = 0.0  # the last item: the whole drain
        if not self.decode:
            return drain * (1.0 - f)
        n = max(self.seqs, 1.0)
        out = drain * (1.0 - f)
        fs, ls = self.points()
        for fp, length in zip(fs, ls):
            if fp * n >= f * n - 1e-9:
                start = q * np.maximum(0.0, 1.0 - max(f * n, 1.0) / (fp * n + 1.0))
                run = self.run_s(start, length, drain, per, conc)
                out = np.maximum(out, start + run + conc * self.prefill_s)
        return out

    def after(self, up_emitted: dict[float, np.ndarray], m: np.ndarray, f: float) -> np.ndarray:
        """When all but a fraction `f` of this stage's items have ended, its items arriving as the upstream
        stage ends them (`up_emitted`: upstream fraction fa -> when all but fa of them have ended): of the
        fa·n last to arrive, a fraction f/fa is at least `length_at(f/fa)` long and runs after its
        prefill, beside the work its replica has left then (`left_at`: what arrives with it or later, and
        what the replica could not have done by then), and paused by the prefills of the items reaching
        its replica after the first of those f·n long items, on average fa·f·n / (f·n + 1) of them, until it
        ends (`paused_by_arrivals`: a burst of arrivals pauses the replica once per prompt). Nor can the
        fa·n items be done sooner than their share of the drain after their arrival begins, nor the first
        1 − f before they arrive. Never before its own emission with every item available."""
        return self.afters(up_emitted, m, (f,))[0]

    def afters(self, up_emitted: dict[float, np.ndarray], m: np.ndarray,
               fs: tuple[float, ...], starts: dict[float, np.ndarray] | None = None) -> list[np.ndarray]:
        """`after` at each of `fs`, the stage's drain and batch computed once for all of them; `starts` is
        `admitted(up_emitted, m)` when the caller has it already."""
        drain, per, conc, q = self._queue(m)
        n = max(self.seqs, 1.0)
        if starts is None:
            starts = self.admitted(up_emitted, m)
        arrivals = tuple((t, fa) for fa, t in starts.items())
        lefts = {fa: self.left_at(t, fa, per, drain, arrivals) for fa, t in starts.items()}
        first = max(starts)  # the earliest arrivals' point: all but `first` arrived by then
        out = []
        for f in fs:
            own = self._emitted(f, drain, per, conc, q)
            if f > first:  # an item ends after it arrives: 1 − f of them arrive by then, linearly from 0
                own = np.maximum(own, starts[first] * (1.0 - f) / max(1.0 - first, 1e-12) + self.prefill_s)
            for fa, t in starts.items():
                if fa >= f:
                    length = self.length_at(np.asarray(f / fa))
                    run = self.run_with(lefts[fa], length, conc) + self.prefill_s
                    behind = fa * f * n / (f * n + 1.0)  # still to come when the first long item arrives
                    paused = self.paused_by_arrivals(t, run, fa, behind, per, conc, drain, arrivals)
                    own = np.maximum(own, t + run + paused)
                    own = np.maximum(own, t + (fa - f) * drain)
            out.append(own)
        return out

    def paused_by_arrivals(self, t: np.ndarray, run: np.ndarray, fa: float, behind: float, per: np.ndarray,
                           conc: np.ndarray, drain: np.ndarray,
                           arrivals: tuple[tuple[np.ndarray, float], ...]) -> np.ndarray:
        """Seconds an item starting at `t`, with a fraction `fa` of the stage's items still to come and
        `behind` of them after it, is paused over its `run` (decode alone) by other items' prefills: a
        replica prefills a prompt when it admits it, and its whole batch waits meanwhile. It admits the
        items reaching it before the item ends (of the `behind`), but no more than its free slots at `t`
        (its batch `conc` less the items that came before, if none has ended) and the slots that free
        meanwhile, at its drain's rate (a prefill share ρ of its time; ρ ≤ 0.9). Two rounds of the fixed
        point in the arrivals (each pause lets more items arrive before the end). Why: a judge replica
        handed its rollouts in a burst prefills them all while its first judgements wait; on random draw
        18 (54 judgements per replica arriving within 1.3 s, 3.4 s of prefill) the model's judgements
        ended 2.5 s before the simulator's, and it ranked a split with fewer train replicas best."""
        free = np.maximum(conc - (1.0 - fa) * per, 0.0)
        rho = np.minimum(per * self.prefill_s / np.maximum(drain, 1e-12), 0.9)  # the drain's prefill share
        slots = self.prefill_s * free + run * rho
        slots = slots / (1.0 - rho)  # the fixed point of pause = prefill · (free + (run + pause) · rate)
        pause = np.zeros(np.shape(t))
        for _ in range(2):
            come = np.maximum(behind - still_to_come(t + run + pause, arrivals), 0.0) * per
            pause = np.minimum(self.prefill_s * come, slots)
        return pause

    def left_at(self, t: np.ndarray, fa: float, per: np.ndarray, drain: np.ndarray,
                arrivals: tuple[tuple[np.ndarray, float], ...] = ()) -> np.ndarray:
        """Tokens a replica still has to decode when an item reaching it at `t` starts, with a fraction
        `fa` of the stage's items still to come: at least those, and at least what it could not have
        decoded by `t` at its full rate since its work began arriving. `arrivals` holds (s, fs): by time
        s no more than 1 − fs of its items had arrived, so by `t` it has done at most that and what its
        full rate decodes in t − s, if any (a fluid queue's output; s = 0, fs = 1 without `arrivals`).

        Why at least what was done before: where items take longer than the upstream stage's whole span
        (long judgements after short rollouts), the early ones are still running when the last arrive,
        and a late long item runs beside them; counting only what is still to come priced it alone, and
        the judge stage's end hardly followed the rollouts' end (random draw 117: 4 s in the simulator
        between two splits, 0.6 s the wrong way in the model). Why from the arrivals, not from 0: the
        judge's work begins with the first rollouts' ends, not at the iteration's start, so counting from
        0 made a later rollout end leave the judge less work and the judge's end followed the rollouts'
        at a third of their delay (random draw 418: rollouts 8.5 s later moved the predicted end by 3.3 s,
        the simulator's by 7.5 s, and the model ranked the split with the slowest rollouts best)."""
        mine = per * self.mean
        out = fa * mine
        rate = mine / np.maximum(drain, 1e-12)
        for s, fs in ((0.0, 1.0), *arrivals):  # every item arrives at 0 or later
            out = np.maximum(out, fs * mine - rate * np.maximum(t - s, 0.0))
        if arrivals and self.decode:
            out = np.maximum(out, mine * (1.0 - self._decoded_since(t, arrivals)))
        return out

    def _decoded_since(self, t: np.ndarray, arrivals: tuple[tuple[np.ndarray, float], ...]) -> np.ndarray:
        """The most of a replica's work decoded by `t` (a fraction), its items arriving no sooner than
        `arrivals` says (the items after 1 − fs arrive at s or later), each decoding at most one token a
        step and a step taking at least a + b (one row): an item that arrived at s has at most
        E[min(L, (t − s) / step)] of its tokens done. Why: the full rate counts a replica's whole batch
        decoding from its first arrival, where a judge replica holds a tenth of its items then. On random
        draw 6 (7 / 50 / 5) a judgement arriving with the rollouts' second wave, at 18 s, was priced beside
        159k tokens of its replica's 214k; one token a step since each arrival leaves at least 183k."""
        lone = max(self.a + self.b * self.k, 1e-12)
        segments, last, rest = arrival_segments(arrivals)
        done = rest * self.decoded_fraction(np.maximum(t - last, 0.0) / lone)
        for start, _, share in segments:
            done = done + share * self.decoded_fraction(np.maximum(t - start, 0.0) / lone)
        return done

    @cached_property
    def _decoded_curve(self) -> tuple[np.ndarray, np.ndarray]:
        """(steps x, E[min(L, x)] / E[L]) on a grid to the longest item (integrals of `longer_than`)."""
        x, p = self._survival
        cum = np.concatenate(([0.0], np.cumsum(0.5 * (p[1:] + p[:-1]) * np.diff(x))))
        return x, cum / max(float(cum[-1]), 1e-12)

    def decoded_fraction(self, steps: np.ndarray) -> np.ndarray:
        """The fraction of its tokens an item has decoded on average after `steps` steps (1 past the
        longest item)."""
        x, frac = self._decoded_curve
        return np.interp(steps, x, frac)

    def admitted(self, up_emitted: dict[float, np.ndarray], m: np.ndarray) -> dict[float, np.ndarray]:
        """When the items arriving as all but a fraction fa of the upstream's have ended can start: on
        arrival, or, where the stage is the bottleneck, once a slot frees.

        The stage's m·conc slots hold the first arrivals; an item stays in its slot a sojourn W (its mean
        length at the full batch's step, plus the prefills its replica makes meanwhile: one per slot),
        so the item numbered N starts no sooner than W after item N − m·conc started, and by induction
        no sooner than k·W after item N − k·m·conc arrived, for every k (`arrived_at` between the
        upstream points). Slots free in whole rounds: a fluid rate n / drain from the first arrivals
        prices a saturated judge stage's late items as starting ~6 s too early (random draw 48, 9
        four-device judge replicas: items arriving at 13 s start at 20 s, two rounds after the items
        that arrived at 5 s)."""
        n = max(self.seqs, 1.0)
        _, conc, _ = self._batch(m)
        m = np.maximum(np.asarray(m, dtype=float), 1e-12)
        fas = sorted(up_emitted, reverse=True)
        shape = np.broadcast(m, *(np.asarray(up_emitted[fa]) for fa in fas)).shape
        counts, times = arrival_points(up_emitted, n, shape)
        slots = np.broadcast_to(np.minimum(m * conc, n), shape)
        sojourn = np.broadcast_to(self.mean * self.step(conc) + conc * self.prefill_s, shape)
        out = {}
        for i, fa in enumerate(fas, start=1):
            start = times[i]
            rounds = np.floor(counts[i] / slots)
            deepest = min(ADMISSION_ROUNDS, int(np.max(rounds)))  # past it every k repeats k = rounds
            for k in (*range(1, deepest + 1), None):
                kk = rounds if k is None else np.minimum(float(k), rounds)
                earlier = counts[i] - kk * slots
                start = np.maximum(start, arrived_at(counts, times, earlier) + kk * sojourn)
            out[fa] = start
        return out

    def last_end(self, up_emitted: dict[float, np.ndarray], m: np.ndarray, exact: bool = True,
                 starts: dict[float, np.ndarray] | None = None,
                 drain: np.ndarray | None = None) -> np.ndarray:
        """When this stage's last item ends, its items arriving on the upstream curve in an order that has
        nothing to do with their own lengths (a judgement's length does not depend on when its rollout
        ended).

        The stage ends at max_i (start_i + run_i), an item starting on arrival or when a slot frees
        (`admitted`). `after` pairs each arrival window with the longest
        item it is expected to hold, as if that item came first in its window; so it hardly sees how late
        the upstream stage runs. Here the expected number of items still running at T (each arrival bin's
        count times the fraction of lengths that would not be done by T) is E(T), the chance that none is
        exp(−E(T)) (Poisson), and the expected end is the integral of 1 − exp(−E) over T. Never before the
        longest item itself, starting at the mean start time: that alone with `exact=False` (cheap, and
        never above the full value). `starts`: `admitted(up_emitted, m)` and `drain`: `timing(m)`'s drain,
        when the caller has them."""
        n = max(self.seqs, 1.0)
        per, conc, _ = self._batch(m)
        if starts is None:
            starts = self.admitted(up_emitted, m)
        fas = sorted(starts, reverse=True)
        bins: list[tuple[float, np.ndarray, float]] = []  # (items, start time, fraction still to come)
        prev_f, prev_t = 1.0, np.zeros(np.shape(starts[fas[0]]))
        for fa in fas:
            t = starts[fa]
            bins.append(((prev_f - fa) * n, 0.5 * (prev_t + t), prev_f))
            prev_f, prev_t = fa, t
        bins.append((prev_f * n, prev_t, prev_f))
        longest_run = self.run_with(0.5 * per * self.mean, self.longest, conc)
        arrival = sum(count * t for count, t, _ in bins) / n
        longest_end = arrival + self.prefill_s * (1.0 + 0.25 * per) + longest_run
        if not exact:
            return longest_end
        hi = prev_t + self.prefill_s * (1.0 + 0.5 * per) + self.run_with(per * self.mean, self.longest, conc)
        if drain is None:
            drain = self.timing(m)[0]
        # per bin, what does not change with the horizon: its items, start, prefills and the work beside them
        arrivals = tuple((starts[fa], fa) for fa in fas)
        terms = [(count, t, self.prefill_s * (1.0 + 0.5 * fa * per),
                  self.left_at(t, fa, per, drain, arrivals)) for count, t, fa in bins]
        dt = hi / LAST_END_STEPS
        end = np.zeros(np.shape(hi))
        for k in range(LAST_END_STEPS):
            horizon = (k + 0.5) * dt
            running = np.zeros(np.shape(hi))
            for count, t, prefill, left in terms:
                budget = horizon - t - prefill
                done_by = self.max_length_within(budget, left, conc)
                running = running + count * np.where(budget > 0.0, self.longer_than(done_by), 1.0)
            end = end + (1.0 - np.exp(-running)) * dt
        return np.maximum(end, longest_end)

    def last_item_s(self) -> float:
        """An item started alone after its upstream finished (the tail end of the chain)."""
        one = float(self.step(np.asarray(1.0)))
        return self.mean * one + self.prefill_s if self.decode else one

    def peak_weight(self) -> float:
        """Device-seconds per unit of work at full batch."""
        return self.g * float(self.step(np.asarray(self.cap))) / (self.cap * self.k)

    def work_device_s(self) -> float:
        """Device-seconds of the stage's whole work at full batch, prefill included."""
        return self.seqs * (self.mean * self.peak_weight() + self.g * self.prefill_s)
