"""Run checkpoints and leases: atomic commits that a kill cannot tear, a config check that names the field a
resumed run may not change, and leases that tell a live run's directories from a dead one's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl import checkpoint, lease
from pivotrl.config import PipelineConfig
from pivotrl.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def _ckpt(n: int, cfg: dict | None = None) -> checkpoint.RunCheckpoint:
    cfg = cfg or PipelineConfig().model_dump(mode="json")
    return checkpoint.RunCheckpoint("r", n, n, cfg, rows=[{"iteration": i} for i in range(n)])


def test_commit_then_load_round_trips_and_keeps_the_two_newest(tmp_path):
    for n in range(1, 5):
        checkpoint.save(tmp_path, _ckpt(n), {"w": torch.full((3,), float(n))})
    path = checkpoint.latest(tmp_path)
    ckpt, state = checkpoint.load(path)
    assert ckpt.iterations_done == 4 and [r["iteration"] for r in ckpt.rows] == [0, 1, 2, 3]
    assert torch.equal(state["w"], torch.full((3,), 4.0))
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == ["000003", "000004"]


def test_a_writer_killed_mid_checkpoint_leaves_the_previous_one(tmp_path):
    checkpoint.save(tmp_path, _ckpt(1), {"w": torch.zeros(2)})
    code = (
        "import torch, os; from pivotrl import checkpoint; from pivotrl.config import PipelineConfig\n"
        "c = checkpoint.RunCheckpoint('r', 2, 2, PipelineConfig().model_dump(mode='json'))\n"
        f"checkpoint.save({str(tmp_path)!r}, c, {{'w': torch.ones(2)}})\n"
    )
    env = {**os.environ, "PIVOTRL_KILL_AT": "checkpoint:1"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True)
    assert p.returncode == -9  # SIGKILLed at the fault point, halfway through the write
    ckpt, state = checkpoint.load(checkpoint.latest(tmp_path))
    assert ckpt.iterations_done == 1 and torch.equal(state["w"], torch.zeros(2))
    checkpoint.save(tmp_path, _ckpt(2), {"w": torch.ones(2)})  # the next commit sweeps the torn one
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


def test_a_changed_training_field_is_named_and_run_length_may_change():
    base = PipelineConfig().model_dump(mode="json")
    longer = PipelineConfig.model_validate({"run": {"iterations": 50}, "cluster": {"workers": 7}})
    assert checkpoint.changed_field(base, longer.model_dump(mode="json")) is None
    lr = PipelineConfig.model_validate({"train": {"lr": 0.5}}).model_dump(mode="json")
    with pytest.raises(UserError, match=r"train\.lr changed"):
        checkpoint.check_resumable(base, lr)
    group = PipelineConfig.model_validate({"task": {"group_size": 2}}).model_dump(mode="json")
    assert checkpoint.changed_field(base, group)[0] == "task.group_size"


@settings(max_examples=200, derandomize=True, deadline=None)
@given(
    path=st.lists(st.text("abcdefgh", min_size=1, max_size=3), min_size=1, max_size=3),
    old=st.one_of(st.integers(), st.text(max_size=3), st.none()),
    new=st.one_of(st.integers(), st.text(max_size=3), st.none()),
)
def test_changed_field_finds_any_nested_difference(path, old, new):
    def nest(value):
        d: dict = {"keep": 1}
        cur = d
        for k in path[:-1]:
            cur = cur.setdefault(k, {})
        cur[path[-1]] = value
        return d

    got = checkpoint.changed_field(nest(old), nest(new))
    if old == new:
        assert got is None
    else:
        assert got is not None and got[0].split(".")[0] == path[0]


def test_find_run_refuses_names_that_are_not_run_ids(tmp_path):
    (tmp_path / "runs" / "a").mkdir(parents=True)
    for bad in ("../a", "a/../../x", "..", "", "x\x00"):
        with pytest.raises(UserError):
            checkpoint.find_run(tmp_path, bad)
    with pytest.raises(UserError, match="no run with a checkpoint"):
        checkpoint.find_run(tmp_path, "latest")
    checkpoint.save(tmp_path / "runs" / "a", _ckpt(1), {})
    assert checkpoint.find_run(tmp_path, "latest").name == "a"


def test_a_live_lease_is_refused_and_a_dead_ones_directory_reclaimed(tmp_path):
    live, dead = tmp_path / "tier-live", tmp_path / "tier-dead"
    dead.mkdir()
    (dead / "weights").write_bytes(b"x" * 10)
    code = (
        "import sys, time; from pathlib import Path; from pivotrl import lease\n"
        f"with lease.held(Path({str(live)!r}), 'tier'):\n"
        "    print('held', flush=True); time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match="in use by a live process"), lease.held(live, "tier"):
            pass
        assert lease.reclaim_dead(tmp_path, "tier-") == [dead]
        assert live.is_dir() and not dead.exists()
    finally:
        holder.kill()
        holder.wait()
    assert lease.reclaim_dead(tmp_path, "tier-") == [live]  # its holder died: now it is reclaimed


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=10)
rows_strategy = st.lists(st.dictionaries(st.text(max_size=6), json_values, max_size=5), max_size=6)


@settings(max_examples=150, deadline=None)
@given(rows_strategy, st.integers(0, 6))
def test_rows_encoded_once_write_the_same_checkpoint(rows, resumed) -> None:
    """A run keeps its rows' JSON (`EncodedRows`, some from a resumed checkpoint, the rest appended one
    by one); the checkpoint it writes reads back as the one with plain rows."""
    import json

    encoded = checkpoint.EncodedRows(rows[:resumed])
    for row in rows[resumed:]:
        encoded.append(row)
    assert list(encoded) == rows and len(encoded) == len(rows)
    cfg = {"run": {"seed": 1}}
    fast = checkpoint.RunCheckpoint("r", len(rows), 3, cfg, encoded, [{"iteration": 1, "accuracy": 0.5}],
                                    {"accuracy_before": 1.0}, learned={"format": 1})
    slow = checkpoint.RunCheckpoint("r", len(rows), 3, cfg, rows, fast.curve, fast.eval, learned=fast.learned)
    assert json.loads(checkpoint.state_json(fast)) == json.loads(checkpoint.state_json(slow))
    assert checkpoint.RunCheckpoint(**json.loads(checkpoint.state_json(fast))) == slow


def test_a_checkpoint_with_encoded_rows_loads_as_plain_rows(tmp_path) -> None:
    rows = checkpoint.EncodedRows([{"iteration": 0, "seconds": 1.5}])
    rows.append({"iteration": 1, "seconds": 2.5, "device_time": {"0": {"train": 0.5}}})
    ckpt = checkpoint.RunCheckpoint("r", 2, 2, PipelineConfig().model_dump(mode="json"), rows)
    checkpoint.save(tmp_path, ckpt, {"w": torch.zeros(1)})
    back, _ = checkpoint.load(checkpoint.latest(tmp_path))
    assert back.rows == list(rows) and type(back.rows) is list
