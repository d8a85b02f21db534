"""What a controller has learned about the cluster, as plain data a run checkpoint can hold.

Why: a resumed run must not start planning from priors again. The shift-cost model (what moving a device
between two roles costs here), the per-role step-time fits (how fast each role decodes or trains at a given
batch) and the last iteration's measured profile (where its tail was) took whole iterations to learn;
without them the first iterations after a resume shift as a fresh run would, on guesses. `learned_state`
reads them off a `Controller`; `restore_learned` puts them back into a new one. Plain JSON-compatible
values only (strings, numbers, lists, dicts), so the checkpoint file stays readable and versionable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pivotrl.core.iteration import IterationProfile, RoleProfile
from pivotrl.core.throughput import checked_prefill_statistics
from pivotrl.core.types import Role

if TYPE_CHECKING:
    from pivotrl.core.controller import Controller
    from pivotrl.core.throughput import ThroughputModel

FORMAT = 1


def _role(name: str | None) -> Role | None:
    return None if name is None else Role(name)


@dataclass(frozen=True)
class LearnedState:
    """The learned parts of a controller. `shift_pairs`: (from role or None, to role, mean seconds,
    samples, phase means); `shift_to`: mean seconds per target role; `fits`: per role the throughput
    model's fitted line and its sufficient statistics; `last_profile`: the last finished iteration."""

    shift_pairs: tuple[tuple[str | None, str, float, int, dict[str, float]], ...]
    shift_to: tuple[tuple[str, float], ...]
    fits: tuple[tuple[str, dict[str, Any]], ...]
    last_profile: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "shift_pairs": [list(p) for p in self.shift_pairs],
                "shift_to": [list(p) for p in self.shift_to], "fits": [list(f) for f in self.fits],
                "last_profile": self.last_profile}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LearnedState:
        """Validates shape and role names; a malformed record is a `ValueError` naming the part."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"learned controller state: expected format {FORMAT}")
        try:
            pairs = tuple((p[0], str(Role(p[1])), float(p[2]), int(p[3]), {str(k): float(v)
                          for k, v in p[4].items()}) for p in data["shift_pairs"])
            for p in pairs:
                _role(p[0])
            to = tuple((str(Role(r)), float(s)) for r, s in data["shift_to"])
            fits = tuple((str(Role(r)), _fit(f)) for r, f in data["fits"])
            prof = data["last_profile"]
            if prof is not None:
                _profile(prof)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise ValueError(f"learned controller state: malformed ({e})") from None
        return cls(pairs, to, fits, prof)


def _fit(f: dict[str, Any]) -> dict[str, Any]:
    out = {"a": float(f["a"]), "b": float(f["b"]), "tokens_per_seq_step": float(f["tokens_per_seq_step"]),
           "s": [float(x) for x in f["s"]][:5], "kx": [float(x) for x in f["kx"]][:2],
           "samples": int(f["samples"])}
    if "pf" in f:  # the prefill estimate (absent from checkpoints written before it)
        out["pf"] = checked_prefill_statistics(f["pf"])
    return out


def _profile(p: dict[str, Any]) -> IterationProfile:
    # [count, mean, max] (older checkpoints) or [count, mean, max, tail, prompt_mean]
    roles = {Role(r): RoleProfile(int(v[0]), float(v[1]), float(v[2]),
                                  tuple(float(x) for x in (v[3] if len(v) > 3 else ())),
                                  float(v[4]) if len(v) > 4 else 0.0) for r, v in p["roles"].items()}
    shift = {Role(r): float(v) for r, v in p["shift_in_s"].items()}
    return IterationProfile(int(p["iteration"]), float(p["makespan_s"]), str(p["mode"]),
                            float(p["predicted_s"]), roles, shift)


def _fit_state(m: ThroughputModel) -> dict[str, Any]:
    sums, kx, samples = m.statistics()
    return {"a": m.a, "b": m.b, "tokens_per_seq_step": m.tokens_per_seq_step, "s": sums, "kx": kx,
            "samples": samples, "pf": m.prefill_statistics()}


def learned_state(ctl: Controller) -> LearnedState:
    """What `ctl` has learned so far."""
    sc = ctl.shift_costs
    by_pair, by_destination = sc.averages()
    pairs = tuple((None if f is None else str(f), str(t), float(v), int(sc.samples.get((f, t), 0)),
                   dict(sc.phases.get((f, t), {}))) for (f, t), v in sorted(
        by_pair.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))))
    to = tuple((str(r), float(v)) for r, v in sorted(by_destination.items(), key=lambda kv: str(kv[0])))
    fits = tuple((str(r), _fit_state(m)) for r, m in ctl.state.role_models.items())
    last = ctl.profiles[-1] if ctl.profiles else None
    prof = None if last is None else {
        "iteration": last.iteration, "makespan_s": last.makespan_s, "mode": last.mode,
        "predicted_s": last.predicted_s,
        "roles": {str(r): [p.count, p.mean_tokens, p.max_tokens, list(p.tail), p.prompt_mean]
                  for r, p in last.roles.items()},
        "shift_in_s": {str(r): v for r, v in last.shift_in_s.items()}}
    return LearnedState(pairs, to, fits, prof)


def restore_learned(ctl: Controller, state: LearnedState) -> None:
    """Put `state` into a fresh controller: shift costs, step-time fits (for roles it has), and the last
    profile, which the first `begin_iteration` hands the policy as the iteration that just ended."""
    sc = ctl.shift_costs
    for f, t, v, n, phases in state.shift_pairs:
        sc.restore_pair((_role(f), Role(t)), v, n, phases)
    for t, v in state.shift_to:
        sc.restore_destination(Role(t), v)
    for r, f in state.fits:
        m = ctl.state.role_models.get(Role(r))
        if m is not None:
            m.restore_statistics(f["s"], f["kx"], f["samples"])
            if "pf" in f:  # checkpoints before the prefill estimate have none: it is relearned
                m.restore_prefill_statistics(f["pf"])
    if state.last_profile is not None:
        ctl.profiles.append(_profile(state.last_profile))
        ctl.resumed_profile = ctl.profiles[-1]


__all__ = ["LearnedState", "learned_state", "restore_learned"]
