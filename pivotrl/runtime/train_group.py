"""The train group's mechanism: a `torch.distributed` group of the train-role devices, a bucketed
reduce-scatter of their gradient sums to the ranks that own them, ZeRO-1 (each rank steps AdamW on the
tensors it owns), and the new version written by the ranks — each its shard — and committed by rank 0.

Decisions (who is rank r, which tensors it owns, the buckets) come from `pivotrl.core.train_group`; this
module only executes them. Why a reduce-scatter and not an all-reduce: a rank reads only its own tensors'
reduced gradient, and the clip needs of the others only their norms — each rank computes its own tensors'
norms and one small all-reduce of the per-tensor norm vector (zeros elsewhere: exact) gives every rank the
single owner's vector (`pivotrl.engines.trainer.prepare_step(reduce_norms=...)`), so the clip scale is the
single owner's bit for bit, while the gradient bytes move once instead of twice. The owner adds the parts
in rank order, the order the single owner reduces the same sums in. Why torch AdamW on the owned
parameters (a `GRPOTrainer` whose other parameters never get a gradient, so torch allocates no state for
them): with one rank this *is* the single-owner step, bit for bit.

Every collective waits at most `timeout_s`; a rank that does not answer makes the others raise
`TrainGroupLost` (one line), and rank 0 commits a version only after every rank reported its shard
written, so a lost rank leaves nothing half-committed. The optimizer state and the store's gc run behind
the barrier (`Behind`), at the lowest CPU priority, and the next step (or a checkpoint) finishes them.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pivotrl.core.train_group import TrainGroupPlan, owner_buckets, shard_ranges
from pivotrl.engines.grpo_loss import GradSum, reduce
from pivotrl.engines.trainer import GRPOTrainer, StepStats, prepare_step
from pivotrl.gps import shards
from pivotrl.runtime.shm_exchange import ShmExchange

#: Elements per reduce-scatter bucket (256 K fp32 = 1 MB). A tensor at least this large is a message of its
#: own, sent from (and summed into) its own memory; smaller consecutive ones are packed into one. Measured
#: (benchmarks/train_step.py, medium policy, 2 gloo ranks on one host): pack + exchange + sum ~0.14 s with
#: these, 0.28-0.30 s with 4 M-element buckets, whose packing copied nearly every byte (~0.2 s).
BUCKET_ELEMS = 1 << 18
_ID_BYTES = 96
log = logging.getLogger(__name__)


class TrainGroupLost(RuntimeError):
    """A rank of the train group did not answer within the timeout; nothing was committed."""


@dataclass(frozen=True)
class StepOutcome:
    """What one sharded step did: its statistics, and the versions it committed (None: skipped)."""

    stats: StepStats
    policy_version: int | None = None


class Group:
    """One process's handle on a formed group: the collectives pivotrl uses, each with a timeout."""

    def __init__(self, pg: Any, plan: TrainGroupPlan, rank: int, timeout_s: float, device: str) -> None:
        self.pg, self.plan, self.rank, self.timeout_s, self.device = pg, plan, rank, timeout_s, device

    @property
    def world(self) -> int:
        return self.plan.world

    def _wait(self, work: Any, what: str) -> None:
        try:
            ok = work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise TrainGroupLost(
                f"train group {self.plan.group_id} (world {self.world}): {what} on rank {self.rank} got no "
                f"answer from every rank within {self.timeout_s:g}s ({str(exc).splitlines()[0][:160]})"
            ) from None
        if ok is False:
            raise TrainGroupLost(f"train group {self.plan.group_id}: {what} on rank {self.rank} timed out")

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """NCCL reduces CUDA tensors only: small host-side tensors (counts, flags) go over and back."""
        return t.to(self.device) if backend_for(self.device) == "nccl" and t.device.type == "cpu" else t

    def allreduce_(self, t: torch.Tensor, what: str = "all-reduce") -> torch.Tensor:
        if self.world > 1 or backend_for(self.device) == "nccl":
            d = self._on_device(t)
            self._wait(self.pg.allreduce([d]), what)
            if d is not t:
                t.copy_(d.cpu())
        return t

    def send(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending `t` to rank `dst` (on the group's device for NCCL); `_wait` the returned work."""
        return self.pg.send([self._on_device(t)], dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int) -> Any:
        """Start receiving into `t` (a tensor on the group's device) from rank `src`; `_wait` the work."""
        return self.pg.recv([t], src, tag)

    def broadcast_(self, t: torch.Tensor, root: int = 0, what: str = "broadcast") -> torch.Tensor:
        if self.world > 1 or backend_for(self.device) == "nccl":
            opts = torch.distributed.BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, 0
            d = self._on_device(t)
            self._wait(self.pg.broadcast([d], opts), what)
            if d is not t:
                t.copy_(d.cpu())
        return t

    def broadcast_str(self, s: str, root: int = 0) -> str:
        buf = torch.zeros(_ID_BYTES, dtype=torch.uint8)
        if self.rank == root:
            raw = s.encode()
            buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        self.broadcast_(buf, root, "broadcast of the shard target")
        return bytes(buf.tolist()).rstrip(b"\0").decode()


class Behind:
    """Work behind the barrier: independent `jobs`, then `tail` once they all ran.

    A daemon thread at the lowest CPU priority runs them, so the critical path (rollout devices loading
    the version just committed, the next iteration's work) always wins a contended core. Whoever then
    needs the work done (`finish`: the next step, a checkpoint) does not wait for that starved thread: it
    takes the jobs still left itself, at its own priority, and the tail too if the thread has not begun
    it. The tail runs exactly once; a job's failure skips the rest and is what `finish` returns."""

    def __init__(self, jobs: Sequence[Callable[[], None]], tail: Callable[[], None]) -> None:
        self._it = iter(list(jobs))
        self._left = len(jobs)
        self._cond = threading.Condition()
        self._tail, self._tail_lock, self._tail_done = tail, threading.Lock(), False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._low, daemon=True, name="pivotrl-behind")

    def start(self) -> Behind:
        self._thread.start()
        return self

    def _low(self) -> None:
        _lower_priority()
        self._complete()

    def _complete(self) -> None:
        while True:
            with self._cond:
                job = next(self._it, None) if self.error is None else None
            if job is None:
                break
            try:
                job()
            except BaseException as exc:
                with self._cond:
                    self.error = self.error or exc
            with self._cond:
                self._left -= 1
                self._cond.notify_all()
        with self._cond:  # jobs another thread is still running
            while self._left > 0 and self.error is None:
                self._cond.wait()
        with self._tail_lock:
            if self._tail_done or self.error is not None:
                return
            self._tail_done = True
            try:
                self._tail()
            except BaseException as exc:
                self.error = exc

    def finish(self) -> BaseException | None:
        """Complete the work in this thread (what is left of it), then join the background one."""
        self._complete()
        self._thread.join()
        return self.error


def _lower_priority() -> None:
    """Make the calling thread the host's last claim on a CPU (Linux: a thread's nice value is its own);
    best effort elsewhere."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _housekeeping(job: Callable[[], None] | None) -> None:
    if job is None:
        return
    try:
        job()
    except Exception as exc:  # the store's gc: nothing depends on it having run now
        log.warning("train rank housekeeping failed (retried at the next step): %s: %s",
                    type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")


def backend_for(device: str) -> str:
    """NCCL for CUDA devices, gloo otherwise: one code path, the backend chosen by the device."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def form_group(kv: Any, plan: TrainGroupPlan, rank: int, *, device: str = "cpu",
               timeout_s: float = 60.0) -> Group:
    """Join group `plan.group_id` as `rank` through the key-value store `kv` (a `torch.distributed.Store`
    whose address the scheduler plugin hands out); blocks until every member joined or `timeout_s`."""
    from torch import distributed as dist

    prefix = dist.PrefixStore(f"pivotrl-train-g{plan.group_id}", kv)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if backend_for(device) == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefix, rank, plan.world, opts)
        else:
            pg = dist.ProcessGroupGloo(prefix, rank, plan.world, timeout)
    except RuntimeError as exc:
        raise TrainGroupLost(f"train group {plan.group_id} (world {plan.world}) could not form on rank "
                             f"{rank} within {timeout_s:g}s ({str(exc).splitlines()[0][:160]})") from None
    return Group(pg, plan, rank, timeout_s, device)


