"""Run a pipeline config on a Dask cluster: models → GPS → cluster + plugins → iterations → outputs.

`run_pipeline` is what `pivotrl-pipeline submit` and `benchmarks.paradigms` call. The driver process is
the optimizer owner (it holds the one AdamW state); every device-side step — generation for rollout and
reward, gradients for train — runs on Dask workers under the controller's decisions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pivotrl.config import PipelineConfig
from pivotrl.errors import UserError


@dataclass
class RunResult:
    run_id: str
    run_dir: Path
    iterations: list[dict[str, Any]] = field(default_factory=list)
    eval: dict[str, float] = field(default_factory=dict)
    shifts: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    devices: int = 0
    wall_s: float = 0.0
    final_policy: Path | None = None
    policy: dict[str, Any] = field(default_factory=dict)  # which core policy decided (name, groups, split)


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------


def resolve_models(cfg: PipelineConfig, log: Callable[[str], None]) -> dict[str, Path]:
    """HF directories of the version-0 policy and judge: given paths, or the (cached) bootstrap."""
    paths: dict[str, Path] = {}
    for key in ("policy", "genrm"):
        ref = getattr(cfg.models, key)
        if ref.path:
            p = Path(ref.path)
            if not (p / "config.json").is_file():
                raise UserError(f"models.{key}.path: {p} is not a Hugging Face model directory")
            paths[key] = p
    if len(paths) < 2:
        t0 = time.monotonic()
        try:
            from pivotrl.engines import bootstrap
        except ImportError as exc:
            raise UserError("models: no path given and the bootstrap module is unavailable") from exc
        built = bootstrap.ensure_bootstrap(cfg, log=log)  # cached under storage/models
        paths.setdefault("policy", Path(built.policy_dir))
        paths.setdefault("genrm", Path(built.judge_dir))
        log(f"bootstrap: policy {paths['policy']}, judge {paths['genrm']} ({time.monotonic() - t0:.1f}s)")
    return paths


# ----------------------------------------------------------------------------------------------------
# Specs handed to workers and to the controller
# ----------------------------------------------------------------------------------------------------


def load_tokenizer(model_dir: Path) -> Any:
    """The policy's tokenizer. Models made here use pivotrl's character tokenizer, rebuilt in code: its
    tokenizer.json does not round-trip through `AutoTokenizer` (spaces and newlines are lost), which would
    silently corrupt every prompt. Real checkpoints load with `AutoTokenizer`."""
    from transformers import AutoTokenizer

    from pivotrl.engines.checkpoints import build_tokenizer, load_config, vocab_size

    if int(getattr(load_config(model_dir), "vocab_size", -1)) == vocab_size():
        return build_tokenizer()
    return AutoTokenizer.from_pretrained(str(model_dir))


def worker_role_specs(cfg: PipelineConfig, paths: dict[str, Path], run_id: str) -> dict[str, dict[str, Any]]:
    from pivotrl.engines.checkpoints import PAD_ID

    pol, rm = cfg.models.policy, cfg.models.genrm
    return {
        "rollout": {
            "model": pol.name,
            "version": 0,
            "hf_dir": str(paths["policy"]),
            "dtype": pol.dtype,
            "kv_budget_tokens": cfg.rollout.engine.kv_budget_tokens,
            "backend": cfg.rollout.engine.backend,
            "max_batch": cfg.rollout.engine.max_batch,
        },
        "reward": {
            "model": rm.name,
            "version": 0,
            "hf_dir": str(paths["genrm"]),
            "dtype": rm.dtype,
            "kv_budget_tokens": cfg.reward.engine.kv_budget_tokens,
            "backend": cfg.reward.engine.backend,
            "max_batch": cfg.reward.engine.max_batch,
        },
        "train": {
            "model": pol.name,
            "version": 0,
            "hf_dir": str(paths["policy"]),
            "dtype": pol.dtype,
            "micro_batch": cfg.train.micro_batch,
            # one micro-batch at a time: at the end of the stage no replica holds a second one while
            # another idles (the refill costs one sync round trip per ~0.2 s micro-batch step)
            "max_batch": cfg.train.micro_batch,
            "clip_eps": cfg.train.clip_eps,
            "kl_coef": cfg.train.kl_coef,
            "ref_version": 0,  # the KL reference is the bootstrap policy, as in the single-process loop
            "temperature": 1.0,  # engines report raw-distribution log-probs (see pivotrl.loop)
            "pad_id": PAD_ID,
            "grad_prefix": "grad",
        },
    }


def controller_config(cfg: PipelineConfig) -> Any:
    """What core knows of the cluster before measuring: each role's capacity (the engine's batch and KV
    budget; a train replica holds two micro-batches so the next is there when one is done) and the priors."""
    from pivotrl.core import ControllerConfig, Role, RoleSpec

    pr, sc = cfg.scheduler.priors, cfg.scheduler
    ro, rw = cfg.rollout.engine, cfg.reward.engine
    roles = {
        Role.ROLLOUT: RoleSpec(max_seqs=ro.max_batch, kv_tokens=ro.kv_budget_tokens,
                               prior_step_a_s=pr.rollout_step_a_s, prior_step_b_s=pr.rollout_step_b_s),
        Role.REWARD: RoleSpec(max_seqs=rw.max_batch, kv_tokens=rw.kv_budget_tokens,
                              prior_step_a_s=pr.reward_step_a_s, prior_step_b_s=pr.reward_step_b_s),
        Role.TRAIN: RoleSpec(max_seqs=2 * cfg.train.micro_batch, kv_tokens=1 << 30,
                             prior_step_a_s=pr.train_step_a_s, prior_step_b_s=pr.train_step_b_s),
    }
    return ControllerConfig(roles=roles, horizon_s=sc.horizon_s, hysteresis=sc.hysteresis,
                            cooldown_s=sc.cooldown_s, shift_prior_s=pr.shift_s)


def build_controller(cfg: PipelineConfig, mode: str, n_devices: int,
                     log: Callable[[str], None] = print) -> Any:
    """core's controller for `mode`. A disaggregated run on fewer devices than roles (no static split can
    give each role a device), or with `scheduler.static_groups`, is core's static grouping."""
    from pivotrl.core import Controller, Grouped, make_policy

    sc = cfg.scheduler
    groups = None
    if mode == "disaggregated" and sc.static_groups is not None:
        roles = {r for g in sc.static_groups for r in g}
        if len(sc.static_groups) > n_devices or roles != {"rollout", "reward", "train"}:
            raise UserError(
                f"scheduler.static_groups: {sc.static_groups} must cover rollout, reward and train with at "
                f"most one group per device ({n_devices} devices)"
            )
        groups = [(tuple(g), 1) for g in sc.static_groups]
    try:
        policy = make_policy(mode, static_split=sc.static_split if mode == "disaggregated" else None,
                             groups=groups, n_devices=n_devices)
    except ValueError as exc:
        raise UserError(f"scheduler: {exc}") from None
    if isinstance(policy, Grouped):
        names = [[str(r) for r in roles] for roles, _ in policy.groups]
        log(f"disaggregated on {n_devices} devices: static role groups {names}")
    return Controller(policy, config=controller_config(cfg))


