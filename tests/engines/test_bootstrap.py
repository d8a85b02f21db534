"""Bootstrap: synthetic judgments from the verifier, determinism, caching, the CLI."""

from __future__ import annotations

import os
import random

import pytest
import torch

from pivotrl.cli import main
from pivotrl.config import PipelineConfig, load_config
from pivotrl.engines import bootstrap as bs
from pivotrl.engines.checkpoints import load_state_dict
from pivotrl.engines.genrm import JudgeTemplate, parse_verdict
from pivotrl.tasks import get_task
from tests.tiny import TINY


def tiny_cfg(root, **over) -> PipelineConfig:
    sets = [
        f"run.storage_root={root}",
        "train.sft.steps=3",
        "reward.sft.steps=3",
        "train.sft.examples=50",
        "reward.sft.examples=50",
        "train.sft.batch_size=4",
        "reward.sft.batch_size=4",
    ]
    sets += [f"{k}={v}" for k, v in over.items()]
    cfg = load_config(None, PipelineConfig, sets)
    cfg.train.sft.shape = dict(TINY)
    cfg.reward.sft.shape = dict(TINY)
    return cfg


def test_corruptions_are_always_wrong():
    task = get_task("sort", {"max_size": 10})
    rng = random.Random(0)
    for p in task.sample(300, seed=3):
        bad = bs.corrupt_answer(p.answer, rng)
        assert not task.verify(p, bad), (p.prompt, bad)


def test_sloppy_teacher_drops_repeats_only():
    assert bs.sloppy_answer("1 3 3 9 9") == "1 3 9"
    assert bs.sloppy_answer("0 1 2") == "0 1 2"
    task = get_task("sort", {"max_size": 10})
    problems = task.sample(200, seed=1)
    pairs = bs.policy_pairs(problems, sloppy=1.0)
    assert all(pair.target == bs.sloppy_answer(p.answer) for pair, p in zip(pairs, problems, strict=True))
    assert [pair.target for pair in bs.policy_pairs(problems)] == [p.answer for p in problems]


def test_judge_pairs_are_labelled_by_the_verifier():
    task = get_task("sort", {"max_size": 10})
    problems = task.sample(400, seed=2)
    template = JudgeTemplate()
    pairs, labels = bs.judge_pairs(task, problems, template, seed=0)
    assert 0.4 < sum(labels) / len(labels) < 0.6
    for pair, label, p in zip(pairs, labels, problems, strict=True):
        assert pair.prompt.startswith(p.prompt) and pair.prompt.endswith("\n")
        response = " ".join(w[1:] for w in pair.prompt[len(p.prompt) : -1].split())  # drop the item tags
        assert task.verify(p, response) == label
        assert parse_verdict(pair.target) == float(label)
        assert ("x" not in pair.target.split(" verdict")[0]) == label  # the critique agrees with the verdict
        assert [w[1:-1] for w in pair.target.split(" verdict")[0].split()] == [*p.answer.split(), "-"]


def test_bootstrap_is_deterministic_and_cached(tmp_path):
    cfg = tiny_cfg(tmp_path / "a")
    first = bs.ensure_bootstrap(cfg, parallel=False, log=lambda *_: None)
    assert first.built == ["policy", "genrm"]
    assert (first.policy_dir / "config.json").is_file() and (first.judge_dir / "model.safetensors").is_file()
    again = bs.ensure_bootstrap(cfg, parallel=False, log=lambda *_: None)
    assert again.built == [] and again.policy_dir == first.policy_dir
    other = bs.ensure_bootstrap(tiny_cfg(tmp_path / "b"), parallel=False, log=lambda *_: None)
    for a, b in [(first.policy_dir, other.policy_dir), (first.judge_dir, other.judge_dir)]:
        sa, sb = load_state_dict(a), load_state_dict(b)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    changed = tiny_cfg(tmp_path / "a", **{"reward.sft.steps": 4})
    assert bs.model_dir(changed, "genrm") != first.judge_dir  # a changed setting never reuses a stale model
    assert bs.model_dir(changed, "policy") == first.policy_dir


