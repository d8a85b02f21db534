"""Run checkpoints: what `pivotrl-pipeline submit --resume` continues from.

Why: a driver that dies (OOM, preemption, SIGKILL) must not lose the run. After every completed iteration
the driver commits a checkpoint of everything the next iteration depends on and that is not already durable
elsewhere: the optimizer owner's state (weights, AdamW moments, version; `trainer.pt`), the next iteration
to run (the data position: prompts are a function of (seed, iteration)), the metrics rows and learning curve
so far, and the config the run was started with. Policy versions themselves live in the parameter store.

A checkpoint is a directory written in full under a temporary name, fsynced, renamed into place, and then
named by `LATEST` (itself replaced atomically): a kill at any moment leaves either the previous checkpoint
or the new one, never a torn one. The two newest are kept.

Resuming refuses a config that changes what is trained (models, task, data, sampling, judge, optimizer,
seed) with one line naming the first changed field; run length, cluster, scheduler, tiers and engine
capacities may change.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pivotrl import faults
from pivotrl.durable import fsync_dir
from pivotrl.errors import UserError

CHECKPOINTS = "checkpoints"
LATEST = "LATEST"
KEEP = 2

# Config fields a resumed run may change: how long it runs, where and how it is scheduled, what is
# measured. Everything else decides what is trained and must match the checkpoint.
MAY_CHANGE = (
    "run.name",
    "run.storage_root",
    "run.iterations",
    "run.time_budget_s",
    "run.max_staleness",
    "cluster",
    "scheduler",
    "gps.host_tier",
    "gps.device_tier_bytes",
    "gps.keep_last",
    "rollout.engine",
    "reward.engine",
    "task.eval_prompts",
)


class EncodedRows(SequenceABC):
    """A run's metrics rows, each encoded as JSON once, when it is appended.

    Why: a checkpoint after every iteration writes every row so far. Encoding them all again at each
    commit made the commits of a run cost O(iterations²) CPU in the driver (at 200 iterations of the demo,
    seconds of the CPU its two device processes share); with each row's text kept, a commit joins them."""

    def __init__(self, rows: Iterable[Mapping[str, Any]] = ()) -> None:
        self._rows: list[Mapping[str, Any]] = []
        self._text: list[str] = []
        for row in rows:
            self.append(row)

    def append(self, row: Mapping[str, Any]) -> None:
        self._text.append(json.dumps(row, default=_json_default))
        self._rows.append(row)

    def json(self) -> str:
        """The rows as one JSON array, what `json.dumps(list(self))` writes."""
        return "[" + ", ".join(self._text) + "]"

    def __getitem__(self, i: Any) -> Any:
        return self._rows[i]

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[Mapping[str, Any]]:
        return iter(self._rows)


@dataclass
class RunCheckpoint:
    """The driver's state after `iterations_done` iterations (the next to run is that number). `rows` may
    be an `EncodedRows`, whose encoded text the commit writes as it is."""

    run_id: str
    iterations_done: int
    policy_version: int
    config: dict[str, Any]
    rows: SequenceABC[Mapping[str, Any]] = field(default_factory=list)
    curve: list[dict[str, float]] = field(default_factory=list)
    eval: dict[str, float] = field(default_factory=dict)
    # what core's controller had learned (`pivotrl.core.learned.LearnedState.to_json`): shift costs, step-time
    # fits, the last iteration's profile; a resumed run plans from these instead of priors
    learned: dict[str, Any] | None = None


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save(run_dir: Path, ckpt: RunCheckpoint, trainer_state: dict[str, Any]) -> Path:
    """Commit `ckpt` (and the optimizer owner's `trainer_state`) atomically; returns its directory."""
    import torch

    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = f"{ckpt.iterations_done:06d}"
    tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    torch.save(trainer_state, tmp / "trainer.pt")
    with open(tmp / "trainer.pt", "rb+") as f:
        os.fsync(f.fileno())
    faults.point("checkpoint")
    _write(tmp / "state.json", state_json(ckpt))
    fsync_dir(tmp)
    final = root / name
    if final.exists():  # the same iteration committed by an earlier attempt that died before LATEST
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_dir(root)
    pointer = root / f".{LATEST}-{uuid.uuid4().hex[:8]}"
    _write(pointer, name.encode())
    pointer.replace(root / LATEST)
    fsync_dir(root)
    _prune(root, keep=name)
    return final


def _prune(root: Path, keep: str) -> None:
    """Drop all but the `KEEP` newest checkpoints (never `keep`) and temporaries of dead writers (the run
    directory's lease makes this the only writer)."""
    done = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.isdigit())
    for name in done[:-KEEP]:
        if name != keep:
            shutil.rmtree(root / name, ignore_errors=True)
    for p in root.iterdir():
        if p.name.startswith(".tmp-"):
            shutil.rmtree(p, ignore_errors=True)


def state_json(ckpt: RunCheckpoint) -> bytes:
    """`ckpt` as its `state.json`: a JSON object of its fields (rows already encoded are joined, not
    encoded again)."""
    head = {f.name: getattr(ckpt, f.name) for f in fields(ckpt) if f.name != "rows"}
    rows = ckpt.rows.json() if isinstance(ckpt.rows, EncodedRows) else json.dumps(
        list(ckpt.rows), default=_json_default)
    text = json.dumps(head, default=_json_default)
    return (text[:-1] + ', "rows": ' + rows + "}").encode()


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def latest(run_dir: Path) -> Path | None:
    """The committed checkpoint `LATEST` names, or None when the run never completed an iteration."""
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = pointer.parent / name
    if not name.isdigit() or not (path / "state.json").is_file():
        raise UserError(f"{pointer}: names checkpoint {name!r}, which is not there")
    return path