def policy_description(controller: Any) -> dict[str, Any]:
    """Which core policy a run used (benchmarks record it)."""
    from pivotrl.core import Grouped

    policy = controller.policy
    out: dict[str, Any] = {"policy": policy.name}
    if isinstance(policy, Grouped):
        out["groups"] = [[str(r) for r in roles] for roles, _ in policy.groups]
    split = getattr(policy, "initial_split", None)
    if split:
        out["split"] = {str(k): v for k, v in split.items()}
    return out


# ----------------------------------------------------------------------------------------------------
# The optimizer owner
# ----------------------------------------------------------------------------------------------------


class Owner:
    """Holds the policy's optimizer; reduces flushed gradient sums, steps once, publishes the version."""

    def __init__(self, cfg: PipelineConfig, policy_dir: Path, gps: Any) -> None:
        import torch

        from pivotrl.engines.checkpoints import PAD_ID, from_pretrained
        from pivotrl.loop import make_trainer

        self.cfg, self.gps = cfg, gps
        self.model = from_pretrained(policy_dir, dtype=getattr(torch, cfg.models.policy.dtype))
        self.trainer = make_trainer(cfg, self.model, PAD_ID)  # the single-process loop's owner, same settings
        self.last_stats: dict[str, Any] = {}

    def publish(self) -> int:
        v = self.trainer.version
        self.gps.publish(self.cfg.models.policy.name, v, self.model.state_dict())
        self.gps.flush()  # workers are other processes: the version must be readable from a shared tier
        return v

    def apply(self, grads: list[dict[str, Any]], iteration: int) -> int:
        from pivotrl.engines.trainer import GradSum, reduce

        if not grads:  # no sample of the iteration had a response to learn from
            self.last_stats = {"skipped": 1.0}
            return self.trainer.version
        sums = []
        for g in grads:
            ref = g["ref"]
            sd = self.gps.fetch(ref["model"], int(ref["version"]))
            st = dict(g["stats"])
            sums.append(
                GradSum(
                    grads=sd,
                    tokens=int(st["tokens"]),
                    samples=int(st["samples"]),
                    version=int(st["version"]),
                    loss_sum=float(st["loss_sum"]),
                    pg_sum=float(st["pg_sum"]),
                    kl_ref_sum=float(st["kl_ref_sum"]),
                    kl_old_sum=float(st["kl_old_sum"]),
                    clipped=int(st["clipped"]),
                    nonfinite=bool(st["nonfinite"]),
                )
            )
        stats = self.trainer.apply(reduce(sums))
        self.last_stats = stats.as_dict()
        self.last_stats["replica_sums"] = len(sums)
        for model in {g["ref"]["model"] for g in grads}:
            with contextlib.suppress(Exception):
                self.gps.gc(model, keep_last=1)
        if stats.skipped:
            return self.trainer.version
        return self.publish()