def test_sft_learns(tmp_path):
    """A few dozen steps on a fixed tiny set bring the loss well down (the SFT code actually trains)."""
    from pivotrl.engines.checkpoints import build_tokenizer

    tok = build_tokenizer()
    task = get_task("sort", {"max_size": 3})
    data = bs.encode_pairs(tok, bs.policy_pairs(task.sample(8, seed=0)))
    cfg = tiny_cfg(tmp_path)
    model = bs.new_model(bs.build_config(cfg.train.sft), seed=0)
    losses = bs.sft(model, data, steps=60, batch_size=8, lr=1e-2, seed=0, pad_id=tok.pad_token_id, warmup=5)
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("role, section", [("policy", "train"), ("genrm", "reward")])
def test_a_diverging_bootstrap_names_its_learning_rate_and_saves_nothing(tmp_path, role, section):
    """An SFT whose loss turns non-finite stops at that step: one `UserError` naming the learning rate,
    and no model directory (a NaN model must never become a version 0)."""
    from pivotrl.errors import UserError

    cfg = tiny_cfg(tmp_path, **{f"{section}.sft.lr": "1e6", f"{section}.sft.steps": 40})
    out = tmp_path / "out"
    with pytest.raises(UserError, match=rf"^{section}\.sft\.lr: the {role} bootstrap diverged \(loss nan"):
        bs.train_role(cfg, role, out)
    assert not out.exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_sft_length_chunks_give_the_dense_batch_step(tmp_path):
    """Running a batch as length-sorted chunks (less padding) takes the same optimizer step as one dense,
    padded batch: the loss is the same token mean, only the padding is skipped."""
    from pivotrl.engines.checkpoints import build_tokenizer

    tok = build_tokenizer()
    task = get_task("sort", {"max_size": 10})
    data = bs.encode_pairs(tok, bs.judge_pairs(task, task.sample(16, seed=1), JudgeTemplate(), seed=1)[0])
    cfg = tiny_cfg(tmp_path)
    params = []
    for chunks in (1, 4):
        model = bs.new_model(bs.build_config(cfg.reward.sft), seed=0).double()
        bs.sft(model, data, steps=2, batch_size=8, lr=1e-2, seed=0, pad_id=tok.pad_token_id, chunks=chunks)
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(params[0], params[1], atol=1e-9)


def test_sft_data_options_shape_the_data_and_the_cache_key(tmp_path):
    """``data_options`` draws this model's SFT problems from other task options (longer lists for the
    judge) and, since it shapes the weights, gives the model its own cache directory."""
    base = tiny_cfg(tmp_path)
    longer = tiny_cfg(tmp_path, **{"reward.sft.data_options": "{median: 8}"})
    assert bs.model_dir(base, "genrm") != bs.model_dir(longer, "genrm")
    assert bs.model_dir(base, "policy") == bs.model_dir(longer, "policy")


