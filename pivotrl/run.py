"""Run a pipeline config on a Dask cluster: models → GPS → cluster + plugins → iterations → outputs.

`run_pipeline` is what `pivotrl-pipeline submit` (`make demo`), `benchmarks.paradigms` and
`benchmarks.learning` call. The driver process is the optimizer owner (`pivotrl.grpo.PolicyUpdater`, the
one AdamW state); every device-side step — generation for rollout and reward, gradients for train — runs
on Dask workers under the controller's decisions. The per-iteration loop is `pivotrl.pipeline.
run_iterations`, which the single-process `pivotrl.loop.run_loop` runs too.
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
    curve: list[dict[str, float]] = field(default_factory=list)  # {iteration, elapsed_s, accuracy} (%)


# ----------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------


def _restore_learned(controller: Any, data: dict[str, Any], log: Callable[[str], None]) -> None:
    """A resumed run's controller starts from what the checkpointed one had learned (shift costs, step
    fits, the last iteration's profile); a record it cannot read costs only that: it starts from priors."""
    from pivotrl.core.learned import LearnedState, restore_learned

    try:
        restore_learned(controller, LearnedState.from_json(data))
    except ValueError as e:
        log(f"resume: {e}; the controller starts from its priors")
        return
    log("resume: the controller starts from its learned shift costs and step-time fits")


def _uses_native_kernels(cfg: PipelineConfig) -> bool:
    """Whether the run's engines may decode with the native CPU kernels (`pivotrl.engines.kernels`)."""
    from pivotrl.engines import kernels

    engines = (cfg.rollout.engine, cfg.reward.engine)
    return kernels.enabled_by_env() and any(e.backend == "torch" for e in engines)


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
        built = bootstrap.ensure_bootstrap(cfg, log=log, build_kernels=_uses_native_kernels(cfg))
        paths.setdefault("policy", Path(built.policy_dir))
        paths.setdefault("genrm", Path(built.judge_dir))
        log(f"bootstrap: policy {paths['policy']}, judge {paths['genrm']} ({time.monotonic() - t0:.1f}s)")
    return paths


# ----------------------------------------------------------------------------------------------------
# Specs handed to workers and to the controller
# ----------------------------------------------------------------------------------------------------


def load_tokenizer(model_dir: Path) -> Any:
    """The tokenizer of a model directory (see `pivotrl.engines.checkpoints.load_tokenizer`)."""
    from pivotrl.engines.checkpoints import load_tokenizer as load

    return load(model_dir)


def load_task(cfg: PipelineConfig, log: Callable[[str], None]) -> Any:
    """The config's task; a dataset's rows, bad rows and split sizes are reported before anything runs."""
    from pivotrl.tasks import build_task

    task = build_task(cfg.task)
    stats = getattr(task, "stats", None)
    if stats is not None:
        log(stats.line())
        for example in stats.skipped_examples:
            log(f"  skipped: {example}")
    return task


def make_renderer(cfg: PipelineConfig, paths: dict[str, Path], policy_tokenizer: Any) -> Any:
    """How the engines' prompts are rendered and judgments read (`pivotrl.engines.prompts`)."""
    from pivotrl.engines.prompts import PromptRenderer

    judge_tokenizer = load_tokenizer(paths["genrm"])
    return PromptRenderer.from_config(cfg, policy_tokenizer, judge_tokenizer)


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
            "ref_version": 0,  # the KL reference is the bootstrap policy
            "temperature": 1.0,  # engines report raw-distribution log-probs (see pivotrl.grpo.make_trainer)
            "pad_id": PAD_ID,
            "grad_prefix": "grad",
            # the sharded owner's rank on this device takes the flushed sum from memory
            # (pivotrl.runtime.train_worker.hand_over); the driver owner reads every sum from the store
            "hand_over": cfg.train.optimizer_owner == "sharded",
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
                            cooldown_s=sc.cooldown_s, cooldown_shift_multiple=sc.cooldown_shift_multiple,
                            shift_prior_s=pr.shift_s, max_staleness=cfg.run.max_staleness)


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
# Running
# ----------------------------------------------------------------------------------------------------


