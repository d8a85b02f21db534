"""The GRPO recipe in one process: the runtime's pipeline over a `LocalSession` instead of a Dask cluster.

Why it exists: a run that needs no cluster (tests, a laptop, debugging a stage) — and, because it is the
same `Pipeline`, stages, role contexts, optimizer owner and per-iteration driver (`run_iterations`) as
`pivotrl.run.run_pipeline`, a reference the distributed run is checked against
(tests/test_recipe_equivalence.py). Only the executor differs: every role's context lives here and is
stepped round-robin; weights still go through a real parameter store.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class LoopResult:
    initial_accuracy: float  # held-out greedy accuracy under the verifier, a fraction
    final_accuracy: float
    history: list[dict[str, Any]] = field(default_factory=list)  # the meter's rows, one per iteration
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (iterations done, elapsed_s, acc)

    @property
    def gain_points(self) -> float:
        return 100.0 * (self.final_accuracy - self.initial_accuracy)

    def to_json(self) -> dict[str, Any]:
        return {
            "initial_accuracy": self.initial_accuracy,
            "final_accuracy": self.final_accuracy,
            "accuracy_gain_points": self.gain_points,
            "curve": [{"iteration": i, "elapsed_s": t, "accuracy": a} for i, t, a in self.curve],
            "history": self.history,
        }


def run_loop(
    cfg: Any,
    policy_dir: str | Path,
    judge_dir: str | Path,
    *,
    iterations: int | None = None,
    time_budget_s: float | None = None,
    eval_every: int = 1,
    on_iteration: Callable[[Any, dict[str, Any]], None] | None = None,
    save_dir: str | Path | None = None,
    stages: list[Any] | None = None,
    device: str = "cpu",
    log: Callable[[str], None] = lambda _: None,
) -> LoopResult:
    """Run GRPO with the GenRM reward for ``iterations`` (default ``cfg.run.iterations``; or until
    ``time_budget_s``), measuring held-out accuracy before, every ``eval_every`` iterations and at the end.
    ``on_iteration(IterationResult, row)`` sees each iteration's samples and metrics row."""
    import torch

    from pivotrl.engines.checkpoints import load_state_dict, save_hf
    from pivotrl.gps import ParameterStore
    from pivotrl.grpo import PolicyUpdater, evaluate, held_out_problems
    from pivotrl.pipeline import Pipeline, StageContext, default_stages, run_iterations
    from pivotrl.run import load_task, load_tokenizer, make_renderer, worker_role_specs
    from pivotrl.runtime.local_session import LocalSession
    from pivotrl.runtime.role_host import WorkerEnv

    torch.manual_seed(cfg.run.seed)
    paths = {"policy": Path(policy_dir), "genrm": Path(judge_dir)}
    tokenizer = load_tokenizer(paths["policy"])
    task = load_task(cfg, log)
    ctx = StageContext(tokenizer=tokenizer, task=task, cfg=cfg, renderer=make_renderer(cfg, paths, tokenizer))
    held = held_out_problems(task, cfg.task.eval_prompts)
    total = iterations if iterations is not None else cfg.run.iterations
    # gps.root when given (a caller may inspect the store after the run), else a private temporary one
    with (
        tempfile.TemporaryDirectory(prefix="pivotrl-loop-") as tmp,
        ParameterStore(root := (cfg.gps.root or tmp), device_tier_bytes=0) as gps,
    ):
        updater = PolicyUpdater.load(cfg, paths["policy"], gps)
        updater.publish()  # version 0: the rollout replica's first weights and the KL reference
        gps.pin(cfg.models.policy.name, 0)
        gps.publish(cfg.models.genrm.name, 0, load_state_dict(paths["genrm"]))
        gps.flush()
        env = WorkerEnv(device, {"root": root, "device_tier_bytes": 0}, root, name="local")
        session = LocalSession(worker_role_specs(cfg, paths, "local"), env)
        pipeline = Pipeline(stages or default_stages(), ctx, session, updater)
        initial = evaluate(session, ctx, held, 0, "v0", cfg.run.seed) / 100.0
        result = LoopResult(initial, initial, curve=[(0, 0.0, initial)])

        def measure(it: int, divert: Any = None) -> float:
            acc = evaluate(session, ctx, held, ctx.policy_version, f"it{it}", cfg.run.seed, divert=divert)
            result.final_accuracy = acc / 100.0
            result.curve.append((it + 1, time.monotonic() - t_learn, result.final_accuracy))
            return acc

        def record(res: Any, row: dict[str, Any]) -> None:
            result.history.append(row)
            if on_iteration is not None:
                on_iteration(res, row)

        t_learn = time.monotonic()  # the budget counts learning, not the baseline measurement
        run_iterations(
            pipeline,
            iterations=total,
            time_budget_s=time_budget_s,
            log=log,
            on_iteration=record,
            evaluate_every=eval_every,
            evaluate_fn=measure if held else None,
            max_staleness=cfg.run.max_staleness,
        )
        session.close()
        if save_dir is not None:
            out = Path(save_dir)
            save_hf(updater.model, updater.model.config, tokenizer, out / "policy")
            (out / "loop.json").write_text(json.dumps(result.to_json(), indent=1, default=float))
    return result
