import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivotrl.config import UNREAD_FIELDS, PipelineConfig, SchedulerPriors, load_config
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


# ----------------------------------------------------------------------------------------------------
# No known key silently ignored: fields nothing reads yet are errors unless left at their defaults
# ----------------------------------------------------------------------------------------------------

# one non-default value per unread field, as `--set` writes it (models.* need their required name)
NON_DEFAULT = {
    "models.policy.size": ["models.policy.name=policy", "models.policy.size=debug"],
    "models.genrm.size": ["models.genrm.name=genrm", "models.genrm.size=small"],
    "train.sft.init": ["train.sft.init=policy"],
    "reward.sft.sloppy": ["reward.sft.sloppy=0.5"],
}


def test_every_unread_field_has_a_case():
    assert set(NON_DEFAULT) == set(UNREAD_FIELDS)


@pytest.mark.parametrize("field", sorted(NON_DEFAULT))
def test_unread_field_set_is_a_one_line_error(tmp_path, field):
    f = tmp_path / "c.yaml"
    f.write_text("run:\n  iterations: 2\n")
    with pytest.raises(UserError) as exc:
        load_config(f, overrides=NON_DEFAULT[field])
    msg = str(exc.value)
    assert exc.value.exit_code == 2
    assert msg.startswith(f"{f}: {field}: not ") and msg.endswith("remove it") and "\n" not in msg


@pytest.mark.parametrize(
    "sets",
    [
        ["task.dataset=null", "task.on_bad_row=error"],
        ["models.policy.name=p", "models.policy.size=null", "train.sft.init=scratch", "reward.sft.sloppy=0"],
        ["reward.sft.init=policy", "train.sft.sloppy=0.5"],  # the roles that do read them
    ],
)
def test_unread_fields_at_their_defaults_are_accepted(sets):
    load_config(None, overrides=sets)


def test_cli_reports_an_unread_field_with_exit_2(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  sft:\n    init: policy\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pivotrl.cli", "bootstrap", str(f)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    why = UNREAD_FIELDS["train.sft.init"]
    assert proc.stderr.strip().splitlines() == [f"error: {f}: train.sft.init: {why}; remove it"]


_scalars = st.one_of(
    st.text(alphabet="abcdefghij_./0123456789", min_size=1, max_size=12),
    st.integers(min_value=-5, max_value=10**6),
    st.floats(min_value=-1.0, max_value=1.0, allow_nan=False),
    st.sampled_from(["skip", "error", "policy", "scratch", "debug", "small", "true", "null"]),
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(field=st.sampled_from(sorted(UNREAD_FIELDS)), value=_scalars)
def test_random_non_default_values_of_unread_fields_raise_one_line(field, value):
    sets = [f"{field}={value}"]
    if field.startswith("models."):
        sets.insert(0, f"{field.rsplit('.', 1)[0]}.name=m")
    try:
        cfg = load_config(None, overrides=sets)
    except UserError as exc:
        msg = str(exc)
        assert "\n" not in msg and field in msg
        return
    # accepted: only when the value parsed to the field's default
    *path, name = field.split(".")
    section = cfg
    for part in path:
        section = getattr(section, part)
    assert getattr(section, name) == type(section).model_fields[name].default
    assert isinstance(cfg, PipelineConfig)


def test_scheduler_priors_load_and_validate(tmp_path):
    cfg = load_config(None)
    p = cfg.scheduler.priors
    assert (p.rollout_step_a_s, p.rollout_step_b_s, p.reward_step_a_s, p.reward_step_b_s) == (
        0.01,
        0.0005,
        0.01,
        0.0005,
    )
    assert (p.train_step_a_s, p.train_step_b_s, p.shift_s) == (0.01, 0.0002, 1.0)
    for name, info in SchedulerPriors.model_fields.items():
        assert info.description and "\n" not in info.description, name
    f = tmp_path / "c.yaml"
    f.write_text("scheduler:\n  priors: {train_step_b_s: 0.001, shift_s: 2.5}\n")
    cfg = load_config(f, overrides=["scheduler.priors.rollout_step_b_s=0"])
    assert cfg.scheduler.priors.train_step_b_s == 0.001 and cfg.scheduler.priors.shift_s == 2.5
    assert cfg.scheduler.priors.rollout_step_b_s == 0.0
    for bad in (
        "scheduler.priors.rollout_step_a_s=0",
        "scheduler.priors.shift_s=-1",
        "scheduler.priors.train_step_b_s=-0.1",
        "scheduler.priors.reward_step_a_s=fast",
        "scheduler.priors.step_c_s=1",
    ):
        with pytest.raises(UserError) as exc:
            load_config(f, overrides=[bad])
        assert bad.split("=")[0] in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("run: {iterations: true}", "run.iterations: a number is wanted, not the boolean True"),
        ("train: {lr: .nan}", "train.lr: Input should be a finite number"),
        ("run: {seed: 1}\nrun: {seed: 2}\n", "invalid YAML (line 2): duplicate key 'run'"),
        ("run: {storage_root: CONFIG}", "exists and is not a directory"),
    ],
)
def test_silent_acceptances_are_errors(tmp_path, text, expected):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text.replace("CONFIG", str(cfg)))
    with pytest.raises(UserError, match=re.escape(expected)):
        load_config(cfg)


