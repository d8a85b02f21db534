"""The sharded train group (ZeRO-1 over gloo) against the single optimizer owner, in fp64.

Ranks are threads of this process, each with its own model copy and its own gloo process group over one
in-process key-value store: the collectives, the shard writes and the manifest commit are the real ones.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import distributed as dist

from pivotrl.core.train_group import TrainGroupPlan, decide_group
from pivotrl.engines.grpo_loss import compute_grad_sum, reduce
from pivotrl.engines.trainer import GRPOTrainer
from pivotrl.gps import NotFoundError, ParameterStore
from pivotrl.runtime.shm_exchange import ENV_SWITCH, SHM_DIR
from pivotrl.runtime.train_group import TrainGroupLost, TrainRank, form_group
from tests.engines.test_trainer import PAD, random_samples, tiny_model

NAME = "policy"
KW: dict[str, Any] = {"pad_id": PAD, "lr": 0.05, "micro_batch": 3, "grad_clip": 0.5, "weight_decay": 0.01,
                      "warmup_steps": 2}
TIMEOUT = 20.0


def _trainer() -> GRPOTrainer:
    return GRPOTrainer(tiny_model(0, torch.float64), **KW)


def _sum(trainer: GRPOTrainer, samples: list) -> Any:
    return compute_grad_sum(trainer.model, samples, pad_id=PAD, micro_batch=3, version=trainer.version)


class Ranks:
    """The ranks of successive groups over one store; each group formed afresh when membership changes."""

    def __init__(self, root: Path) -> None:
        self.store = ParameterStore(root / "gps", write_behind=False)
        self.plan: TrainGroupPlan | None = None
        self.kv = dist.HashStore()
        ref = _trainer()
        self.store.publish(NAME, 0, ref.model.state_dict())

    def step(self, world: int, samples: list, departed: list | None = None, version: int = 0,
             lose: int | None = None, lose_at: str = "step") -> list[Any]:
        """One step of `world` ranks on disjoint slices of `samples`; rank 0 folds in `departed`'s sum."""
        self.plan = decide_group(self.plan, [f"w{i}" for i in range(world)], step=version)
        plan = self.plan

        def run(rank: int) -> Any:
            t = _trainer()
            t.model.load_state_dict(self.store.fetch(NAME, version))
            group = form_group(self.kv, plan, rank, timeout_s=TIMEOUT if lose is None else 3.0)
            tr = TrainRank(t, group, bucket_elems=300)
            if version > 0:
                tr.load_optim(self.store, NAME, version)
            t.version = version
            if lose == rank and lose_at == "step":
                return "lost"
            mine = _sum(t, samples[rank::world])
            folded = [_sum(t, departed)] if departed and rank == 0 else []
            stats = tr.step(mine, folded)
            if lose == rank and lose_at == "publish":
                return "lost"
            tr.publish(self.store, NAME)
            tr.refresh(self.store, NAME, t.version)
            return stats, t, tr

        with ThreadPoolExecutor(world) as ex:
            futs = [ex.submit(run, r) for r in range(world)]
            return [f.exception() or f.result() for f in futs]


def _reference(steps: list[tuple[list, list | None]]) -> GRPOTrainer:
    ref = _trainer()
    for samples, departed in steps:
        sums = [_sum(ref, samples)] + ([_sum(ref, departed)] if departed else [])
        ref.apply(reduce(sums))
    return ref


