"""The optimizer owner of GRPO: reduces the gradient sums that any number of train replicas computed
(`pivotrl.engines.grpo_loss`), divides by the iteration's token count, clips and steps AdamW.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pivotrl.engines.grpo_loss import GradSum, LossConfig, TrainSample, compute_grad_sum, reduce

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------
# The optimizer owner
# ----------------------------------------------------------------------------------------------------


@dataclass
class StepStats:
    version: int  # policy version after this step (unchanged when skipped)
    skipped: bool
    reason: str = ""
    tokens: int = 0
    samples: int = 0
    loss: float = 0.0
    pg_loss: float = 0.0
    kl_ref: float = 0.0
    kl_old: float = 0.0
    clip_frac: float = 0.0
    grad_norm: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


def prepare_step(total: GradSum, grad_clip: float, only: Iterable[str] | None = None,
                 reduce_norms: Callable[[torch.Tensor], torch.Tensor] | None = None, in_place: bool = False,
                 order: Sequence[str] | None = None) -> tuple[StepStats, dict[str, torch.Tensor] | None]:
    """The step's statistics and its clipped, token-normalised gradients (None: the step is skipped).

    Shared by the single optimizer owner and every rank of a sharded train group (each holds the whole
    all-reduced sum), so the clip scale, computed from the same per-tensor norms the same way, is the same
    on all. `only`: the names whose clipped gradients are wanted (a rank's own tensors).

    The clip norm is the norm of the vector of per-tensor norms (each tensor normalised, in fp64), in the
    order `order` (default: `total.grads`'). Without `reduce_norms` every entry is computed here. With it
    (a rank), only the `only` entries are, and `total.grads` need hold no other tensor; the others stay
    0.0 and `reduce_norms` (an all-reduce sum over the group, whose ranks own disjoint names) fills them
    in — adding zeros is exact, so every rank gets the single owner's vector bit for bit while each
    computes only its own share of the model's norms and holds only its own tensors' reduced gradient.
    `in_place`: the sums' tensors may be overwritten (a rank's own reduce buffers): normalise and scale in
    place, allocating nothing model-sized.
    """
    n = max(total.tokens, 1)
    stats = StepStats(
        version=total.version,
        skipped=False,
        tokens=total.tokens,
        samples=total.samples,
        loss=total.loss_sum / n,
        pg_loss=total.pg_sum / n,
        kl_ref=total.kl_ref_sum / n,
        kl_old=total.kl_old_sum / n,
        clip_frac=total.clipped / n,
    )
    if total.tokens == 0:
        stats.skipped, stats.reason = True, "no response tokens"
        return stats, None
    keep = set(total.grads) if only is None else set(only)
    grads: dict[str, torch.Tensor] = {}
    names = list(total.grads) if order is None else list(order)
    norms = torch.zeros(len(names), dtype=torch.float64)
    for i, name in enumerate(names):
        if reduce_norms is not None and name not in keep:
            continue  # another rank's tensor: its norm comes from `reduce_norms`
        g = total.grads[name]
        gn = g.div_(n) if in_place else g / n
        norms[i] = torch.linalg.vector_norm(gn.double())
        if name in keep:
            grads[name] = gn
    if reduce_norms is not None:
        norms = reduce_norms(norms)
    norm = torch.linalg.vector_norm(norms)
    stats.grad_norm = float(norm)
    if total.nonfinite or not math.isfinite(stats.grad_norm) or not math.isfinite(stats.loss):
        stats.skipped, stats.reason = True, "non-finite loss or gradient: step skipped, weights unchanged"
        log.warning("GRPO step at version %d skipped: %s", total.version, stats.reason)
        return stats, None
    scale = min(1.0, grad_clip / (stats.grad_norm + 1e-12))
    if in_place:
        return stats, {name: g.mul_(scale) for name, g in grads.items()}
    return stats, {name: g * scale for name, g in grads.items()}


def adamw(params: list[torch.nn.Parameter], **kw: Any) -> torch.optim.AdamW:
    """torch's fused AdamW where every parameter is on a CPU or CUDA device (one pass over each tensor's
    parameter, gradient and moments), else its default.

    Why: torch's default on CPU is the per-tensor loop of separate elementwise ops, each a pass over memory.
    Measured on the 63 M-parameter `medium` policy, one thread: 0.31 s per step against 0.043 s fused; the
    result differs by rounding only (fp32: <= 2e-8 after 5 steps; fp64: identical)."""
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **kw)


class GRPOTrainer:
    """Holds the policy, the (optional) frozen reference and the one AdamW state of the run.

    Single process: ``step(samples)``. Elastic: replicas call ``compute_grad_sum`` (or ``accumulate`` here),
    someone calls ``reduce``, and the owner calls ``apply`` once per iteration.
    """

    @classmethod
    def from_train_config(cls, train: Any, model: torch.nn.Module, pad_id: int,
                          ref_model: torch.nn.Module | None = None) -> GRPOTrainer:
        """The optimizer a run's ``train`` config section describes; the one constructor both the driver's
        optimizer owner and a sharded train rank use, so the two cannot drift apart."""
        return cls(model, pad_id=pad_id, lr=train.lr, clip_eps=train.clip_eps, kl_coef=train.kl_coef,
                   micro_batch=train.micro_batch, grad_clip=train.grad_clip,
                   weight_decay=train.weight_decay, warmup_steps=train.warmup_steps, ref_model=ref_model)

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_id: int,
        lr: float = 1e-4,
        clip_eps: float = 0.2,
        kl_coef: float = 0.0,
        micro_batch: int = 16,
        grad_clip: float = 1.0,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        temperature: float = 1.0,
        ref_model: torch.nn.Module | None = None,
        version: int = 0,
        warmup_steps: int = 0,
    ) -> None:
        self.model = model
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.eval()
            for p in ref_model.parameters():
                p.requires_grad_(False)
        self.pad_id = pad_id
        self.micro_batch = micro_batch
        self.grad_clip = grad_clip
        self.loss_cfg = LossConfig(clip_eps=clip_eps, kl_coef=kl_coef, temperature=temperature)
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.optimizer = adamw(list(self.params.values()), lr=lr, betas=betas, weight_decay=weight_decay)
        self.version = version
        self.skipped_steps = 0
        self.lr = lr
        self.warmup_steps = warmup_steps
        self.steps_applied = 0  # drives the warm-up; part of the checkpoint

    # -- gradients ---------------------------------------------------------------------------------
    def accumulate(self, samples: Sequence[TrainSample]) -> GradSum:
        """This process's share of the iteration (a train replica that also owns the optimizer)."""
        return compute_grad_sum(
            self.model,
            samples,
            pad_id=self.pad_id,
            micro_batch=self.micro_batch,
            loss=self.loss_cfg,
            ref_model=self.ref_model,
            version=self.version,
        )

    reduce = staticmethod(reduce)

    def apply(self, total: GradSum) -> StepStats:
        """Normalise by the global token count, guard against NaN/inf, clip, step AdamW once."""
        if total.version != self.version:
            raise ValueError(f"gradients are of version {total.version}, the policy is at {self.version}")
        stats, grads = prepare_step(total, self.grad_clip)
        if grads is None:
            self.skipped_steps += stats.reason.startswith("non-finite")
            return stats
        self.step_params(self.params, grads)
        stats.version = self.version
        return stats

    def step_params(self, params: dict[str, torch.nn.Parameter], grads: dict[str, torch.Tensor]) -> None:
        """AdamW over `params` (all of the model, or the shard a train rank owns) with clipped `grads`."""
        for name, p in params.items():
            p.grad = grads[name].to(p.dtype).to(p.device)
        # Linear warm-up: Adam's first updates are ~lr * sign(g) for every weight, which on a noisy RL
        # gradient is a large random kick; ramping lr lets the moment estimates settle first.
        warm = min(1.0, (self.steps_applied + 1) / self.warmup_steps) if self.warmup_steps > 0 else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * warm
        self.optimizer.step()
        self.steps_applied += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    def step(self, samples: Sequence[TrainSample]) -> StepStats:
        return self.apply(self.accumulate(samples))

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "skipped_steps": self.skipped_steps,
            "steps_applied": self.steps_applied,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.steps_applied = int(state.get("steps_applied", 0))

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Weights, AdamW moments and the version, written atomically (tmp file + rename)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "trainer.pt.tmp"
        torch.save(self.state_dict(), tmp)
        tmp.replace(d / "trainer.pt")
        meta = {"version": self.version, "skipped_steps": self.skipped_steps}
        (d / "trainer.json").write_text(json.dumps(meta))
        return d / "trainer.pt"

    def load_checkpoint(self, directory: str | Path) -> None:
        path = Path(directory) / "trainer.pt"
        if not path.is_file():
            from pivotrl.errors import UserError

            raise UserError(f"{path}: no trainer checkpoint there")
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))