_STATS = ("tokens", "samples", "loss_sum", "pg_sum", "kl_ref_sum", "kl_old_sum", "clipped")


class TrainRank:
    """One rank's part of the optimizer: owns the tensors of its run (`core.train_group.shard_ranges`) and
    their AdamW moments; computes nothing about the others' tensors but their gradient's norm."""

    def __init__(self, trainer: GRPOTrainer, group: Group, bucket_elems: int = BUCKET_ELEMS) -> None:
        self.trainer, self.group = trainer, group
        self.names = list(trainer.params)
        sizes = [trainer.params[n].numel() for n in self.names]
        self.runs = shard_ranges(sizes, group.world)
        self.buckets = owner_buckets(self.runs, sizes, bucket_elems)
        self.owned = {self.names[i]: trainer.params[self.names[i]] for i in self.runs[group.rank]}
        self._state_names = self._state_dict_owners()
        self._behind: Behind | None = None
        self._shm: ShmExchange | None = None
        self._shm_tried = False
        #: seconds per phase of the last step and publish (`phase`); reported with the step's statistics,
        #: so the barrier's cost can be attributed (benchmarks/train_step.py) without a profiler.
        self.phases: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Any:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    def _state_dict_owners(self) -> dict[str, int]:
        """state-dict name → rank writing it: a parameter's owner (tied aliases included); buffers: rank 0."""
        by_ptr = {}
        for r, run in enumerate(self.runs):
            for i in run:
                by_ptr[self.trainer.params[self.names[i]].data_ptr()] = r
        return {n: by_ptr.get(t.data_ptr(), 0) for n, t in self.trainer.model.state_dict().items()}

    # -- the step -------------------------------------------------------------------------------------
    def reduce(self, local: GradSum | None, folded: Sequence[GradSum] = ()) -> GradSum:
        """The group's total of the tensors this rank owns: its sum plus the flushed sums it folds in, and
        every other rank's, reduce-scattered in buckets (`owner_buckets`: each bucket goes whole to the
        rank that steps it). Each non-owner sends the owner its part; the owner adds the k parts in rank
        order, ((rank 0 + rank 1) + rank 2) ..., the order the single owner reduces the same sums in.

        Why not an all-reduce: a rank steps only its own tensors, and the clip's norm needs only each
        tensor's norm (`prepare_step(reduce_norms=...)`), so the rest of the reduced gradient is never
        read; an all-reduce moves each byte twice (reduce-scatter + all-gather). Measured on 2 gloo ranks
        of one host, 63 M fp32: ~0.1 s against ~0.26 s."""
        mine = [g for g in ([local] if local is not None else []) + list(folded)]
        t, g = self.trainer, self.group
        own = reduce(mine) if mine else GradSum(grads={}, version=t.version)
        if own.version != t.version:
            raise ValueError(f"gradients are of version {own.version}, the policy is at {t.version}")
        vec = torch.tensor([float(getattr(own, k)) for k in _STATS] + [float(own.nonfinite), 1.0],
                           dtype=torch.float64)
        with self.phase("counts"):  # also where a rank waits for the last one to arrive
            g.allreduce_(vec, "all-reduce of the token counts")
        if int(vec[-1]) != g.world:
            raise TrainGroupLost(f"train group {g.plan.group_id}: {int(vec[-1])} of "
                                 f"{g.world} ranks took part in the step")
        shm = self._shared_memory()
        mine_parts = self._exchange_shared(own, shm) if shm is not None else self._exchange(own)
        grads: dict[str, torch.Tensor] = {}
        with self.phase("sum"):
            for names, parts in mine_parts:
                acc = parts[0]
                for p in parts[1:]:
                    acc.add_(p)
                at = 0
                for n in names:
                    shape = t.params[n].shape
                    k = t.params[n].numel()
                    grads[n] = acc[at : at + k].view(shape)
                    at += k
        return GradSum(grads=grads, tokens=int(vec[0]), samples=int(vec[1]), version=t.version,
                       loss_sum=float(vec[2]), pg_sum=float(vec[3]), kl_ref_sum=float(vec[4]),
                       kl_old_sum=float(vec[5]), clipped=int(vec[6]), nonfinite=bool(vec[7] > 0))

    def _exchange(self, own: GradSum) -> list[tuple[list[str], list[torch.Tensor]]]:
        """Each bucket to its owner over the process group; returns the owned buckets' names and their
        parts by rank (this rank's own, the others' received)."""
        g = self.group
        pending: list[tuple[Any, str]] = []  # (work, what) of every send and receive, waited below
        keep: list[torch.Tensor] = []  # send buffers stay alive until their send completed
        mine_parts: list[tuple[list[str], list[torch.Tensor]]] = []
        with self.phase("pack"):
            for b, (owner, run) in enumerate(self.buckets):
                names = [self.names[i] for i in run]
                flat = self._flat(own, names)
                what = f"reduce-scatter of gradient bucket {names[0]}.."
                if owner != g.rank:
                    pending.append((g.send(flat, owner, b), what))
                    keep.append(flat)
                    continue
                parts = [flat if src == g.rank else torch.empty_like(flat) for src in range(g.world)]
                pending += [(g.recv(parts[src], src, b), what) for src in range(g.world) if src != g.rank]
                mine_parts.append((names, parts))
        with self.phase("exchange"):
            for work, what in pending:
                g._wait(work, what)
        return mine_parts

    def _exchange_shared(self, own: GradSum, shm: ShmExchange) -> list[tuple[list[str], list[torch.Tensor]]]:
        """`_exchange` through the ranks' shared segments (one host): each bucket this rank sends is
        copied into its segment once; the owned buckets' other parts are the senders' segments."""
        g = self.group
        mine_parts: list[tuple[list[str], list[torch.Tensor]]] = []
        with self.phase("pack"):
            for b, (owner, run) in enumerate(self.buckets):
                names = [self.names[i] for i in run]
                if owner != g.rank:
                    self._flat_into(own, names, shm.out(b))
                    continue
                parts = [self._flat(own, names) if src == g.rank else shm.part(src, b)
                         for src in range(g.world)]
                mine_parts.append((names, parts))
        with self.phase("exchange"):  # every segment written (and every rank alive)
            g.allreduce_(torch.ones(1, dtype=torch.float64), "shared-memory exchange of the gradients")
        return mine_parts

    def _shared_memory(self) -> ShmExchange | None:
        """The group's shared-memory transport, mapped at the first step (every rank decides alike)."""
        if not self._shm_tried:
            self._shm_tried = True
            params = self.trainer.params
            sizes = []
            for _owner, run in self.buckets:
                dtypes = {params[self.names[i]].dtype for i in run}
                if len(dtypes) != 1:
                    return None  # a bucket of mixed dtypes: the process group's transport
                sizes.append((sum(params[self.names[i]].numel() for i in run), dtypes.pop()))
            self._shm = ShmExchange.open(self.group, self.buckets, sizes)
        return self._shm

    def _flat_into(self, own: GradSum, names: list[str], out: torch.Tensor) -> None:
        """Bucket `names` of this rank's sum written into `out` (one copy, no temporary)."""
        at = 0
        for n in names:
            k = self.trainer.params[n].numel()
            if n in own.grads:
                out[at : at + k].copy_(own.grads[n].detach().reshape(-1))
            else:
                out[at : at + k].zero_()
            at += k

    def _flat(self, own: GradSum, names: list[str]) -> torch.Tensor:
        """One bucket of this rank's sum as one flat tensor: a tensor alone in its bucket is sent (or
        summed into, by its owner) as a view of itself — no copy; a bucket of small tensors is packed.
        Why: packing the whole model's gradient was a copy of every byte before the exchange."""
        if len(names) == 1 and names[0] in own.grads and own.grads[names[0]].is_contiguous():
            return own.grads[names[0]].detach().view(-1)
        parts = [own.grads.get(n, self.trainer.params[n]) for n in names]  # (a param: only its shape, dtype)
        dtype = functools.reduce(torch.promote_types, [t.dtype for t in parts])
        out = torch.empty(sum(t.numel() for t in parts), dtype=dtype, device=parts[0].device)
        self._flat_into(own, names, out)
        return out

    def step(self, local: GradSum | None, folded: Sequence[GradSum] = ()) -> StepStats:
        """Reduce-scatter, then AdamW on the owned tensors only; the version advances on every rank.

        The sums are consumed: their tensors may be reused in place (a flushed sum handed over, or one
        read from the store, is the rank's alone)."""
        self.phases = {}
        with self.phase("settle"):
            self.settle()
        total = self.reduce(local, folded)
        with self.phase("clip"):  # each rank computes its own tensors' norms; one small all-reduce joins them
            stats, grads = prepare_step(total, self.trainer.grad_clip, only=self.owned, in_place=True,
                                        order=self.names,
                                        reduce_norms=lambda v: self.group.allreduce_(v, "all-reduce of the "
                                                                                     "gradient norms"))
        if grads is None:
            self.trainer.skipped_steps += stats.reason.startswith("non-finite")
            return stats
        with self.phase("adam"):
            self.trainer.step_params(self.owned, grads)
        stats.version = self.trainer.version
        return stats

    # -- the store ------------------------------------------------------------------------------------
    def weight_shard(self) -> dict[str, torch.Tensor]:
        sd = self.trainer.model.state_dict()
        return {n: sd[n] for n, r in self._state_names.items() if r == self.group.rank}

    def optim_shard(self) -> dict[str, torch.Tensor]:
        """The owned tensors' AdamW state by name (`exp_avg/<param>` ...), and rank 0's counters."""
        opt = self.trainer.optimizer
        out: dict[str, torch.Tensor] = {}
        for n, p in self.owned.items():
            for k, v in opt.state.get(p, {}).items():
                out[f"{k}/{n}"] = v
        if self.group.rank == 0:
            out["meta/steps_applied"] = torch.tensor(self.trainer.steps_applied, dtype=torch.int64)
            out["meta/skipped_steps"] = torch.tensor(self.trainer.skipped_steps, dtype=torch.int64)
        return out

    def publish(self, store: Any, model: str, version: int | None = None, optim_behind: bool = False,
                then: Callable[[], None] | None = None) -> int:
        """Write this rank's shards of the policy `version` (default: the trainer's) and of its optimizer
        state (`<model>.optim`); rank 0 commits each once every rank's shard of it is written.

        `optim_behind`: the optimizer state is written in the background after the policy is committed
        (off the barrier's critical path: rollouts can start on the new version meanwhile); `settle()`
        waits for it, and the next `step` settles first, so the moments are never written while AdamW
        changes them. `then`: housekeeping (the store's gc) run after it, behind the barrier too; a failure
        there is logged, not raised (the next gc retries)."""
        v = self.trainer.version if version is None else int(version)
        g = self.group
        self.settle()
        with self.phase("targets"):
            targets = [shards.new_target(f"{model}.optim", v, g.world), shards.new_target(model, v, g.world)]
            ids = [g.broadcast_str(t.data_id) for t in targets]
        optim, policy = (shards.ShardTarget(t.model, t.version, i, t.nshards)
                         for t, i in zip(targets, ids, strict=True))
        ok = torch.ones(1, dtype=torch.float64)
        try:
            if not optim_behind:
                with self.phase("optim_write"):
                    shards.write_shard(store, optim, g.rank, self.optim_shard())
            with self.phase("shard_write"):
                shards.write_shard(store, policy, g.rank, self.weight_shard())
        except Exception:
            ok.zero_()
            g.allreduce_(ok, "shard-written barrier")
            raise
        with self.phase("written_barrier"):
            g.allreduce_(ok, "shard-written barrier")
        if int(ok) != g.world:
            raise TrainGroupLost(f"train group {g.plan.group_id}: a rank failed to write its shard of "
                                 f"{model!r} version {v}; nothing committed")
        done = torch.zeros(1, dtype=torch.float64)
        with self.phase("commit"):
            if g.rank == 0:
                if not optim_behind:
                    shards.commit_shards(store, optim)
                shards.commit_shards(store, policy, order=list(self._state_names))
                done.fill_(1.0)
            g.broadcast_(done, 0, "commit notice")
        if optim_behind:
            self._behind = self._write_optim(store, optim, then)
        else:
            _housekeeping(then)
        return v

    def _write_optim(self, store: Any, target: shards.ShardTarget, then: Callable[[], None] | None = None
                     ) -> Behind:
        """The optimizer state's write, started behind the barrier (`Behind`: at the lowest CPU priority,
        finished at normal priority by `settle`): the version just committed is being loaded by the rollout
        devices now, and on a host whose cores the ranks share with them (measured: 2 ranks and a reader
        on 2 cores) the moments' write at normal priority made that load 15-40x slower (0.07 s -> 1-3 s)."""
        jobs, finish = shards.plan_shard(store, target, self.group.rank, self.optim_shard())

        def tail() -> None:
            finish()
            if self.group.rank == 0:
                shards.wait_parts(store, target, self.group.timeout_s)
                shards.commit_shards(store, target)
            _housekeeping(then)

        return Behind(jobs, tail).start()

    def settle(self) -> None:
        """Finish the background write of the optimizer state (this thread takes what is left of it at its
        own priority); raise its failure (one line)."""
        b, self._behind = self._behind, None
        err = b.finish() if b is not None else None
        if err is not None:
            raise TrainGroupLost(f"train group {self.group.plan.group_id}: the optimizer state was not "
                                 f"committed: {type(err).__name__}: {str(err).splitlines()[0][:200]}")

    def load_optim(self, store: Any, model: str, version: int) -> None:
        """This rank's optimizer state from `<model>.optim` at `version`: only its own tensors' slices are
        read (a store fetch by name reads byte ranges), whatever the world size that wrote them."""
        want = [f"{k}/{n}" for n in self.owned for k in ("step", "exp_avg", "exp_avg_sq")]
        man = store.manifest(f"{model}.optim", version)
        present = set(man.names)
        got = store.fetch(f"{model}.optim", version, names=[w for w in want if w in present]
                          + ["meta/steps_applied", "meta/skipped_steps"])
        opt = self.trainer.optimizer
        for n, p in self.owned.items():
            if f"exp_avg/{n}" in got:
                opt.state[p] = {k: got[f"{k}/{n}"].clone() for k in ("step", "exp_avg", "exp_avg_sq")}
        self.trainer.steps_applied = int(got["meta/steps_applied"])
        self.trainer.skipped_steps = int(got["meta/skipped_steps"])
        self.trainer.version = int(version)

    def refresh(self, store: Any, model: str, version: int) -> None:
        """Load the tensors other ranks stepped from the committed `version` (this rank's own are current),
        so the rank computes its next gradients at the new policy."""
        others = [n for n, r in self._state_names.items() if r != self.group.rank]
        if not others:
            return
        got = store.fetch(model, version, names=others, copy=False)
        sd = self.trainer.model.state_dict()
        with torch.no_grad():  # in place: tied aliases and the owned tensors stay as they are
            for n in others:
                sd[n].copy_(got[n])
