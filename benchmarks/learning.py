"""Does the policy learn from the GenRM alone? Judge agreement with the verifier, then GRPO's accuracy gain.

    python -m benchmarks.learning --quick --json OUT.json            # one seed
    python -m benchmarks.learning --seeds 0 1 2 --json OUT.json      # the ±5-point check across 3 seeds

1. Bootstrap (cached under ``<storage_root>/models/``): the weak SFT policy and the GenRM judge.
2. Judge agreement: the judge (greedy) on 500 held-out (prompt, response) pairs — half correct reference
   answers, half corrupted references (swap/drop/insert/change/reverse/truncate) — against the verifier.
   Also reported, not gated: agreement on the bootstrap policy's own samples.
3. For each seed, the recipe `make demo` ships: `run_pipeline` (default stages, the config's scheduler mode,
   a local Dask cluster), rewarded by the GenRM only, within a time budget; held-out greedy accuracy
   (verifier) before, every ``--eval-every`` iterations and after. The curve is saved as PNG and JSON.

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
from pivotrl.grpo import response_budget, seq_seed
from pivotrl.tasks import get_task

AGREEMENT_SEED = 424_242  # held out: neither the bootstrap data nor the RL prompts use it


def make_engine(model_dir: Path, engine_cfg: Any) -> Any:
    from pivotrl.engines.checkpoints import from_pretrained
    from pivotrl.engines.generation import GenerationEngine

    model = from_pretrained(model_dir)
    kv, batch = engine_cfg.kv_budget_tokens, engine_cfg.max_batch
    return GenerationEngine(model, kv_budget_tokens=kv, max_batch=batch)


def generate(engine: Any, tok: Any, prompts: list[str], sampling: Any, seeds: list[int], budgets=None):
    """(ids, text, finish reason) per prompt, in order; each sequence with its own sampling seed."""
    from pivotrl.engines.requests import GenRequest, SamplingParams

    reqs = [
        GenRequest(
            seq_id=f"q{i}",
            prompt_ids=tok.encode(p),
            sampling=SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_new_tokens=budgets[i] if budgets else sampling.max_new_tokens,
                stop_ids=(tok.eos_token_id,),
                seed=seeds[i],
            ),
        )
        for i, p in enumerate(prompts)
    ]
    by_id = {r.seq_id: r for r in engine.generate(reqs)}
    out = []
    for r in reqs:
        done = by_id[r.seq_id]
        ids = [i for i in done.generated_ids if i != tok.eos_token_id]
        out.append((list(done.generated_ids), tok.decode(ids, skip_special_tokens=True), done.finish_reason))
    return out


def judge_fn(engine: Any, tok: Any, sampling: Any, tag: str):
    """A `GenRMJudge` generate function over an engine."""

    def fn(prompts):
        seeds = [seq_seed(tag, i) for i in range(len(prompts))]
        done = generate(engine, tok, list(prompts), sampling, seeds)
        return [(text, len(ids), finish) for ids, text, finish in done]

    return fn


def judge_agreement(cfg: PipelineConfig, judge_dir: Path, n: int = 500) -> dict[str, Any]:
    """Agreement of the judge's parsed verdicts with the verifier on n pairs, half correct, half corrupted."""
    task = get_task(cfg.task.name, cfg.task.options)
    tok = build_tokenizer()
    problems = task.sample(n, seed=AGREEMENT_SEED)
    rng = random.Random(AGREEMENT_SEED)
    responses = [p.answer if i % 2 == 0 else corrupt_answer(p.answer, rng) for i, p in enumerate(problems)]
    truth = [task.verify(p, r) for p, r in zip(problems, responses, strict=True)]
    engine = make_engine(judge_dir, cfg.reward.engine)
    judge = GenRMJudge(
        judge_fn(engine, tok, cfg.reward.sampling, "agreement"),
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
    engine = make_engine(policy_dir, cfg.rollout.engine)
    problems = [p for p in task.sample(prompts, seed=AGREEMENT_SEED + 1) for _ in range(cfg.task.group_size)]
    s, r = cfg.rollout.sampling, cfg.reward
    budgets = [response_budget(p, s.max_new_tokens, r.budget_per_item, r.budget_slack) for p in problems]
    seeds = [seq_seed("rollout", AGREEMENT_SEED, p.uid, k) for k, p in enumerate(problems)]
    texts = [t for _, t, _ in generate(engine, tok, [p.prompt for p in problems], s, seeds, budgets)]
    judge_engine = make_engine(judge_dir, cfg.reward.engine)
    judge = GenRMJudge(judge_fn(judge_engine, tok, cfg.reward.sampling, "policy-samples"), JudgeTemplate())
    judgments = judge.judge(problems, texts)
    truth = [task.verify(p, t) for p, t in zip(problems, texts, strict=True)]
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
    """One RL run of the shipped recipe (`run_pipeline`, as `make demo`), own process when seeds run side
    by side. Accuracies in the JSON are fractions; `history` holds the runtime's metric rows plus the
    plotted keys (`mean_reward`, `verifier_reward`, `elapsed_s`)."""
    from pivotrl.run import run_pipeline

    cfg_data, policy_dir, judge_dir, seed, budget, iterations, eval_every, threads = job
    torch.set_num_threads(threads)
    run_cfg = PipelineConfig.model_validate(cfg_data)
    run_cfg.run.seed = seed
    run_cfg.run.iterations = iterations
    run_cfg.run.time_budget_s = budget
    run_cfg.models.policy.path, run_cfg.models.genrm.path = policy_dir, judge_dir
    run_cfg.cluster.dashboard_address = None  # seeds may run side by side

    def show(res, row):
        acc = row.get("heldout_accuracy")
        acc = "" if acc is None else f" acc={acc / 100:.3f}"
        print(
            f"[seed {seed}] it={row['iteration']:3d} t={row['elapsed_s']:5.0f}s "
            f"reward={row['reward_mean']:.2f} true={row['accuracy'] / 100:.2f}{acc} "
            f"len={row['response_tokens_mean']:.1f} crit={row['judge_tokens_mean']:.1f} "
            f"{row['tokens_per_s']:.0f} tok/s shifts={row['shifts']}",
            flush=True,
        )

    t0, cpu0 = time.perf_counter(), time.process_time()
    res = run_pipeline(
        run_cfg,
        log=lambda m: print(f"[seed {seed}] {m}", flush=True),
        progress=False,
        save_final=False,
        eval_every=eval_every,
        on_iteration=show,
    )
    before = res.eval["accuracy_before"] / 100
    after = res.eval.get("accuracy_after", res.eval["accuracy_before"]) / 100
    history = [
        {**row, "mean_reward": row["reward_mean"], "verifier_reward": row["accuracy"] / 100}
        for row in res.iterations
    ]
    out = {
        "initial_accuracy": before,
        "final_accuracy": after,
        "accuracy_gain_points": 100.0 * (after - before),
        "curve": [{**c, "accuracy": c["accuracy"] / 100} for c in res.curve],
        "history": history,
        "run_dir": str(res.run_dir),
        "devices": res.devices,
        "mode": run_cfg.scheduler.mode,
    }
    out["wall_s"] = time.perf_counter() - t0
    out["cpu_s"] = time.process_time() - cpu0
    out["iterations"] = len(res.iterations)
    rl_s = history[-1]["elapsed_s"] if history else 0.0
    print(
        f"[seed {seed}] accuracy {before:.3f} -> {after:.3f} ({out['accuracy_gain_points']:+.1f} points) "
        f"in {rl_s:.0f}s of RL",
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