def _assert_committed_exactly(store: ParameterStore, version: int, ref: GRPOTrainer) -> None:
    """The committed `version` and its optimizer state are the single owner's, bit for bit."""
    got = store.fetch(NAME, version)
    assert all(torch.equal(got[k], v) for k, v in ref.model.state_dict().items())
    opt = store.fetch(f"{NAME}.optim", version)
    for n, p in ref.params.items():
        assert torch.equal(opt[f"exp_avg_sq/{n}"], ref.optimizer.state[p]["exp_avg_sq"])


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(params=["shared-memory", "gloo"])
def transport(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every multi-rank test twice: ranks of one host exchange through shared memory, or (switched off)
    over the gloo process group; both must give the same bits."""
    monkeypatch.setenv(ENV_SWITCH, "1" if request.param == "shared-memory" else "0")
    yield request.param
    assert not list(SHM_DIR.glob("pivotrl-train-*"))  # the segments' files are gone once mapped


def test_one_rank_is_bit_identical_to_the_single_owner(tmp_path: Path) -> None:
    ranks = Ranks(tmp_path)
    batches = [random_samples(7, s) for s in (1, 2)]
    for v, b in enumerate(batches):
        (out,) = ranks.step(1, b, version=v)
        assert not isinstance(out, BaseException), out
    ref = _reference([(b, None) for b in batches])
    _assert_committed_exactly(ranks.store, 2, ref)


def test_two_ranks_with_a_departed_sum_and_reshards_match_the_single_owner(tmp_path: Path,
                                                                          transport: str) -> None:
    """2 ranks (+ a departed replica's flushed sum) → 1 rank → 2 ranks → 4 ranks, each step re-sharding
    the optimizer state it reads from the store."""
    ranks = Ranks(tmp_path)
    plan = [(2, random_samples(8, 1), random_samples(3, 9)), (1, random_samples(6, 2), None),
            (2, random_samples(9, 3), None), (4, random_samples(8, 4), random_samples(2, 5))]
    for v, (world, samples, departed) in enumerate(plan):
        out = ranks.step(world, samples, departed, version=v)
        assert all(not isinstance(o, BaseException) for o in out), out
        norms = {o[0].grad_norm for o in out}
        assert len(norms) == 1  # every rank clips by the same norm
        for _, t, _tr in out:  # every rank's model is the committed version after `refresh`
            assert _max_diff(t.model.state_dict(), ranks.store.fetch(NAME, v + 1)) == 0.0
    # the reference sees each step's samples in the ranks' order: slice 0, (departed), slice 1, ...
    ref = _reference([(s, d) for _, s, d in plan])
    assert _max_diff(ranks.store.fetch(NAME, len(plan)), ref.model.state_dict()) <= 1e-10
    opt = ranks.store.fetch(f"{NAME}.optim", len(plan))
    for n, p in ref.params.items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert float((opt[f"{k}/{n}"] - ref.optimizer.state[p][k]).abs().max()) <= 1e-10
    assert int(opt["meta/steps_applied"]) == ref.steps_applied == len(plan)


@pytest.mark.parametrize("lose_at", ["step", "publish"])
def test_a_lost_rank_stops_the_step_with_one_line_and_commits_nothing(tmp_path: Path, lose_at: str,
                                                                      transport: str) -> None:
    ranks = Ranks(tmp_path)
    out = ranks.step(2, random_samples(6, 1), version=0, lose=1, lose_at=lose_at)
    assert out[1] == "lost"
    assert isinstance(out[0], TrainGroupLost), out[0]
    assert "\n" not in str(out[0]) and "within 3s" in str(out[0])
    with pytest.raises(NotFoundError):
        ranks.store.fetch(NAME, 1)
    with pytest.raises(NotFoundError):
        ranks.store.fetch(f"{NAME}.optim", 1)


def test_four_ranks_reduce_in_the_single_owners_order_bit_for_bit(tmp_path: Path, transport: str) -> None:
    """The reduce-scatter adds the ranks' parts in rank order (rank 0's with its folded sum first), the
    order `reduce` takes the same sums in: given the same sums, 4 ranks step exactly as the single owner,
    whichever the transport."""
    ranks = Ranks(tmp_path)
    ref = _trainer()
    ref.model.load_state_dict(ranks.store.fetch(NAME, 0))
    sums = [_sum(ref, random_samples(4, 20 + i)) for i in range(4)]
    departed = _sum(ref, random_samples(3, 30))
    plan = decide_group(None, [f"w{i}" for i in range(4)], step=0)

    def run(rank: int) -> Any:
        t = _trainer()
        t.model.load_state_dict(ranks.store.fetch(NAME, 0))  # (models built in threads share one RNG)
        group = form_group(ranks.kv, plan, rank, timeout_s=TIMEOUT)
        tr = TrainRank(t, group, bucket_elems=300)
        folded = [departed] if rank == 0 else []
        stats = tr.step(sums[rank], folded)
        tr.publish(ranks.store, NAME)
        assert (tr._shm is not None) == (transport == "shared-memory")
        return stats

    with ThreadPoolExecutor(4) as ex:
        out = [f.result() for f in [ex.submit(run, r) for r in range(4)]]
    want = ref.apply(reduce([sums[0], departed, *sums[1:]]))
    assert not want.skipped and {o.grad_norm for o in out} == {want.grad_norm}
    _assert_committed_exactly(ranks.store, 1, ref)


def test_ranks_on_different_hosts_keep_to_the_process_group(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks whose host ids differ (here: each thread its own) all decide on gloo, and still step right."""
    import threading

    from pivotrl.runtime import shm_exchange

    monkeypatch.setattr(shm_exchange, "host_id", lambda: threading.get_ident() % (1 << 40))
    ranks = Ranks(tmp_path)
    samples = random_samples(6, 3)
    out = ranks.step(2, samples, version=0)
    ref = _reference([(samples, None)])
    assert all(tr._shm is None and tr._shm_tried for _stats, _t, tr in out)
    assert _max_diff(ranks.store.fetch(NAME, 1), ref.model.state_dict()) <= 1e-10


def test_a_shared_memory_too_small_for_one_rank_keeps_every_rank_on_the_process_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank cannot reserve its segment (a container's small /dev/shm: ENOSPC): no rank uses shared
    memory, nothing is left in /dev/shm, and the step is still right."""
    import errno
    import threading

    from pivotrl.runtime import shm_exchange

    real, calls, lock = shm_exchange.os.posix_fallocate, [], threading.Lock()

    def second_fails(fd: int, offset: int, length: int) -> None:
        with lock:
            calls.append(length)
            n = len(calls)
        if n == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(shm_exchange.os, "posix_fallocate", second_fails)
    monkeypatch.setenv(ENV_SWITCH, "1")
    ranks = Ranks(tmp_path)
    samples = random_samples(6, 4)
    out = ranks.step(2, samples, version=0)
    assert len(calls) == 2 and all(tr._shm is None and tr._shm_tried for _stats, _t, tr in out)
    assert not list(SHM_DIR.glob("pivotrl-train-*"))
    assert _max_diff(ranks.store.fetch(NAME, 1), _reference([(samples, None)]).model.state_dict()) <= 1e-10


def test_a_handed_over_sum_is_taken_once_and_only_at_its_version() -> None:
    from pivotrl.engines.grpo_loss import GradSum
    from pivotrl.runtime.handover import hand_over, take

    gs = GradSum(grads={"w": torch.ones(2)}, tokens=3)
    hand_over("grad-wx", 4, gs)
    assert take("grad-wx", 3) is None  # another version: read from the store
    assert take("grad-wx", 4) is gs
    assert take("grad-wx", 4) is None  # taken: the process holds it no longer
    hand_over("grad-wx", 5, gs)
    hand_over("grad-wx", 6, gs)  # a newer flush replaces the older one
    assert take("grad-wx", 5) is None and take("grad-wx", 6) is gs
