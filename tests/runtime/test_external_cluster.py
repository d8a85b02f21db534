"""`--scheduler ADDR`: pivotrl runs on a cluster started with the `dask scheduler` / `dask worker` CLIs."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pivotrl.runtime.cluster import open_cluster
from pivotrl.runtime.control import ManualControl
from pivotrl.runtime.messages import WorkRequest
from pivotrl.runtime.session import RuntimeSession
from tests.runtime.fakes import token
from tests.runtime.test_mechanism import specs, wait_results

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cli_cluster(tmp_path):
    dask = shutil.which("dask", path=os.path.dirname(sys.executable)) or shutil.which("dask")
    if dask is None:
        pytest.skip("the dask CLI is not installed")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    port = free_port()
    addr = f"tcp://127.0.0.1:{port}"
    procs = [
        subprocess.Popen(
            [dask, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        for name in ("0", "1"):
            procs.append(
                subprocess.Popen(
                    [
                        dask,
                        "worker",
                        addr,
                        "--nthreads",
                        "1",
                        "--nworkers",
                        "1",
                        "--name",
                        name,
                        "--resources",
                        "device=1",
                        "--no-dashboard",
                        "--host",
                        "127.0.0.1",
                    ],
                    env=env,
                    cwd=tmp_path,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        yield addr
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_runs_on_a_cluster_started_with_the_dask_cli(cli_cluster):
    with open_cluster(scheduler=cli_cluster, workers=2, timeout_s=60) as handle:
        assert handle.cluster is None  # not ours: never closed by us
        sess = RuntimeSession.install(
            handle.client,
            control=ManualControl(["rollout", "reward"]),
            role_specs=specs(),
            worker_options={"pin_cores": False},
        )
        st = sess.wait_ready(2, timeout_s=60)
        judge = next(a for a, w in st["workers"].items() if w["role"] == "reward")  # join order varies
        sess.submit([WorkRequest(f"x{i}", "rollout", {"target_len": 6}) for i in range(8)])
        got = wait_results(sess, {f"x{i}" for i in range(8)}, timeout_s=60)
        assert all(r.generated == [token(i, j) for j in range(6)] for i, r in got.items())
        sess.shift(judge, "rollout")  # a real role shift on the external cluster
        sess.wait_ready(2, roles={"0": "rollout", "1": "rollout"}, timeout_s=30)


def test_unreachable_scheduler_is_a_user_error():
    from pivotrl.errors import UserError

    with (
        pytest.raises(UserError, match="cannot connect"),
        open_cluster(scheduler=f"tcp://127.0.0.1:{free_port()}", timeout_s=2),
    ):
        pass
    with pytest.raises(UserError, match="expected an address"), open_cluster(scheduler="localhost:1"):
        pass


def test_submit_bad_input_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {lr: -1}\n")
    for args in ([str(bad)], [str(tmp_path / "missing.yaml")], [str(bad), "--set", "nonsense"]):
        t0 = time.monotonic()
        p = subprocess.run(
            [sys.executable, "-m", "pivotrl.cli", "submit", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 2, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert time.monotonic() - t0 < 30