# ----------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def host_tier(path: str | None, run_id: str) -> Iterator[str | None]:
    """A node-local fast GPS tier (/dev/shm when present), removed when the run ends."""
    if path is None and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        path = f"/dev/shm/pivotrl-{run_id}"
        owned = True
    else:
        owned = False
    try:
        yield path
    finally:
        if owned and path:
            shutil.rmtree(path, ignore_errors=True)


def new_run_id(cfg: PipelineConfig, mode: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.run.name}-{mode}-{uuid.uuid4().hex[:4]}"


def evaluate(
    session: Any, ctx: Any, problems: list[Any], version: int, tag: str, seed: int, timeout_s: float = 900.0
) -> float:
    """Held-out accuracy of policy `version`: greedy responses on rollout devices, checked by the verifier
    (the verifier only measures; it never rewards)."""
    s = ctx.cfg.rollout.sampling
    items = []
    for k, prob in enumerate(problems):
        ids = ctx.encode(prob.prompt)
        items.append(
            {
                "id": f"eval-{tag}-{k}",
                "role": "rollout",
                "iteration": -1,
                "payload": {
                    "prompt_ids": ids,
                    "version": version,
                    "sampling": {
                        "temperature": 0.0,
                        "top_p": 1.0,
                        "max_new_tokens": int(s.max_new_tokens),
                        "seed": seed,
                        "stop_ids": [int(ctx.tokenizer.eos_token_id)],
                    },
                },
                "prompt_tokens": len(ids),
                "max_new_tokens": s.max_new_tokens,
                "est_tokens": s.max_new_tokens // 2,
            }
        )
    if not items:
        return float("nan")
    session.submit(items)
    got: dict[str, bool] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < len(items):
        for res in session.collect()["results"]:
            k = int(res["id"].rsplit("-", 1)[1])
            got[res["id"]] = bool(ctx.task.verify(problems[k], ctx.decode(list(res["generated"]))))
        if time.monotonic() > deadline:
            raise TimeoutError(f"evaluation of version {version} did not finish in {timeout_s}s")
        time.sleep(0.03)
    return 100.0 * sum(got.values()) / len(got)


