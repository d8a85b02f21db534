"""The train role's context computes exactly the trainer's gradient sum, KL-to-reference included."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pivotrl.engines.checkpoints import from_pretrained, load_state_dict
from pivotrl.engines.grpo_loss import LossConfig, TrainSample, compute_grad_sum
from pivotrl.runtime.messages import GradResult, WorkItem
from pivotrl.runtime.roles import TrainContext


class _Store:
    """The two GPS calls a train context makes, over in-memory versions."""

    def __init__(self, versions: dict[int, dict[str, torch.Tensor]]) -> None:
        self.versions_ = versions

    def fetch(self, model, version, device="cpu"):
        return {k: v.clone() for k, v in self.versions_[version].items()}


def test_kl_reference_comes_from_the_gps_and_matches_the_trainer(debug_model_dir):
    torch.manual_seed(0)
    ref_sd = load_state_dict(debug_model_dir)
    cur_sd = {k: v + 0.01 * torch.randn_like(v) for k, v in ref_sd.items()}  # policy has moved from v0
    env = SimpleNamespace(device="cpu", gps=_Store({0: ref_sd, 3: cur_sd}), name="w0")
    spec = {
        "model": "policy",
        "hf_dir": str(debug_model_dir),
        "micro_batch": 4,
        "clip_eps": 0.2,
        "kl_coef": 0.1,
        "ref_version": 0,
        "pad_id": 0,
        "version": 3,
    }
    ctx = TrainContext("train", spec)
    ctx.load(env, cur_sd)
    items = [
        WorkItem(
            f"s{i}",
            "train",
            {
                "prompt_ids": [1, 5 + i, 7],
                "response_ids": [9, 10 + i, 2],
                "advantage": 0.5 - i * 0.3,
                "logprobs": None,
            },
        )
        for i in range(3)
    ]
    for it in items:
        ctx.add(it)
    done, sample = ctx.step()
    assert [r.id for r in done] == ["s0", "s1", "s2"] and sample.concurrency == 3 and sample.tokens == 18

    policy, ref = from_pretrained(debug_model_dir), from_pretrained(debug_model_dir)
    policy.load_state_dict(cur_sd)
    ref.load_state_dict(ref_sd)
    samples = [TrainSample([1, 5 + i, 7], [9, 10 + i, 2], 0.5 - i * 0.3) for i in range(3)]
    want = compute_grad_sum(
        policy,
        samples,
        pad_id=0,
        micro_batch=4,
        loss=LossConfig(clip_eps=0.2, kl_coef=0.1),
        ref_model=ref,
        version=3,
    )
    no_kl = compute_grad_sum(policy, samples, pad_id=0, micro_batch=4, loss=LossConfig(), version=3)
    for name, g in want.grads.items():
        torch.testing.assert_close(ctx.sum.grads[name], g, rtol=1e-4, atol=1e-6)
    assert any(not torch.allclose(no_kl.grads[n], g) for n, g in want.grads.items())  # the KL term mattered


def test_flush_publishes_the_sum_and_hands_in_a_grad_result(debug_model_dir, tmp_path):
    from pivotrl.gps import ParameterStore

    sd = load_state_dict(debug_model_dir)
    with ParameterStore(tmp_path / "gps", device_tier_bytes=0) as gps:
        env = SimpleNamespace(device="cpu", gps=gps, name="7")
        spec = {"model": "policy", "hf_dir": str(debug_model_dir), "micro_batch": 2, "version": 0}
        ctx = TrainContext("train", spec)
        ctx.load(env, sd)
        assert ctx.flush() is None  # nothing accumulated
        for i in range(3):
            payload = {"prompt_ids": [1, 4], "response_ids": [5 + i], "advantage": 1.0}
            ctx.add(WorkItem(f"t{i}", "train", payload))
        while ctx.has_work():
            ctx.step()
        g = ctx.flush()
        assert isinstance(g, GradResult) and g.model == "grad-w7" and g.version == 0
        assert g.items == ["t0", "t1", "t2"] and g.stats.samples == 3 and g.stats.tokens == 3
        assert set(gps.fetch("grad-w7", 0)) == {n for n, _ in ctx.model.named_parameters()}
        assert ctx.parkable()  # nothing unflushed left in it


def test_flush_hands_the_sum_over_to_this_devices_rank_only_when_asked(debug_model_dir, tmp_path):
    """`hand_over` (the sharded owner): the flushed sum is kept in this process for the rank here and not
    written (nothing else reads a sum its rank takes); offloaded untaken, it is written for rank 0. Without
    it (the driver owner) it is in the store when `flush` returns and nothing is kept."""
    from pivotrl.gps import NotFoundError, ParameterStore
    from pivotrl.runtime.handover import take

    sd = load_state_dict(debug_model_dir)
    with ParameterStore(tmp_path / "gps", device_tier_bytes=0) as gps:
        for hand_over in (False, True):
            env = SimpleNamespace(device="cpu", gps=gps, name=f"h{int(hand_over)}")
            spec = {"model": "policy", "hf_dir": str(debug_model_dir), "micro_batch": 2, "version": 0,
                    "hand_over": hand_over}
            ctx = TrainContext("train", spec)
            ctx.load(env, sd)
            ctx.add(WorkItem("t0", "train", {"prompt_ids": [1, 4], "response_ids": [5], "advantage": 1.0}))
            ctx.step()
            g = ctx.flush()
            if not hand_over:
                assert take(g.model, g.version) is None
                assert gps.fetch(g.model, g.version)
                continue
            with pytest.raises(NotFoundError):
                gps.fetch(g.model, g.version)
            got = take(g.model, g.version)
            assert got.tokens == g.stats.tokens
            ctx.load(env, sd)  # flushed again, then the device leaves the train role: written, not kept
            ctx.add(WorkItem("t1", "train", {"prompt_ids": [1, 4], "response_ids": [6], "advantage": 1.0}))
            ctx.step()
            g2 = ctx.flush()
            assert g2.version == g.version + 1  # the first one is not in the store, yet its version is taken
            ctx.offload()
            assert take(g2.model, g2.version) is None
            assert gps.fetch(g2.model, g2.version)
