"""Config loading and the CLI's bad-input contract: one line naming file and field, exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivotrl.cli import main
from pivotrl.errors import UserError
from pivotrl.sim.config import load_sim_config

ROOT = Path(__file__).resolve().parents[2]
PAPER = ROOT / "configs/sim/paper-32gpu.yaml"


def test_paper_config_loads_with_profile() -> None:
    cfg = load_sim_config(PAPER)
    assert cfg.cluster.devices == 32
    assert cfg.workload.prompts_per_iteration * cfg.workload.group_size == 8192
    assert cfg.cost.reward.devices_per_replica == 2 and cfg.cost.rollout.weights_gb == pytest.approx(15.2)


def test_every_shipped_config_loads() -> None:
    paths = sorted((ROOT / "configs/sim").rglob("*.yaml"))
    configs = [p for p in paths if "profiles" not in p.parts and not p.name.endswith("profile.yaml")]
    assert len(configs) >= 14
    for p in configs:
        load_sim_config(p)


def test_bad_field_names_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(PAPER.read_text().replace("prompts_per_iteration: 512", "prompts_per_iteration: -1")
                   .replace("profile: profiles/", f"profile: {PAPER.parent}/profiles/"))
    with pytest.raises(UserError) as exc:
        load_sim_config(bad)
    msg = str(exc.value)
    assert str(bad) in msg and "workload.prompts_per_iteration" in msg and "\n" not in msg


@pytest.mark.parametrize("cmd", ["simulate", "plan"])
def test_cli_bad_config_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           cmd: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: {devices: 32}\ncost: {gpu: x}\n")
    assert main([cmd, str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(bad) in err and "cost.rollout" in err


def test_cli_missing_file_and_unknown_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["simulate", str(PAPER), "--set", "workload.bogus=1"]) == 2
    err = capsys.readouterr().err
    assert "workload.bogus" in err and "unknown field" in err


def test_devices_per_node_is_not_silently_ignored() -> None:
    load_sim_config(PAPER, ["cluster.devices_per_node=8"])  # the default is accepted
    with pytest.raises(UserError) as exc:
        load_sim_config(PAPER, ["cluster.devices_per_node=4"])
    msg = str(exc.value)
    assert msg == f"{PAPER}: cluster.devices_per_node: not supported yet (the simulator does not model " \
                  "nodes); remove it"


def test_static_split_is_the_static_baseline_and_gpu_is_reported() -> None:
    from pivotrl.sim.compare import best_static

    cfg = load_sim_config(ROOT / "configs/sim/sanity/perfect-static.yaml", ["workload.iterations=1"])
    res, search = best_static(cfg)
    assert res.split == {"rollout": 4, "reward": 4, "train": 4}
    assert search["method"] == "given (static_split)" and search["splits_simulated"] == 1
    with pytest.raises(UserError, match="static_split"):
        load_sim_config(ROOT / "configs/sim/sanity/perfect-static.yaml", ["static_split.train=5"])
    assert cfg.cost.gpu == "ideal"


def test_simulate_never_writes_over_its_own_inputs(tmp_path, capsys):
    import hashlib
    import shutil

    from pivotrl import cli

    src = Path(__file__).resolve().parents[2] / "configs/sim/cpu-2dev.yaml"
    cfg = tmp_path / "w.yaml"
    shutil.copy(src, cfg)
    shutil.copytree(src.parent / "profiles", tmp_path / "profiles")
    before = hashlib.sha256(cfg.read_bytes()).hexdigest()
    for out in (str(cfg), str(tmp_path / "." / "w.yaml")):
        assert cli.main(["simulate", str(cfg), "--json", out]) == 2
        assert "is an input of this command" in capsys.readouterr().err
    assert hashlib.sha256(cfg.read_bytes()).hexdigest() == before


def test_simulate_on_too_few_devices_for_any_static_baseline_is_one_line(capsys):
    from pivotrl import cli

    cfg = Path(__file__).resolve().parents[2] / "configs/sim/cpu-2dev.yaml"
    argv = ["simulate", str(cfg), "--set", "cluster.devices=1", "--set", "workload.iterations=1"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "cluster.devices: 1 device(s) admit no static split" in err and err.count("\n") == 1
