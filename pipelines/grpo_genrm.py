"""GRPO with a generative reward model, written as explicit pipeline stages. Copy this file and edit it.

    python pipelines/grpo_genrm.py configs/quickstart.yaml --mode shiftable --workers 2
    python pipelines/grpo_genrm.py configs/quickstart.yaml --verifier-mix 0.5   # add a rule-based stage

Stages run where they say: `RolloutStage` on rollout devices (the policy writes), `GenRMRewardStage` on
reward devices (the judge writes a critique and a verdict, parsed into a reward), `AdvantageStage` in the
driver once a whole group is judged, `TrainStage` on train devices (elastic gradient sums; the driver takes
`train.minibatches` optimizer steps per iteration, one per slice of the samples). The runtime moves devices
between the roles while the iteration streams.
To add a stage, subclass `pivotrl.pipeline.Stage` (see `LengthPenalty` below) and put it in the list.
"""

from __future__ import annotations

import argparse
import sys

from pivotrl.config import add_override_argument, load_config
from pivotrl.errors import UserError
from pivotrl.pipeline import (
    AdvantageStage,
    GenRMRewardStage,
    RolloutStage,
    RuleVerifierStage,
    Sample,
    Stage,
    StageContext,
    TrainStage,
)
from pivotrl.run import run_pipeline


class LengthPenalty(Stage):
    """A driver-side stage: discourage responses that ran into the token limit without stopping."""

    name = "length_penalty"

    def __init__(self, penalty: float) -> None:
        self.penalty = penalty

    def run(self, samples: list[Sample], ctx: StageContext) -> None:
        for s in samples:
            if s.finish_reason == "length":
                s.reward = (s.reward or 0.0) - self.penalty


def build_stages(verifier_mix: float = 0.0, length_penalty: float = 0.0) -> list[Stage]:
    stages: list[Stage] = [RolloutStage(), GenRMRewardStage()]
    if verifier_mix > 0:
        stages.append(RuleVerifierStage(mix=verifier_mix))
    if length_penalty > 0:
        stages.append(LengthPenalty(length_penalty))
    return [*stages, AdvantageStage(), TrainStage()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--mode", choices=["colocated", "disaggregated", "shiftable"])
    ap.add_argument("--workers", type=int)
    ap.add_argument("--scheduler")
    add_override_argument(ap)
    ap.add_argument("--verifier-mix", type=float, default=0.0, help="weight of a rule-based verifier reward")
    ap.add_argument("--length-penalty", type=float, default=0.0)
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, overrides=args.overrides)
        res = run_pipeline(cfg, mode=args.mode, workers=args.workers, scheduler=args.scheduler,
                           stages=build_stages(args.verifier_mix, args.length_penalty))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"done: {len(res.iterations)} iterations, {len(res.shifts)} shifts, metrics in {res.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
