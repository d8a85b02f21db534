"""Does the policy learn from the GenRM alone? Judge agreement with the verifier, then GRPO's accuracy gain.

    python -m benchmarks.learning --quick --json OUT.json            # one seed
    python -m benchmarks.learning --seeds 0 1 2 --json OUT.json      # the ±5-point check across 3 seeds

1. Bootstrap (cached under ``<storage_root>/models/``): the weak SFT policy and the GenRM judge.
2. Judge agreement: the judge (greedy) on 500 held-out (prompt, response) pairs — half correct reference
   answers, half corrupted references (swap/drop/insert/change/reverse/truncate) — against the verifier.
   Also reported, not gated: agreement on the bootstrap policy's own samples.
3. The single-process loop for each seed, rewarded by the GenRM only, within a time budget; held-out greedy
   accuracy (verifier) before and after. The curve is saved as PNG and JSON.

Prints ``judge_agreement`` and ``accuracy_gain_points`` last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pivotrl.config import PipelineConfig, add_override_argument, load_config
from pivotrl.engines.bootstrap import corrupt_answer, ensure_bootstrap
from pivotrl.engines.checkpoints import build_tokenizer
from pivotrl.engines.genrm import GenRMJudge, JudgeTemplate
from pivotrl.loop import engine_generate_fn, load_policy, make_engine, rollout_stage, run_loop
from pivotrl.tasks import get_task

AGREEMENT_SEED = 424_242  # held out: neither the bootstrap data nor the RL prompts use it


def judge_agreement(cfg: PipelineConfig, judge_dir: Path, n: int = 500) -> dict[str, Any]:
    """Agreement of the judge's parsed verdicts with the verifier on n pairs, half correct, half corrupted."""
    task = get_task(cfg.task.name, cfg.task.options)
    tok = build_tokenizer()
    problems = task.sample(n, seed=AGREEMENT_SEED)
    rng = random.Random(AGREEMENT_SEED)
    responses = [p.answer if i % 2 == 0 else corrupt_answer(p.answer, rng) for i, p in enumerate(problems)]
    truth = [task.verify(p, r) for p, r in zip(problems, responses, strict=True)]
    engine = make_engine(load_policy(judge_dir), cfg.reward.engine)
    judge = GenRMJudge(
        engine_generate_fn(engine, tok, cfg.reward.sampling, run_seed=0),
        JudgeTemplate(),
        default_reward=cfg.reward.default_reward,
    )
    t0 = time.perf_counter()
    judgments = judge.judge(problems, responses)
    seconds = time.perf_counter() - t0
    agree = [(j.reward >= 0.5) == t for j, t in zip(judgments, truth, strict=True)]
    pos = [a for a, t in zip(agree, truth, strict=True) if t]
    neg = [a for a, t in zip(agree, truth, strict=True) if not t]
    lengths = sorted(j.tokens for j in judgments)
    return {
        "pairs": n,
        "correct_pairs": len(pos),
        "responses": "half reference answers, half corrupted references",
        "agreement": sum(agree) / n,
        "agreement_on_correct": sum(pos) / max(len(pos), 1),
        "agreement_on_incorrect": sum(neg) / max(len(neg), 1),
        "unparsed": judge.counters.unparsed,
        "critique_tokens_median": lengths[len(lengths) // 2],
        "critique_tokens_p99": lengths[int(0.99 * (len(lengths) - 1))],
        "seconds": seconds,
    }


def policy_sample_agreement(cfg: PipelineConfig, policy_dir: Path, judge_dir: Path, prompts: int = 64):
    """Agreement on what the judge actually sees in RL: the bootstrap policy's temperature-1 samples."""
    task = get_task(cfg.task.name, cfg.task.options)
    tok = build_tokenizer()
    engine = make_engine(load_policy(policy_dir), cfg.rollout.engine)
    problems = task.sample(prompts, seed=AGREEMENT_SEED + 1)
    rollouts, _ = rollout_stage(
        engine, tok, problems, cfg.task.group_size, cfg.rollout.sampling, run_seed=AGREEMENT_SEED, iteration=0
    )
    judge_engine = make_engine(load_policy(judge_dir), cfg.reward.engine)
    judge = GenRMJudge(
        engine_generate_fn(judge_engine, tok, cfg.reward.sampling, run_seed=1), JudgeTemplate()
    )
    judgments = judge.judge([r.problem for r in rollouts], [r.text for r in rollouts])
    truth = [task.verify(r.problem, r.text) for r in rollouts]
    agree = [(j.reward >= 0.5) == t for j, t in zip(judgments, truth, strict=True)]
    return {
        "samples": len(agree),
        "correct_fraction": sum(truth) / len(truth),
        "agreement": sum(agree) / len(agree),
    }


def plot(curves: dict[int, Any], path: Path, baseline: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for seed, res in curves.items():
        xs = [c["elapsed_s"] for c in res["curve"]]
        ax1.plot(xs, [100 * c["accuracy"] for c in res["curve"]], marker="o", ms=3, label=f"seed {seed}")
        hist = res["history"]
        ax2.plot(
            [h["elapsed_s"] for h in hist],
            [h["mean_reward"] for h in hist],
            lw=1,
            label=f"GenRM, seed {seed}",
        )
        ax2.plot(
            [h["elapsed_s"] for h in hist],
            [h["verifier_reward"] for h in hist],
            lw=1,
            ls="--",
            label=f"verifier, seed {seed}",
        )
    ax1.axhline(100 * baseline + 20, color="grey", ls=":", label="bootstrap + 20 points")
    ax1.set_xlabel("seconds of RL")
    ax1.set_ylabel("held-out accuracy, greedy (%)")
    ax1.set_title("policy accuracy (verifier measures; GenRM rewards)")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("seconds of RL")
    ax2.set_ylabel("mean reward of the batch")
    ax2.set_title("GenRM reward vs true correctness of samples")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run_seed(job: tuple) -> dict[str, Any]:
    """One RL run (own process when seeds run side by side)."""
    cfg_data, policy_dir, judge_dir, seed, budget, iterations, eval_every, threads = job
    torch.set_num_threads(threads)
    run_cfg = PipelineConfig.model_validate(cfg_data)
    run_cfg.run.seed = seed

    def show(h):
        acc = "" if h.heldout_accuracy is None else f" acc={h.heldout_accuracy:.3f}"
        print(
            f"[seed {seed}] it={h.iteration:3d} t={h.elapsed_s:5.0f}s reward={h.mean_reward:.2f} "
            f"true={h.verifier_reward:.2f} agree={h.judge_agreement:.2f}{acc} "
            f"len={h.response_len_mean:.1f} crit={h.critique_len_mean:.1f} kl_ref={h.kl_ref:.4f} "
            f"tok/s roll={h.rollout_tokens_per_s:.0f} rew={h.reward_tokens_per_s:.0f} "
            f"train={h.train_tokens_per_s:.0f}",
            flush=True,
        )

    t0, cpu0 = time.perf_counter(), time.process_time()
    res = run_loop(
        run_cfg,
        Path(policy_dir),
        Path(judge_dir),
        iterations=iterations,
        time_budget_s=budget,
        eval_every=eval_every,
        on_iteration=show,
    )
    out = res.to_json()
    out["wall_s"] = time.perf_counter() - t0
    out["cpu_s"] = time.process_time() - cpu0
    out["iterations"] = len(res.history)
    print(
        f"[seed {seed}] accuracy {res.initial_accuracy:.3f} -> {res.final_accuracy:.3f} "
        f"({res.gain_points:+.1f} points) in {res.history[-1].elapsed_s:.0f}s of RL",
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/quickstart.yaml")
    ap.add_argument("--quick", action="store_true", help="one seed (the default unless --seeds is given)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="RL seeds (e.g. 0 1 2)")
    ap.add_argument("--time-budget", type=float, default=540.0, help="seconds of RL per seed (default 540)")
    ap.add_argument("--iterations", type=int, default=1000, help="upper bound on iterations per seed")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument(
        "--png", default=None, help="learning curve PNG (default next to --json or storage/bench/)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the CPU is shared)")
    ap.add_argument(
        "--parallel-seeds", action="store_true", help="run the seeds side by side, one process each"
    )
    add_override_argument(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = args.seeds or [0]
    cfg = load_config(args.config, PipelineConfig, args.overrides)
    load_start = os.getloadavg()
    t_all = time.perf_counter()

    boot = ensure_bootstrap(cfg)
    print(f"bootstrap: {boot.seconds:.1f}s ({'built ' + ', '.join(boot.built) if boot.built else 'cached'})")
    agreement = judge_agreement(cfg, boot.judge_dir)
    print(
        f"judge on 500 held-out pairs: agreement {agreement['agreement']:.3f} "
        f"(correct {agreement['agreement_on_correct']:.3f}, "
        f"incorrect {agreement['agreement_on_incorrect']:.3f}, unparsed {agreement['unparsed']})"
    )
    on_policy = policy_sample_agreement(cfg, boot.policy_dir, boot.judge_dir)
    print(
        f"judge on bootstrap-policy samples: agreement {on_policy['agreement']:.3f} "
        f"({on_policy['samples']} samples, {on_policy['correct_fraction']:.2f} correct)"
    )

    jobs = [
        (
            cfg.model_dump(),
            str(boot.policy_dir),
            str(boot.judge_dir),
            seed,
            args.time_budget,
            args.iterations,
            args.eval_every,
            args.threads,
        )
        for seed in seeds
    ]
    if args.parallel_seeds and len(seeds) > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(len(jobs)) as pool:
            outs = pool.map(_run_seed, jobs)
    else:
        outs = [_run_seed(job) for job in jobs]
    runs: dict[int, Any] = dict(zip(seeds, outs, strict=True))

    gains = [runs[s]["accuracy_gain_points"] for s in seeds]
    json_path = Path(args.json) if args.json else None
    png = (
        Path(args.png)
        if args.png
        else (
            json_path.with_suffix(".png")
            if json_path
            else Path(cfg.run.storage_root) / "bench" / "learning.png"
        )
    )
    plot(runs, png, runs[seeds[0]]["initial_accuracy"])
    result = {
        "config": args.config,
        "seeds": seeds,
        "time_budget_s": args.time_budget,
        "bootstrap": {
            "seconds": boot.seconds,
            "built": boot.built,
            "stats": boot.stats,
            "policy_dir": str(boot.policy_dir),
            "judge_dir": str(boot.judge_dir),
        },
        "judge": agreement,
        "judge_on_policy_samples": on_policy,
        "runs": {str(s): runs[s] for s in seeds},
        "gains_points": gains,
        "gain_spread_points": max(gains) - min(gains),
        "initial_accuracy": runs[seeds[0]]["initial_accuracy"],
        "final_accuracy_median": statistics.median(runs[s]["final_accuracy"] for s in seeds),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "torch_threads": args.threads,
        "wall_s": time.perf_counter() - t_all,
        "png": str(png),
        "judge_agreement": agreement["agreement"],
        "accuracy_gain_points": statistics.median(gains),
    }
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
    print(
        f"gains per seed (points): {', '.join(f'{g:+.1f}' for g in gains)}; "
        f"spread {max(gains) - min(gains):.1f}"
    )
    print(f"load average (1/5/15 min) at start {load_start}, at end {result['loadavg_end']}")
    print(f"curve: {png}")
    print(f"judge_agreement: {result['judge_agreement']:.3f}")
    print(f"accuracy_gain_points: {result['accuracy_gain_points']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
