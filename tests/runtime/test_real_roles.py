"""Real role contexts (generation engine, GRPO gradients, GPS) on a real LocalCluster: shift overhead of the
`small` model (cold), parked contexts shifting back warm, and `submit` end to end with debug models. Each
takes ~40-60 s on a busy 2-core box: `slow`."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pivotrl.runtime.cluster import open_cluster
from pivotrl.runtime.messages import ItemResult, WorkRequest
from pivotrl.runtime.session import RuntimeSession
from tests.runtime.test_mechanism import manual

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_gps(tmp_path_factory):
    """A `small` model (~12.6M parameters) published as version 0 of `policy` and `genrm` in a GPS."""
    from pivotrl.engines.checkpoints import create_model, load_state_dict
    from pivotrl.gps import ParameterStore

    root = tmp_path_factory.mktemp("gps")
    model_dir = create_model("small", root / "small", seed=0)
    # the driver's layout: persistent tier on disk, host tier in /dev/shm when there is one
    host = Path(f"/dev/shm/pivotrl-test-{os.getpid()}") if os.access("/dev/shm", os.W_OK) else root / "host"
    with ParameterStore(root / "store", host_tier=host, device_tier_bytes=0) as gps:
        sd = load_state_dict(model_dir)
        gps.publish("policy", 0, sd)
        gps.publish("genrm", 0, sd)
        gps.flush()
    yield root, model_dir, host
    shutil.rmtree(host, ignore_errors=True)


@pytest.mark.slow
def test_small_model_shift_overhead_under_1_5_s(small_gps):
    from pivotrl.engines.checkpoints import PAD_ID

    root, model_dir, host = small_gps
    common = {"version": 0, "hf_dir": str(model_dir), "kv_budget_tokens": 4096, "max_batch": 8}
    specs = {
        "rollout": {"model": "policy", **common},
        "reward": {"model": "genrm", **common},
        "train": {
            "model": "policy",
            "version": 0,
            "hf_dir": str(model_dir),
            "micro_batch": 4,
            "pad_id": PAD_ID,
        },
    }
    with open_cluster(workers=2, dashboard_address=None) as handle:
        sess = RuntimeSession.install(
            handle.client,
            controller=manual(["rollout", "rollout"]),
            role_specs=specs,
            worker_options={
                "gps": {"root": str(root / "store"), "host_tier": str(host), "device_tier_bytes": 0},
                "park_contexts": False,  # the cold overhead: every shift builds its context
            },
        )
        st = sess.wait_ready(2, timeout_s=120)
        dev = next(a for a, w in st["workers"].items() if w["name"] == "0")
        items = [
            WorkRequest(
                f"s{i}",
                "rollout",
                {
                    "prompt_ids": [1, 20, 21, 22],
                    "version": 0,
                    "sampling": {"temperature": 1.0, "max_new_tokens": 64, "seed": i},
                },
            )
            for i in range(8)
        ]
        sess.submit(items)
        time.sleep(0.3)  # the shifted device is busy generating: its sequences are aborted and migrate
        for role in ("reward", "train", "rollout"):
            sess.shift(dev, role)
            sess.wait_ready(2, roles={"0": role}, timeout_s=60)
        got: set[str] = set()
        deadline = time.monotonic() + 120
        while len(got) < len(items):
            got.update(r.id for r in sess.collect().results)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        shifts = [e for e in sess.metrics()["events"] if e["kind"] == "shift_done" and e["src"] is not None]
    assert len(shifts) == 3
    totals = [e["total"] for e in shifts]
    for e in shifts:
        assert set(e["timings"]) >= {"abort", "offload", "fetch", "load"}
    print(
        "small-model shift totals (s):",
        [round(t, 3) for t in totals],
        {
            ph: round(statistics.mean(e["timings"][ph] for e in shifts), 3)
            for ph in ("abort", "offload", "fetch", "load")
        },
    )
    assert statistics.mean(totals) <= 1.5


def _gen_items(tag: str, version: int, n: int = 4) -> list[WorkRequest]:
    return [
        WorkRequest(
            f"{tag}-{i}",
            "rollout",
            {
                "prompt_ids": [1, 20, 21, 22, 23],
                "version": version,
                "sampling": {"temperature": 1.0, "max_new_tokens": 12, "seed": 100 + i},
            },
        )
        for i in range(n)
    ]


def _collect(sess: RuntimeSession, n: int, timeout_s: float = 60.0) -> dict[str, ItemResult]:
    got: dict[str, ItemResult] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        got.update({r.id: r for r in sess.collect().results})
        assert time.monotonic() < deadline, sorted(got)
        time.sleep(0.03)
    return got


@pytest.mark.slow
def test_parked_context_shifts_back_warm_and_follows_versions(tmp_path):
    """On CPU a device keeps the context of a role it leaves (parked): shifting back skips the build (no
    fetch, no load at the same version; only a weight swap at a newer one), and generates exactly what a
    freshly built context generates."""
    from pivotrl.engines.checkpoints import create_model, init_state_dict, load_config, load_state_dict
    from pivotrl.gps import ParameterStore

    model_dir = create_model("debug", tmp_path / "m", seed=0)
    store = tmp_path / "store"
    with ParameterStore(store, device_tier_bytes=0) as gps:
        gps.publish("policy", 0, load_state_dict(model_dir))
        gps.publish("policy", 1, init_state_dict(load_config(model_dir), 7))
        gps.flush()
    common = {"model": "policy", "version": 0, "hf_dir": str(model_dir), "kv_budget_tokens": 2048}
    specs = {"rollout": {**common, "max_batch": 8}, "reward": {**common, "max_batch": 8}, "train": common}
    with open_cluster(workers=2, dashboard_address=None) as handle:
        sess = RuntimeSession.install(
            handle.client,
            controller=manual(["rollout", "reward"]),
            role_specs=specs,
            worker_options={"gps": {"root": str(store), "device_tier_bytes": 0}},
        )
        st = sess.wait_ready(2, timeout_s=120)
        names = {w["name"]: (a, w["role"]) for a, w in st["workers"].items()}
        dev, cold = (
            next(a for a, r in names.values() if r == "rollout"),
            next(a for a, r in names.values() if r == "reward"),
        )
        sess.submit(_gen_items("before", 0))
        before = _collect(sess, 4)
        for role in ("train", "rollout"):  # away and back: the rollout engine was parked
            sess.shift(dev, role)
            sess.wait_ready(2, roles={st["workers"][dev]["name"]: role}, timeout_s=60)
        sess.submit(_gen_items("after", 0))
        after = _collect(sess, 4)
        for i in range(4):
            assert after[f"after-{i}"].generated == before[f"before-{i}"].generated
        # a newer version: the parked engine swaps weights; its tokens match a freshly built engine's
        sess.client.sync(sess.client.scheduler.pivotrl_set_version, role="rollout", version=1)
        sess.shift(dev, "reward")
        sess.wait_ready(2, roles={st["workers"][dev]["name"]: "reward"}, timeout_s=60)
        sess.shift(cold, "rollout")  # never held rollout: built cold at version 1
        sess.wait_ready(2, roles={st["workers"][cold]["name"]: "rollout"}, timeout_s=60)
        sess.submit(_gen_items("cold", 1))
        fresh = _collect(sess, 4)
        assert {r.worker for r in fresh.values()} == {cold}
        sess.shift(cold, "train")
        sess.wait_ready(2, roles={st["workers"][cold]["name"]: "train"}, timeout_s=60)
        sess.shift(dev, "rollout")
        sess.wait_ready(2, roles={st["workers"][dev]["name"]: "rollout"}, timeout_s=60)
        sess.submit(_gen_items("warm", 1))
        warm = _collect(sess, 4)
        assert {r.worker for r in warm.values()} == {dev}
        for i in range(4):  # the same tokens as a context built cold at version 1: the warm one is at 1
            assert warm[f"warm-{i}"].generated == fresh[f"cold-{i}"].generated
        assert fresh["cold-0"].generated != before["before-0"].generated
        shifts = [e for e in sess.metrics()["events"] if e["kind"] == "shift_done" and e["src"] is not None]
    by = [(e["worker"], e["src"], e["role"], e["timings"], e["warm"]) for e in shifts]
    back_same = by[1]  # dev: train -> rollout at version 0
    assert back_same[:3] == (dev, "train", "rollout") and back_same[4] is True
    assert back_same[3]["fetch"] == 0.0 and back_same[3]["load"] == 0.0
    back_new = by[-1]  # dev: reward -> rollout at version 1
    assert back_new[:3] == (dev, "reward", "rollout") and back_new[4] is True
    assert back_new[3]["fetch"] > 0.0
    first_train = by[0]
    assert first_train[4] is False  # nothing parked for train yet: built


@pytest.mark.slow
def test_submit_end_to_end_with_debug_models(tmp_path):
    """`pivotrl-pipeline submit` on 2 local workers: iterations run, shifts are printed with their phases,
    metrics land in Zarr under storage/runs/<id>/, the final policy is saved in HF format."""
    from pivotrl.engines.checkpoints import create_model

    create_model("debug", tmp_path / "policy", seed=1)
    create_model("debug", tmp_path / "judge", seed=2)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
run: {{name: e2e, iterations: 2, storage_root: {tmp_path / "storage"}}}
models:
  policy: {{name: policy, path: {tmp_path / "policy"}}}
  genrm: {{name: genrm, path: {tmp_path / "judge"}}}
task: {{name: sort, prompts_per_iteration: 4, group_size: 4, eval_prompts: 4}}
rollout: {{sampling: {{max_new_tokens: 24}}, engine: {{max_batch: 16, kv_budget_tokens: 4096}}}}
reward: {{sampling: {{max_new_tokens: 16}}, engine: {{max_batch: 16, kv_budget_tokens: 4096}}}}
train: {{micro_batch: 8, kl_coef: 0.05}}
cluster: {{dashboard_address: null}}
scheduler: {{mode: colocated, tick_s: 0.1}}
""")
    p = subprocess.run(
        [sys.executable, "-m", "pivotrl.cli", "submit", str(cfg), "--workers", "2", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert "shift: device" in out and "fetch" in out  # colocated switches every device between stages
    assert "iteration 1:" in out and "tok/s" in out
    runs = list((tmp_path / "storage" / "runs").iterdir())
    assert len(runs) == 1
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert len(summary["iterations"]) == 2 and summary["iterations"][-1]["version"] == 2
    assert (runs[0] / "metrics.zarr").is_dir()
    assert (runs[0] / "policy-final" / "model.safetensors").is_file()
    import xarray as xr

    ds = xr.open_zarr(runs[0] / "metrics.zarr", consolidated=False)
    assert "shift_time_fetch" in ds and "device_role" in ds and ds.sizes["iteration"] == 2