def test_cli_bad_config_is_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  sft:\n    steps: -3\n")
    assert main(["bootstrap", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "train.sft.steps" in err and len(err.strip().splitlines()) == 1


def test_cli_builds_and_reports(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    shape = (
        "{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, "
        "num_key_value_heads: 1}"
    )
    cfg.write_text(
        f"run: {{storage_root: {tmp_path / 's'}}}\n"
        f"train: {{sft: {{steps: 2, examples: 20, batch_size: 2, shape: {shape}}}}}\n"
        f"reward: {{sft: {{steps: 2, examples: 20, batch_size: 2, shape: {shape}}}}}\n"
    )
    assert main(["bootstrap", str(cfg), "--serial"]) == 0
    out = capsys.readouterr().out
    assert "policy (version 0)" in out and "genrm  (version 0)" in out
    assert main(["bootstrap", str(cfg)]) == 0
    assert "(cached)" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["task.name=sum"])
def test_sloppy_needs_sort(tmp_path, bad):
    from pivotrl.errors import UserError

    cfg = tiny_cfg(tmp_path, **{"train.sft.sloppy": 0.5, bad.split("=")[0]: bad.split("=")[1]})
    with pytest.raises(UserError, match="sloppy"):
        bs.train_role(cfg, "policy", tmp_path / "p")


def test_judge_can_start_from_the_policy(tmp_path):
    cfg = tiny_cfg(tmp_path, **{"reward.sft.init": "policy", "reward.sft.steps": 0})
    res = bs.ensure_bootstrap(cfg, parallel=True, log=lambda *_: None)
    sp, sj = load_state_dict(res.policy_dir), load_state_dict(res.judge_dir)
    assert all(torch.equal(sp[k], sj[k]) for k in sp)  # zero judge steps: exactly the policy's weights
    policy_changed = tiny_cfg(
        tmp_path, **{"reward.sft.init": "policy", "reward.sft.steps": 0, "train.sft.steps": 4}
    )
    assert bs.model_dir(policy_changed, "genrm") != res.judge_dir  # the judge's key covers the policy's


def test_parallel_bootstrap_builds_the_native_kernels_beside_the_training(tmp_path, monkeypatch):
    """The kernels are compiled into the cache the engines load from, by a bootstrap process, and the
    path they run on is reported; without ``build_kernels`` nothing is said about them."""
    from pivotrl.engines import kernels

    none = "bootstrap: no native kernels built beside the training (the engines use torch ops)"
    have = kernels.native() is not None  # False where no compiler can build them: the torch ops then
    lines: list[str] = []
    bs.ensure_bootstrap(tiny_cfg(tmp_path / "a"), parallel=True, log=lines.append, build_kernels=True)
    said = [line for line in lines if "native kernels" in line]
    assert said == [f"bootstrap: native kernels ready ({kernels.isa()}), built beside the training" if have
                    else none]

    lines.clear()
    bs.ensure_bootstrap(tiny_cfg(tmp_path / "b"), parallel=True, log=lines.append)
    assert not [line for line in lines if "kernels" in line]

    monkeypatch.setenv("PIVOTRL_NATIVE_KERNELS", "0")  # the spawned processes inherit it
    lines.clear()
    bs.ensure_bootstrap(tiny_cfg(tmp_path / "c"), parallel=True, log=lines.append, build_kernels=True)
    assert none in lines
    if not have:
        return
    monkeypatch.setenv("PIVOTRL_NATIVE_KERNELS", "1")
    monkeypatch.setenv("PIVOTRL_KERNEL_ISA", "no-such-isa")  # reported; the trained models are kept
    lines.clear()
    res = bs.ensure_bootstrap(tiny_cfg(tmp_path / "d"), parallel=True, log=lines.append, build_kernels=True)
    assert (res.policy_dir / "bootstrap.json").is_file() and (res.judge_dir / "bootstrap.json").is_file()
    said = [line for line in lines if line.startswith("bootstrap: no native kernels")]
    assert len(said) == 1 and "no-such-isa" in said[0]


@pytest.mark.slow
def test_the_bootstrap_kernel_build_fills_an_empty_cache(tmp_path, monkeypatch):
    """From an empty extension cache, the engines find the build the bootstrap made (slow: one compile)."""
    import subprocess
    import sys

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    lines: list[str] = []
    bs.ensure_bootstrap(tiny_cfg(tmp_path / "a"), parallel=True, log=lines.append, build_kernels=True)
    assert any("native kernels ready (avx" in line or "(scalar)" in line for line in lines), lines
    built = list((tmp_path / "ext").glob("*/*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime
    load = "from pivotrl.engines import kernels; print(kernels.native() is not None)"
    p = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=600)
    assert p.stdout.strip() == "True", p.stderr[-2000:]
    assert built[0].stat().st_mtime == mtime  # loaded, not rebuilt


def test_a_run_builds_kernels_only_for_engines_that_use_them(monkeypatch):
    from pivotrl.run import _uses_native_kernels

    cfg = load_config(None, PipelineConfig, [])
    assert _uses_native_kernels(cfg)
    monkeypatch.setenv("PIVOTRL_NATIVE_KERNELS", "0")
    assert not _uses_native_kernels(cfg)
    monkeypatch.delenv("PIVOTRL_NATIVE_KERNELS")
    both = ["rollout.engine.backend=vllm", "reward.engine.backend=vllm"]
    both_vllm = load_config(None, PipelineConfig, both)
    assert not _uses_native_kernels(both_vllm)
    one_vllm = load_config(None, PipelineConfig, ["rollout.engine.backend=vllm"])
    assert _uses_native_kernels(one_vllm)


class _Flag:
    """A stand-in for the pool's `Event`, set from a given step on."""

    def __init__(self, at: int) -> None:
        self.at, self.step = at, 0

    def is_set(self) -> bool:
        return self.step >= self.at


def test_the_last_sft_left_takes_the_spare_core_with_the_same_weights(tmp_path):
    """Once the other jobs are done (`spare_core` set) the SFT moves to two threads, once, and forwards every
    report; its weights are the same bit for bit as on one thread throughout."""
    from pivotrl.engines.checkpoints import build_tokenizer

    tok = build_tokenizer()
    task = get_task("sort", {"max_size": 10})
    data = bs.encode_pairs(tok, bs.judge_pairs(task, task.sample(64, seed=1), JudgeTemplate(), seed=1)[0])
    shape = load_config("configs/quickstart.yaml", PipelineConfig).reward.sft  # the judge's own shape
    before = torch.get_num_threads()
    try:
        weights, threads, reports = [], [], []
        for at in (10**9, 5):
            torch.set_num_threads(1)
            flag = _Flag(at)
            inner = bs.take_spare_core(flag, lambda d, t, loss: reports.append(d))

            def progress(done, total, loss, flag=flag, inner=inner):
                flag.step = done
                inner(done, total, loss)
                threads.append(torch.get_num_threads())

            model = bs.new_model(bs.build_config(shape), seed=0)
            bs.sft(model, data, steps=12, batch_size=32, lr=3e-3, seed=0, pad_id=tok.pad_token_id,
                   progress=progress)
            weights.append(model.state_dict())
        want = min(2, len(os.sched_getaffinity(0)))  # the cores this test process may use
        assert threads[:12] == [1] * 12 and threads[12:] == [1] * 4 + [want] * 8
        assert reports == list(range(1, 13)) * 2
        assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
        assert bs.take_spare_core(None, print) is print
    finally:
        torch.set_num_threads(before)


def test_the_spare_core_is_left_where_two_threads_change_the_bits(monkeypatch):
    """Where a product with a long reduction gives other bits on two threads (MKL without
    `MKL_REPRODUCIBLE` on an Intel Xeon), the SFT stays on its one thread and still reports every step;
    the probe restores the thread count it found."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert isinstance(bs.threads_keep_bits(2), bool) and torch.get_num_threads() == 1
        monkeypatch.setattr(bs, "threads_keep_bits", lambda threads: False)
        reports = []
        progress = bs.take_spare_core(_Flag(0), lambda d, t, loss: reports.append(d))
        for step in range(1, 4):
            progress(step, 3, 0.0)
            assert torch.get_num_threads() == 1
        assert reports == [1, 2, 3]
    finally:
        torch.set_num_threads(before)