def run_pipeline(
    cfg: PipelineConfig,
    *,
    mode: str | None = None,
    workers: int | None = None,
    scheduler: str | None = None,
    stages: list[Any] | None = None,
    log: Callable[[str], None] = print,
    progress: bool = True,
    evaluate_policy: bool = True,
    save_final: bool = True,
    controller: Any = None,
) -> RunResult:
    """Run `cfg` end to end (see the module docstring). `controller` (a `pivotrl.core.Controller`)
    overrides the one `mode` selects."""
    from pivotrl.gps import ParameterStore
    from pivotrl.loop import held_out_problems, train_problems
    from pivotrl.malloc import keep_freed_memory
    from pivotrl.pipeline import Pipeline, StageContext, default_stages

    keep_freed_memory()  # the driver's optimizer steps and the scheduler: see pivotrl/malloc.py
    from pivotrl.runtime.cluster import open_cluster
    from pivotrl.runtime.metrics import IterationMeter, write_metrics
    from pivotrl.runtime.session import RuntimeSession
    from pivotrl.tasks import get_task

    mode = mode or cfg.scheduler.mode
    t_start = time.monotonic()
    run_id = new_run_id(cfg, mode)
    run_dir = Path(cfg.run.storage_root) / "runs" / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = resolve_models(cfg, log)
    task = get_task(cfg.task.name, cfg.task.options)
    tokenizer = load_tokenizer(paths["policy"])
    ctx = StageContext(tokenizer=tokenizer, task=task, cfg=cfg)
    result = RunResult(run_id, run_dir)

    gps_root = cfg.gps.root or str(run_dir / "gps")
    with (
        host_tier(cfg.gps.host_tier, run_id) as host,
        ParameterStore(gps_root, host_tier=host, device_tier_bytes=0) as gps,
    ):
        owner = Owner(cfg, paths["policy"], gps)
        owner.publish()  # version 0 of the policy
        gps.pin(cfg.models.policy.name, 0)  # the KL reference and the baseline: never garbage-collected
        from pivotrl.engines.checkpoints import load_state_dict as load_hf

        gps.publish(cfg.models.genrm.name, 0, load_hf(paths["genrm"]))
        gps.flush()
        gps_opts = {
            "root": os.path.abspath(gps_root),
            "host_tier": host,
            "device_tier_bytes": cfg.gps.device_tier_bytes,
        }
        cl = cfg.cluster
        with open_cluster(
            workers=workers or cl.workers,
            scheduler=scheduler or cl.scheduler,
            host=cl.host,
            dashboard_address=cl.dashboard_address,
        ) as handle:
            n_dev = len(handle.device_workers())
            result.devices = n_dev
            if handle.dashboard_link:
                log(f"dashboard: {handle.dashboard_link}  (pivotrl page: /pivotrl)")
            if controller is None:
                controller = build_controller(cfg, mode, n_dev, log)
            result.policy = policy_description(controller)
            session = RuntimeSession.install(
                handle.client,
                controller=controller,
                role_specs=worker_role_specs(cfg, paths, run_id),
                worker_options={
                    "torch_threads": cl.torch_threads,
                    "device": handle.device,
                    "gps": gps_opts,
                    "storage_root": os.path.abspath(cfg.run.storage_root),
                },
                tick_s=cfg.scheduler.tick_s,
            )
            with contextlib.suppress(Exception):
                from pivotrl.runtime.dashboard import register_dashboard

                register_dashboard(handle.client)
            if cfg.train.minibatches > 1:
                log(
                    f"note: train.minibatches={cfg.train.minibatches} is a single-process-loop setting; the "
                    "distributed runtime takes one optimizer step per iteration over all its gradient sums"
                )
            log(
                f"run {run_id}: mode={mode}, {n_dev} device workers, {cfg.run.iterations} iterations, "
                f"{cfg.task.prompts_per_iteration}×{cfg.task.group_size} samples/iteration"
            )
            pipeline = Pipeline(stages or default_stages(), ctx, session, owner.apply)
            eval_problems = held_out_problems(task, cfg.task.eval_prompts)
            if evaluate_policy and eval_problems:
                acc0 = evaluate(session, ctx, eval_problems, 0, "v0", cfg.run.seed)
                result.eval["accuracy_before"] = acc0
                log(f"held-out accuracy of version 0: {acc0:.1f}%")
            meter = IterationMeter(session, log)
            bar = _progress_bar(cfg.run.iterations, progress)
            budget = cfg.run.time_budget_s
            t_iterations = time.monotonic()
            for it in range(cfg.run.iterations):
                if budget is not None and it > 0 and time.monotonic() - t_iterations >= budget:
                    log(f"run.time_budget_s={budget:g} reached after {it} iterations; finishing the run")
                    break
                problems = train_problems(task, cfg.task.prompts_per_iteration, cfg.run.seed, it)
                samples = pipeline.make_samples(it, problems, cfg.task.group_size, cfg.run.seed)
                session.begin_iteration(meter.iteration_plan(it, samples, cfg))
                meter.start(it)
                res = pipeline.run_iteration(it, samples, on_poll=meter.poll)
                version = owner.apply(res.grads, it)
                ctx.policy_version = version
                for role in ("rollout", "train"):
                    session.set_version(role, version)
                row = meter.finish(res, owner.last_stats, version)
                result.iterations.append(row)
                if bar is not None:
                    bar.set_postfix_str(meter.postfix(row))
                    bar.update(1)
                else:
                    log(meter.line(row))
            if bar is not None:
                bar.close()
            if evaluate_policy and eval_problems:
                acc1 = evaluate(session, ctx, eval_problems, ctx.policy_version, "final", cfg.run.seed)
                result.eval["accuracy_after"] = acc1
                result.eval["accuracy_gain_points"] = acc1 - result.eval["accuracy_before"]
                log(
                    f"held-out accuracy of version {ctx.policy_version}: {acc1:.1f}% "
                    f"({result.eval['accuracy_gain_points']:+.1f} points)"
                )
            m = session.metrics()
            result.timeline, result.events = m["timeline"], m["events"]
            result.shifts = [e for e in m["events"] if e["kind"] == "shift_done" and e.get("src")]
        if save_final:
            from pivotrl.engines.checkpoints import save_hf

            result.final_policy = save_hf(
                owner.model, owner.model.config, tokenizer, run_dir / "policy-final"
            )
    result.wall_s = time.monotonic() - t_start
    write_metrics(result, run_dir / "metrics.zarr")
    return result


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="iterations", unit="it", dynamic_ncols=True)
