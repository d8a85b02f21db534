"""Bounded staleness: when the next iteration's rollouts may start before the current one has trained.

Why here: whether to start work is a scheduling decision, and core makes every decision. On-policy RL
(k = 0, the paper's setting and the default) has a barrier: iteration i+1 generates with the policy iteration
i trained, so its rollouts wait for i's reward and train tail and the rollout devices idle (or shift). With
k ≥ 1 the barrier moves: iteration j may generate with a policy at most k iterations older than on-policy,
so its rollouts can run on the devices iteration j−1's tail leaves idle, and the GRPO ratio against the
rollout log-probs corrects the gap (verl fully-async, AReaL).

The rule, for iteration j given what has happened so far:
- at most k iterations may be missing between the policy it generates with and on-policy: every iteration
  before j−k has trained (`trained_through ≥ j − k`);
- it starts once the iteration before it has *finished generating* (all its rollouts are done), so the two
  never compete for rollout slots and the older one's tail is never slowed by the newer one's bulk;
- optimizer steps stay in iteration order (an iteration trains once all before it have), so a gradient is
  always taken at the version it is applied to.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InFlight:
    """The driver's facts about its iterations: the next one to start, how many have trained (iterations
    0..trained_through-1 have applied all their optimizer steps), and whether the newest started iteration
    has finished generating."""

    next_iteration: int
    trained_through: int
    newest_rollouts_done: bool


@dataclass(frozen=True)
class StalenessBound:
    """`max_staleness` k: how many iterations a rollout's policy may lag on-policy (0 = on-policy)."""

    max_staleness: int = 0

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def may_start(self, facts: InFlight) -> bool:
        """Whether iteration `facts.next_iteration` may start now."""
        j = facts.next_iteration
        if facts.trained_through >= j:  # everything before it has trained: on-policy, always allowed
            return True
        return facts.newest_rollouts_done and facts.trained_through >= j - self.max_staleness

    def may_train(self, iteration: int, trained_through: int) -> bool:
        """Whether `iteration` may take its optimizer steps: only after every iteration before it."""
        return trained_through >= iteration

    def window(self) -> int:
        """The most iterations in flight at once."""
        return self.max_staleness + 1