def test_a_non_utf8_config_is_one_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(b"run: {name: \xff}\n")
    with pytest.raises(UserError, match="not UTF-8 text"):
        load_config(cfg)


def test_a_static_split_larger_than_the_cluster_is_refused(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cluster: {workers: 2}\nscheduler: {static_split: {rollout: 2, reward: 1, train: 1}}\n")
    with pytest.raises(UserError, match="static_split needs 4 devices; cluster.workers is 2"):
        load_config(cfg)

# ----------------------------------------------------------------------------------------------------
# Dataset-only fields and the judge section: typed, and errors where they would be ignored
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "field"),
    [
        (["task.on_bad_row=skip"], "task.on_bad_row"),
        (["task.eval_fraction=0.1"], "task.eval_fraction"),
        (["task.verifier=math"], "task.verifier"),
        (["task.eval_dataset=e.jsonl"], "task.eval_dataset"),
        (["task.generate=arith-word-problems"], "task.generate"),
        (["task.dataset=d", "task.eval_dataset=e", "task.eval_fraction=0.1"], "task.eval_fraction"),
        (["task.dataset=d.jsonl", "task.options={median: 3}"], "task.options"),
        (["task.dataset=d.jsonl", "reward.sft.data_options={median: 3}"], "reward.sft.data_options"),
        (["task.dataset=d.jsonl", "task.eval_fraction=1.0"], "task.eval_fraction"),
        (["task.dataset=d.jsonl", "task.verifier=fuzzy"], "task.verifier"),
        (["reward.judge.verdict={kind: regex, pattern: 'v: (yes|no)', rewards: {'yes': 1}}"], "named group"),
        (["reward.judge.verdict={kind: regex, pattern: '(?P<verdict>[', rewards: {'y': 1}}"], "not a regex"),
        (["reward.judge.verdict={kind: regex, pattern: '(?P<verdict>y)', rewards: {on: 1}}"], "YAML boolean"),
        (["reward.judge.verdict={kind: score, range: [10, 0]}"], "low end"),
        (["reward.judge.verdict={kind: vibes}"], "reward.judge.verdict"),
        (["rollout.chat_template=always"], "rollout.chat_template"),
    ],
)
def test_dataset_and_judge_fields_are_checked_in_one_line(sets, field):
    with pytest.raises(UserError) as exc:
        load_config(None, overrides=sets)
    assert field in str(exc.value) and "\n" not in str(exc.value) and exc.value.exit_code == 2


def test_dataset_and_judge_fields_load_typed():
    cfg = load_config(
        None,
        overrides=[
            "task.dataset=d.jsonl",
            "task.eval_fraction=0.2",
            "task.verifier=math",
            "task.on_bad_row=skip",
            "gps.keep_last=5",
            "reward.judge.verdict={kind: score, range: [1, 5]}",
            "reward.judge.template='Q {prompt} A {response}'",
        ],
    )
    assert cfg.task.eval_fraction == 0.2 and cfg.gps.keep_last == 5
    assert cfg.reward.judge.verdict.kind == "score" and cfg.reward.judge.verdict.range == (1.0, 5.0)


def test_the_runtime_passes_the_shift_lock_multiple_to_core() -> None:
    from pivotrl.run import controller_config

    assert controller_config(load_config(None)).cooldown_shift_multiple == 3.0
    cfg = load_config(None, overrides=["scheduler.cooldown_shift_multiple=0.5"])
    assert controller_config(cfg).cooldown_shift_multiple == 0.5