HOST_TIER_PREFIX = "pivotrl-"


@contextlib.contextmanager
def host_tier(path: str | None, run_id: str, log: Callable[[str], None] = print) -> Iterator[str | None]:
    """A node-local fast GPS tier (/dev/shm when present), removed when the run ends. Its lease tells the
    next run on the node that it is live; tiers of dead runs (killed before they could remove theirs) are
    reclaimed here, this run's own stale one (a resumed run's) included."""
    from pivotrl import lease

    if path is not None or not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        yield path
        return
    shm = Path("/dev/shm")
    for gone in lease.reclaim_dead(shm, HOST_TIER_PREFIX):
        log(f"reclaimed the host tier of a dead run: {gone}")
    own = shm / f"{HOST_TIER_PREFIX}{run_id}"
    try:
        with lease.held(own, "host tier"):
            yield str(own)
    finally:
        shutil.rmtree(own, ignore_errors=True)


def new_run_id(cfg: PipelineConfig, mode: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.run.name}-{mode}-{uuid.uuid4().hex[:4]}"


def start_sharded_owner(cfg: PipelineConfig, client: Any, gps: Any, gps_opts: dict[str, Any],
                        policy_dir: Path, resumed: Any) -> Any:
    """`train.optimizer_owner: sharded`: the train group's scheduler plugin, version 0 published by a
    device worker (or the checkpoint's version restored), and the driver-side coordinator."""
    from pivotrl.engines.checkpoints import PAD_ID
    from pivotrl.runtime.train_plugin import TrainGroupPlugin
    from pivotrl.runtime.train_worker import publish_initial
    from pivotrl.sharded_updater import ShardedUpdater

    client.register_plugin(TrainGroupPlugin())
    owner = ShardedUpdater(cfg, client, gps_opts, str(policy_dir), PAD_ID)
    if resumed is None:
        worker = sorted(client.scheduler_info()["workers"])[0]
        client.submit(publish_initial, owner.name, str(policy_dir), gps_opts, workers=[worker],
                      pure=False).result()
        gps.pin(owner.name, 0)
    else:
        resumed.restore(owner, gps)
    return owner


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
    eval_every: int | None = None,
    on_iteration: Callable[[Any, dict[str, Any]], None] | None = None,
    resume: str | None = None,
) -> RunResult:
    """Run `cfg` end to end (see the module docstring). `controller` (a `pivotrl.core.Controller`)
    overrides the one `mode` selects. Held-out accuracy is measured before and after the run, and after
    every `eval_every`-th iteration when given (`RunResult.curve`). `on_iteration(IterationResult, row)`
    sees every iteration's samples and metrics row.

    A checkpoint is committed after every iteration (`pivotrl.checkpoint`); `resume` (a run id, or
    `latest`) continues that run at the iteration after its last checkpoint."""
    from pivotrl import checkpoint, lease
    from pivotrl.gps import ParameterStore
    from pivotrl.grpo import PolicyUpdater, evaluate, held_out_problems
    from pivotrl.malloc import keep_freed_memory
    from pivotrl.names import writable_storage_root
    from pivotrl.pipeline import Pipeline, StageContext, default_stages, run_iterations
    from pivotrl.validate import check_before_bootstrap

    keep_freed_memory()  # the driver's optimizer steps and the scheduler: see pivotrl/malloc.py
    from pivotrl.runtime.cluster import default_workers, driver_threads, open_cluster
    from pivotrl.runtime.metrics import persisted, write_metrics
    from pivotrl.runtime.node_local import driver_peers, node_local_templates, node_local_tiers
    from pivotrl.runtime.session import RuntimeSession

    mode = mode or cfg.scheduler.mode
    t_start = time.monotonic()
    resumed = checkpoint.resume_point(cfg, resume) if resume is not None else None
    writable_storage_root(cfg.run.storage_root)  # after a resume's own check: a bad --resume creates nothing
    if resumed is not None:
        run_id, run_dir = resumed.ckpt.run_id, resumed.run_dir
        log(resumed.describe(cfg.run.iterations))  # the first line a resumed run prints
    else:
        run_id = new_run_id(cfg, mode)
        run_dir = Path(cfg.run.storage_root) / "runs" / run_id
    cfg_json = cfg.model_dump(mode="json")
    with lease.held(run_dir, "run directory"):  # one live driver per run
        task = load_task(cfg, log)  # before the bootstrap: a bad row fails in a second, not after training
        check_before_bootstrap(cfg, task)  # and so does an overlong one
        log("phase: models (the bootstrap builds missing ones, cached)")
        paths = resolve_models(cfg, log)
        tokenizer = load_tokenizer(paths["policy"])
        renderer = make_renderer(cfg, paths, tokenizer)
        ctx = StageContext(tokenizer=tokenizer, task=task, cfg=cfg, renderer=renderer)
        result = RunResult(run_id, run_dir)

        gps_root = cfg.gps.root or str(run_dir / "gps")
        with (
            host_tier(cfg.gps.host_tier, run_id, log) as host,
            node_local_tiers(cfg, gps_root, host) as (driver_root, driver_host),
            ParameterStore(driver_root, host_tier=driver_host, device_tier_bytes=0) as gps,
        ):
            log(f"phase: parameter store ({'version 0' if resumed is None else 'restore'})")
            sharded = cfg.train.optimizer_owner == "sharded"
            owner: Any = None if sharded else PolicyUpdater.load(cfg, paths["policy"], gps)
            if resumed is None:
                if owner is not None:
                    owner.publish()  # version 0 of the policy (sharded: a device worker publishes it)
                    gps.pin(cfg.models.policy.name, 0)  # the KL reference and the baseline: never GC'd
                from pivotrl.engines.checkpoints import load_state_dict as load_hf

                gps.publish(cfg.models.genrm.name, 0, load_hf(paths["genrm"]))
                gps.flush()
            elif owner is not None:
                resumed.restore(owner, gps)
                ctx.policy_version = owner.version
            gps_opts = {
                "root": os.path.abspath(gps_root),
                "host_tier": host,
                "device_tier_bytes": cfg.gps.device_tier_bytes,
            }
            if cfg.gps.node_local:
                gps_opts.update(node_local_templates(cfg, gps_root, host))
            cl = cfg.cluster
            log("phase: cluster start")
            with open_cluster(
                workers=workers or cl.workers,
                scheduler=scheduler or cl.scheduler,
                host=cl.host,
                dashboard_address=cl.dashboard_address,
            ) as handle, contextlib.ExitStack() as stack:
                n_dev = len(handle.device_workers())
                if handle.cluster is not None:  # the workers share this machine's cores
                    import torch

                    stack.callback(torch.set_num_threads, torch.get_num_threads())
                    cores = default_workers()  # this machine's usable cores
                    torch.set_num_threads(driver_threads(cores, n_dev, cl.torch_threads))
                if sharded:
                    owner = start_sharded_owner(cfg, handle.client, gps, gps_opts, paths["policy"], resumed)
                    ctx.policy_version = owner.version
                result.devices = n_dev
                if handle.dashboard_link:
                    log(f"dashboard: {handle.dashboard_link}  (pivotrl page: /pivotrl)")
                if controller is None:
                    controller = build_controller(cfg, mode, n_dev, log)
                if resumed is not None and resumed.ckpt.learned is not None:
                    _restore_learned(controller, resumed.ckpt.learned, log)
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
                    node_local_gps=cfg.gps.node_local,
                )
                if cfg.gps.node_local:  # the driver pulls workers' gradient sums and announces its versions
                    stack.enter_context(driver_peers(gps, handle.client))
                with contextlib.suppress(Exception):
                    from pivotrl.runtime.dashboard import register_dashboard

                    register_dashboard(handle.client)
                log(
                    f"run {run_id}: mode={mode}, {n_dev} device workers, {cfg.run.iterations} iterations, "
                    f"{cfg.task.prompts_per_iteration}×{cfg.task.group_size} samples/iteration, "
                    f"{cfg.train.minibatches} optimizer step(s)/iteration"
                )
                pipeline = Pipeline(stages or default_stages(), ctx, session, owner)
                eval_problems = held_out_problems(task, cfg.task.eval_prompts) if evaluate_policy else []
                t_iterations = time.monotonic()
                done_before = 0 if resumed is None else resumed.ckpt.iterations_done
                if resumed is not None:  # metrics and the learning curve continue the checkpoint's
                    result.iterations = list(resumed.ckpt.rows)
                    result.curve, result.eval = list(resumed.ckpt.curve), dict(resumed.ckpt.eval)
                elapsed0 = result.curve[-1]["elapsed_s"] if result.curve else 0.0
                pinned = [None if resumed is None else resumed.ckpt.policy_version]

                def measure(it: int, divert: Any = None) -> float:
                    version, seed = ctx.policy_version, cfg.run.seed
                    acc = evaluate(session, ctx, eval_problems, version, f"it{it}", seed, divert=divert)
                    elapsed = elapsed0 + time.monotonic() - t_iterations
                    result.curve.append({"iteration": it + 1, "elapsed_s": elapsed, "accuracy": acc})
                    return acc

                saved_rows = checkpoint.EncodedRows(persisted(r) for r in result.iterations)

                def commit(res: Any, row: dict[str, Any]) -> None:
                    """Checkpoint after every iteration, then the caller's hook."""
                    result.iterations.append(row)
                    saved_rows.append(persisted(row))
                    ckpt = checkpoint.RunCheckpoint(
                        run_id, res.iteration + 1, owner.version, cfg_json, saved_rows, result.curve,
                        result.eval, learned=session.learned(),
                    )
                    checkpoint.commit(run_dir, ckpt, owner, gps, pinned[0])
                    if resumed is not None and len(result.iterations) == resumed.ckpt.iterations_done + 1:
                        log(f"resume overhead: {owner.first_step_at - t_start:.2f}s from loading the "
                            "checkpoint to the first optimizer step")
                    pinned[0] = owner.version
                    if on_iteration is not None:
                        on_iteration(res, row)

                if eval_problems and "accuracy_before" not in result.eval:
                    log("phase: held-out evaluation of version 0")
                    acc0 = evaluate(session, ctx, eval_problems, 0, "v0", cfg.run.seed)
                    result.eval["accuracy_before"] = acc0
                    result.curve.append({"iteration": 0, "elapsed_s": 0.0, "accuracy": acc0})
                    log(f"held-out accuracy of version 0: {acc0:.1f}%")
                acc0 = result.eval.get("accuracy_before", float("nan"))
                t_iterations = time.monotonic()  # the budget counts learning, not the baseline measurement
                log("phase: iterations")
                run_iterations(
                    pipeline,
                    iterations=cfg.run.iterations,
                    time_budget_s=cfg.run.time_budget_s,
                    log=log,
                    progress=progress,
                    on_iteration=commit,
                    evaluate_every=eval_every,
                    evaluate_fn=measure if eval_problems else None,
                    max_staleness=cfg.run.max_staleness,
                    first_iteration=done_before,
                )
                if eval_problems:
                    acc1 = result.curve[-1]["accuracy"] if result.iterations else acc0
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

                if sharded:  # the driver holds no weights: the store's last version is written out
                    sd = gps.fetch(cfg.models.policy.name, owner.version)
                    from pivotrl.engines.checkpoints import load_config

                    result.final_policy = save_hf(sd, load_config(paths["policy"]), tokenizer,
                                                  run_dir / "policy-final")
                else:
                    result.final_policy = save_hf(
                        owner.model, owner.model.config, tokenizer, run_dir / "policy-final"
                    )
        result.wall_s = time.monotonic() - t_start
        write_metrics(result, run_dir / "metrics.zarr")
        return result