def load(path: Path) -> tuple[RunCheckpoint, dict[str, Any]]:
    """The checkpoint at `path` and its trainer state."""
    import torch

    try:
        state = json.loads((path / "state.json").read_text())
        ckpt = RunCheckpoint(**state)
        trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        raise UserError(f"{path}: unreadable checkpoint ({type(exc).__name__}: {exc})") from None
    return ckpt, trainer_state


def find_run(storage_root: str | Path, spec: str) -> Path:
    """The run directory `--resume SPEC` names: a run id under `storage_root/runs`, or `latest` (the
    newest run there that has a checkpoint)."""
    runs = Path(storage_root) / "runs"
    if spec != "latest":
        if "/" in spec or spec in ("", ".", "..") or "\x00" in spec:
            raise UserError(f"--resume {spec!r}: not a run id")
        path = runs / spec
        if not path.is_dir():
            raise UserError(f"--resume {spec}: no run {spec} under {runs}")
        return path
    candidates = [p for p in runs.iterdir() if (p / CHECKPOINTS / LATEST).is_file()] if runs.is_dir() else []
    if not candidates:
        raise UserError(f"--resume latest: no run with a checkpoint under {runs}")
    return max(candidates, key=lambda p: (p / CHECKPOINTS / LATEST).stat().st_mtime)


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: d}


def changed_field(saved: dict[str, Any], now: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first config field (dotted) that differs between the checkpoint's config and this run's and
    that a resumed run may not change, with both values; None when the run may resume."""
    a, b = _flat(saved), _flat(now)
    for key in sorted(set(a) | set(b)):
        if any(key == m or key.startswith(m + ".") for m in MAY_CHANGE):
            continue
        if a.get(key) != b.get(key):
            return key, a.get(key), b.get(key)
    return None


def check_resumable(saved: dict[str, Any], now: dict[str, Any]) -> None:
    diff = changed_field(saved, now)
    if diff is not None:
        key, old, new = diff
        raise UserError(
            f"--resume: {key} changed since the checkpoint ({old!r} -> {new!r}); it changes what is "
            "trained, so start a new run instead"
        )


@dataclass
class Resumed:
    """A run to continue: its directory, its last checkpoint and the optimizer owner's state there."""

    run_dir: Path
    path: Path
    ckpt: RunCheckpoint
    trainer_state: dict[str, Any]

    def describe(self, iterations: int) -> str:
        c = self.ckpt
        return (
            f"resuming run {c.run_id} at iteration {c.iterations_done} of {iterations} "
            f"(policy version {c.policy_version}, checkpoint {self.path})"
        )

    def restore(self, owner: Any, gps: Any) -> None:
        """Put the optimizer owner back where the checkpoint left it and make the store agree: versions a
        dead driver published after the checkpoint are discarded (they are published again), and the
        checkpoint's own version is republished if it never became durable."""
        import random

        import numpy as np
        import torch

        state = self.trainer_state["trainer"]
        if state.get("sharded"):  # the optimizer state is in the store: the ranks read it at the version
            owner.restore_version(int(state["version"]))
        else:
            owner.trainer.load_state_dict(state)
        rng = self.trainer_state.get("rng")
        if rng:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
        name, v = owner.name, self.ckpt.policy_version
        if owner.version != v:
            raise UserError(f"{self.path}: trainer state is at version {owner.version}, checkpoint says {v}")
        gps.discard_newer(name, v)
        if state.get("sharded"):
            gps.discard_newer(f"{name}.optim", v)
            if v not in gps.versions(name) or v not in gps.versions(f"{name}.optim"):
                raise UserError(f"{self.path}: version {v} of {name!r} or its optimizer state is not in the "
                                "store; a sharded run cannot rebuild it")
        elif v not in gps.versions(name):
            owner.publish()


def resume_point(cfg: Any, spec: str) -> Resumed:
    """The run `--resume SPEC` names, checked against `cfg` (one line naming a field it may not change)."""
    run_dir = find_run(cfg.run.storage_root, spec)
    path = latest(run_dir)
    if path is None:
        raise UserError(f"--resume: run {run_dir.name} has no checkpoint (no iteration completed)")
    ckpt, trainer_state = load(path)
    check_resumable(ckpt.config, cfg.model_dump(mode="json"))
    return Resumed(run_dir, path, ckpt, trainer_state)


def commit(run_dir: Path, ckpt: RunCheckpoint, owner: Any, gps: Any, previous_version: int | None) -> Path:
    """Checkpoint the run after an iteration: the optimizer owner's state and RNGs with `ckpt`. The
    checkpoint's policy version is pinned in the store (its weights must outlive version GC) and the
    previous checkpoint's unpinned (version 0 stays pinned: the KL reference)."""
    import random

    import numpy as np
    import torch

    gps.flush()  # the version the checkpoint names is durable before the checkpoint is
    sharded = hasattr(owner, "settle")
    if sharded:  # the ranks write the optimizer state behind the barrier: committed before it is named
        owner.settle()
    names = [owner.name, f"{owner.name}.optim"] if sharded and ckpt.policy_version > 0 else [owner.name]
    for name in names:
        gps.pin(name, ckpt.policy_version)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    state = owner.checkpoint_state() if sharded else owner.trainer.state_dict()
    path = save(run_dir, ckpt, {"trainer": state, "rng": rng})
    if previous_version not in (None, 0, ckpt.policy_version):
        for name in names:
            with contextlib.suppress(Exception):
                gps.unpin(name, int(previous_version))
    return path
