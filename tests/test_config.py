import subprocess
import sys

import pytest

from pivotrl.config import PipelineConfig, load_config
from pivotrl.errors import UserError


def test_defaults_validate():
    cfg = load_config(None)
    assert isinstance(cfg, PipelineConfig) and cfg.scheduler.mode == "shiftable"


def test_overrides_are_typed(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("run:\n  iterations: 3\n")
    cfg = load_config(f, overrides=["train.lr=3e-4", "scheduler.mode=colocated"])
    assert cfg.run.iterations == 3 and cfg.train.lr == pytest.approx(3e-4)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("train:\n  lr: -1\n", "train.lr"),
        ("train:\n  lrr: 1\n", "train.lrr: unknown field"),
        ("scheduler:\n  mode: magic\n", "scheduler.mode"),
        ("run:\n  iterations: many\n", "run.iterations"),
        ("scheduler:\n  static_split: {rollout: 1, judge: 1}\n", "static_split has unknown role"),
    ],
)
def test_bad_values_name_file_and_field(tmp_path, text, field):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(UserError) as exc:
        load_config(f)
    assert str(f) in str(exc.value) and field in str(exc.value)
    assert "\n" not in str(exc.value)


def test_bad_yaml_and_missing_file(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("a: [1, 2\n")
    with pytest.raises(UserError, match="invalid YAML"):
        load_config(f)
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_cli_reports_unknown_command_with_exit_2():
    proc = subprocess.run([sys.executable, "-m", "pivotrl.cli", "frobnicate"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown command" in proc.stderr and "Traceback" not in proc.stderr
