"""Whole-iteration makespans of the three plans `pivotrl.core.iteration.choose` weighs, from the stages of
`pivotrl.core.stage`: a static split (and the exhaustive search for the best one), colocated, and the tick
planner at its best; and what moving to a split from the current placement costs.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

import numpy as np

from pivotrl.core.stage import Stage
from pivotrl.core.types import PIPELINE, Role

#: Fractions of an iteration's groups still incomplete at which the train stage's backlog is checked.
GROUP_FRACTIONS = (0.99, 0.95, 0.9, 0.75, 0.5, 0.25, 0.1, 0.03, 0.01, 0.003, 0.001)


def static_makespans(
    st: dict[Role, Stage], reps: dict[Role, np.ndarray], last_end: bool = True
) -> np.ndarray:
    """Predicted makespan of a streaming static split (replicas per role, arrays of equal shape).

    The first stage ends its items by `Stage.emitted`; the second ends each of its tail fractions after the
    matching part of the first (`Stage.after`), and its last item no sooner than `Stage.last_end` says.
    Train items arrive by groups: a group is complete when its slowest member is judged. Two views of when
    a fraction fg of the groups is still incomplete, the later one counts: members submitted together end
    together, `group_lag` after their typical member, i.e. a lag after fg of the judgements remain; or
    members end independently, and a group is complete once all G are, i.e. when only 1 − (1 − fg)^(1/G)
    of the judgements remain (with long-tailed judgements nearly every large group waits for one of the
    last). Train then still has fg of its work to drain. Train ends with the latest of those, its own
    drain, and one step after the last judgement; then it syncs (`Stage.sync`).

    `last_end=False` takes only the cheap part of `Stage.last_end`: never above the full prediction, so
    it bounds a search from below (`best_static`)."""
    ro, rw, tr = (st[r] for r in PIPELINE)
    m_ro, m_rw, m_tr = (np.asarray(reps[r], dtype=float) for r in PIPELINE)
    n = max(ro.seqs, 1.0)
    up = ro.emissions(m_ro)
    g = max(tr.group, 1)
    groups = max(n / g, 1.0)
    fgs = tuple(fg for fg in GROUP_FRACTIONS if fg * groups >= 1.0)   # the fractions holding a group
    independent = tuple(max(1.0 - (1.0 - fg) ** (1.0 / g), 1.0 / n) for fg in fgs)
    starts = rw.admitted(up, m_rw)  # when the judgements can start: both of the next two price from it
    last, *judged = rw.afters(up, m_rw, (1.0 / n, *fgs, *independent), starts)
    t_rw = np.maximum(last, rw.timing(m_rw)[1])
    t_rw = np.maximum(t_rw, rw.last_end(up, m_rw, exact=last_end, starts=starts))
    drain_tr, e_tr = tr.timing(m_tr)
    end = np.maximum(e_tr, t_rw + tr.last_item_s())
    lag = group_lag(ro, rw, m_ro, m_rw, g)
    for fg, together, apart in zip(fgs, judged[: len(fgs)], judged[len(fgs):]):
        end = np.maximum(end, np.maximum(together + lag, apart) + fg * drain_tr)
    return end + tr.sync(m_tr)


def group_lag(ro: Stage, rw: Stage, m_ro: np.ndarray, m_rw: np.ndarray, g: int) -> np.ndarray:
    """Seconds by which a group of `g` items completes after its typical (median) member: its members start
    together, so it waits for the longest of g rollouts and of g judgements, about the lengths exceeded by
    1/(g + 1) of the items, each at its stage's step. 0 for single items and for constant lengths, where a
    group ends with its members (a model that lets members end in random order would keep train waiting
    for nearly all judgements: 0.97 of a perfect static split's speed in tests/sim/test_sanity.py)."""
    shape = np.broadcast(np.asarray(m_ro), np.asarray(m_rw)).shape
    if g <= 1:
        return np.zeros(shape)
    q = np.asarray(1.0 / (g + 1.0))
    half = np.asarray(0.5)
    lag = np.zeros(shape)
    for s, m in ((ro, m_ro), (rw, m_rw)):
        _, _, step = s._batch(m)
        lag = lag + np.maximum(s.length_at(q) - s.length_at(half), 0.0) * step
    return lag


def best_static(st: dict[Role, Stage], n_devices: int) -> tuple[dict[Role, int], float] | None:
    """The split (devices per role) with the lowest predicted makespan, exhaustive over every split into
    whole replicas (numpy over the (rollout, reward) grid; train takes what is left). None if none fits.

    Exact but cheap: every split is priced without `Stage.last_end`'s integral (a lower bound), then the full
    prediction is computed for the splits in order of that bound, a batch at a time, until the best full
    prediction is no worse than the next bound."""
    ro, rw, tr = (st[r] for r in PIPELINE)
    a = np.arange(1, n_devices // ro.g + 1)
    b = np.arange(1, n_devices // rw.g + 1)
    aa, bb = np.meshgrid(a, b, indexing="ij")
    left = n_devices - aa * ro.g - bb * rw.g
    cc = left // tr.g
    ok = cc >= 1
    if not ok.any():
        return None
    reps = {Role.ROLLOUT: aa[ok], Role.REWARD: bb[ok], Role.TRAIN: cc[ok]}
    i, t = ranked(st, reps, 1)[0]
    split = {r: int(reps[r][i]) * st[r].g for r in PIPELINE}
    return split, t


def ranked(st: dict[Role, Stage], reps: dict[Role, np.ndarray], k: int,
           batch: int = 512) -> list[tuple[int, float]]:
    """The `k` splits of `reps` (replicas per role, 1-d arrays) with the lowest full `static_makespans`,
    best first, as (index, prediction): the bound-ordered search `best_static` describes."""
    bound = static_makespans(st, reps, last_end=False)
    order = np.argsort(bound, kind="stable")
    found: list[tuple[float, int]] = []
    for lo in range(0, order.size, batch):
        idx = order[lo : lo + batch]
        if len(found) >= k and found[k - 1][0] <= bound[idx[0]]:
            break
        full = static_makespans(st, {r: v[idx] for r, v in reps.items()})
        found = sorted(found + [(float(x), int(j)) for x, j in zip(full, idx)])[:k]
    return [(j, x) for x, j in found]


def colocated_makespan(st: dict[Role, Stage], n_devices: int) -> float:
    """Every stage alone on the whole cluster in turn, one full-cluster shift before each."""
    total = 0.0
    for s in st.values():
        m = np.asarray(float(max(n_devices // s.g, 1)))
        _, end = s.timing(m)
        total += float(end) + s.shift_s + float(s.sync(m))
    return total


def dynamic_makespan(st: dict[Role, Stage], n_devices: int, static_split: dict[Role, int] | None) -> float:
    """The tick planner at its best: the fluid time plus the shifts its devices make (every device outside
    the first stage's best static share goes there and back, once each per iteration), never below the
    chain of the longest rollout at full batch, one judgement and one train step."""
    fluid = sum(s.work_device_s() for s in st.values()) / n_devices
    first = st[PIPELINE[0]]
    share = (static_split or {}).get(PIPELINE[0], n_devices) / n_devices
    mean_shift = sum(s.shift_s for s in st.values()) / len(st)
    moving = 2.0 * mean_shift * (1.0 - share)
    _, l_ro = first.timing(np.asarray(float(max(n_devices // first.g, 1))))
    chain = float(l_ro) + st[Role.REWARD].last_item_s() + st[Role.TRAIN].last_item_s()
    tr = st[Role.TRAIN]
    sync = float(tr.sync(np.asarray(float(max((static_split or {}).get(Role.TRAIN, n_devices) // tr.g, 1)))))
    return max(fluid + moving, chain) + sync


def moved_makespan(st: dict[Role, Stage], split: dict[Role, int], placed: dict[Role, int],
                   t_split: float) -> float:
    """The predicted makespan of `split` (`t_split` when in place) reached from `placed` (devices per
    role): a replica moved into a role works only after its shift, so over the role's predicted span it
    counts as 1 − shift / span of a replica (none when the shift outlasts the span: a cold shift into a
    short first stage arrives after it)."""
    reps = {r: float(split[r] // st[r].g) for r in PIPELINE}
    first = st[PIPELINE[0]]
    spans = {r: t_split for r in PIPELINE}
    spans[PIPELINE[0]] = float(first.timing(np.asarray(reps[PIPELINE[0]]))[1])
    eff = {}
    for r in PIPELINE:
        moved_in = max(split[r] - placed[r], 0) // st[r].g
        late = min(1.0, st[r].shift_s / max(spans[r], 1e-12))
        eff[r] = np.asarray([max(reps[r] - moved_in * late, 1e-3)])
    return max(t_split, float(static_makespans(st, eff)[0]))


def first_work(st: dict[Role, Stage], split: dict[Role, int]) -> dict[Role, float]:
    """When each downstream role gets its first item on `split`: reward with the first finished rollout,
    train with the first complete group (all of its G members judged)."""
    ro, rw, tr = (st[r] for r in PIPELINE)
    m = {r: np.asarray(float(max(split[r] // st[r].g, 1))) for r in PIPELINE}
    n = max(ro.seqs, 1.0)
    up = ro.emissions(m[Role.ROLLOUT])
    first_rollout = 1.0 - 1.0 / n
    groups = max(n / max(tr.group, 1), 1.0)
    # the first group completes a group lag after the first of its members is judged (`static_makespans`)
    lag = group_lag(ro, rw, m[Role.ROLLOUT], m[Role.REWARD], max(tr.group, 1))
    first_group = max(1.0 - 1.0 / groups, 1.0 / n)
    return {
        Role.REWARD: float(ro.emitted(m[Role.ROLLOUT], first_rollout)),
        Role.TRAIN: float(rw.after(up, m[Role.REWARD], first_group) + lag),
    }
