"""A pipeline run on two "nodes" of one machine (`gps.node_local`): worker processes tagged a and b, each
node with its own persistent and host-tier directories, the driver on node a. Devices shift roles (colocated:
every device does rollout, then reward, then train), so node b's workers fetch the policy and the judge from
node a's workers over Dask's comms, and the driver pulls node b's gradient sums. It trains correctly: the
same tokens, rewards and updated weights as the single-process recipe (tests/test_recipe_equivalence.py)."""

from __future__ import annotations

import os

import pytest

from pivotrl.engines.checkpoints import load_state_dict
from pivotrl.runtime.local_nodes import nodes_cluster
from tests.test_recipe_equivalence import RECIPE_SETS, _capture, max_diff, stages
from tests.tiny import tiny_bootstrap


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-nodes")
    sets = [
        *RECIPE_SETS,
        "gps.node_local=true",
        f"gps.root={root}/nodes/{{node}}/nvme/gps",
        f"gps.host_tier={root}/nodes/{{node}}/shm/gps",
    ]
    cfg, boot = tiny_bootstrap(root, sets)
    cfg.models.policy.path, cfg.models.genrm.path = str(boot.policy_dir), str(boot.judge_dir)
    return cfg, boot, root


@pytest.mark.timeout(900)  # ~40 s on an idle 2-core box (a local run, then 3 worker processes)
def test_quickstart_recipe_on_two_nodes_shifts_across_nodes_and_trains_correctly(setup, tmp_path,
                                                                                 monkeypatch):
    from distributed import Client

    from pivotrl.loop import run_loop
    from pivotrl.run import run_pipeline

    cfg, boot, root = setup
    local: dict = {}
    run_loop(cfg.model_copy(deep=True), boot.policy_dir, boot.judge_dir, stages=stages(),
             on_iteration=_capture(local), save_dir=tmp_path / "local")
    monkeypatch.setenv("PIVOTRL_NODE", "a")  # the driver's node
    dist: dict = {}
    with nodes_cluster({"a": 1, "b": 2}) as cl, Client(cl) as client:
        client.wait_for_workers(3, timeout=120)
        res = run_pipeline(cfg, mode="colocated", workers=3, scheduler=cl.scheduler_address, stages=stages(),
                           log=lambda *_: None, progress=False, evaluate_policy=False,
                           on_iteration=_capture(dist))
        gps = client.sync(client.scheduler.pivotrl_gps_state)
        registered = [m for _, m in client.get_events("pivotrl-gps") if m.get("action") == "gps-register"]
        names = {a: ws["name"] for a, ws in client.scheduler_info(n_workers=-1)["workers"].items()}

    # node-local tiers: each node's directories, nothing shared
    nodes = gps["nodes"]
    assert sorted(set(nodes.values())) == ["a", "b"]
    assert {n: sorted(os.listdir(root / "nodes" / n)) for n in ("a", "b")} == {
        "a": ["nvme", "shm"], "b": ["nvme", "shm"]}
    # roles shifted on node b's devices, which pulled the weights they needed from node a
    b_workers = {a for a, n in nodes.items() if n == "b"}
    b_names = {names[a] for a in b_workers}
    assert {s["name"] for s in res.shifts} & b_names, res.shifts
    pulls = [p for p in gps["pulls"] if p["ok"]]
    by_node_b = {(p["model"], p["version"]) for p in pulls if p["node"] == "b"}
    assert ("policy", 0) in by_node_b and ("genrm", 0) in by_node_b, pulls
    assert all(p["fetch_tier"] == "peer_remote" for p in pulls if p["node"] == "b")
    assert len({(p["model"], p["version"]) for p in pulls if p["node"] == "b"}) == len(
        [p for p in pulls if p["node"] == "b"])  # each version crossed to node b once
    # the driver (node a) pulled every gradient sum that a node-b device left in node b's tiers; which
    # devices train depends on who takes the items first, so node b may have left none
    b_grads = {(r["model"], r["version"]) for r in registered
               if r["node"] == "b" and r["model"].startswith("grad")}
    driver_pulls = {(p["model"], p["version"]) for p in pulls
                    if p["node"] == "a" and p["fetch_tier"] == "peer_remote"}
    assert b_grads <= driver_pulls, (b_grads, driver_pulls)
    print("node-b gradient sums pulled by the driver:", sorted(b_grads))

    # trains correctly: the single-process recipe's tokens, rewards and weights
    assert local.pop("_version") == dist.pop("_version") == 2
    local.pop("_grads"), dist.pop("_grads")
    assert local.keys() == dist.keys()
    for uid in local:
        assert local[uid][0] == dist[uid][0], f"{uid}: rollout tokens differ"
        assert local[uid][3] == dist[uid][3], f"{uid}: rewards differ"
    local_sd, dist_sd = load_state_dict(tmp_path / "local" / "policy"), load_state_dict(res.final_policy)
    assert max_diff(local_sd, load_state_dict(boot.policy_dir)) > 0.5 * cfg.train.lr  # it moved ...
    assert max_diff(local_sd, dist_sd) <= 1e-2 * cfg.train.lr  # ... the same way on two nodes (the bound:
    # tests/test_recipe_equivalence.py, where Adam's few near-zero second moments are measured)
    off = sum(int(((local_sd[k] - dist_sd[k]).abs() > 1e-7).sum()) for k in local_sd)
    assert off <= 1e-2 * sum(t.numel() for t in local_sd.values())  # bit-close almost everywhere
