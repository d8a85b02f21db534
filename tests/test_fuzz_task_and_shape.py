"""The free-form parts of a config, past loading (hypothesis): a synthetic task's `options`, a bootstrap
model's `shape`, a simulated workload against its KV caches, and a run's KV budget against its prompts.

Loading a config that holds any of these either fails in one line naming the field, or gives something
that works when it is used: the task samples problems of sizes inside its bounds, the model can be built,
every simulated sequence is admitted. Before these checks such inputs loaded and failed later with a
traceback (`task.options.median: -1` a math domain error, `num_attention_heads: -1` a negative tensor
dimension, a response budget above the KV cache a failed admission)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pivotrl.config import PipelineConfig, SFTConfig, load_config
from pivotrl.errors import FieldError, UserError, shown_key
from pivotrl.model_shapes import MODEL_SIZES, check_shape
from pivotrl.tasks import get_task
from pivotrl.tasks.synthetic import MAX_ITEMS, length_distribution

SETTINGS = settings(max_examples=300, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
NUMBERS = st.one_of(
    st.integers(-(10**20), 10**20), st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-3, 12), st.floats(0, 12), st.floats(-1e308, 1e308),
)
VALUES = st.one_of(NUMBERS, st.none(), st.booleans(), st.text(max_size=6),
                   st.lists(st.integers(), max_size=2), st.sampled_from(["1e3", "2", "-1", "nan", "inf"]))
OPTION_KEYS = st.one_of(st.sampled_from(["median", "sigma", "min_size", "max_size"]), st.text(max_size=8))


@SETTINGS
@given(options=st.dictionaries(OPTION_KEYS, VALUES, max_size=4), seed=st.integers(0, 10**6))
def test_task_options_sample_inside_their_bounds_or_name_the_option(options, seed):
    try:
        dist = length_distribution(options)
    except FieldError as exc:
        assert str(exc).startswith(f"task.options.{shown_key(exc.key)}: "), exc
        assert exc.key in options or exc.key == "min_size", exc  # min_size: above max_size
        assert "\n" not in str(exc)
        return
    assert 1 <= dist.min_size <= dist.max_size <= MAX_ITEMS
    rng = random.Random(seed)
    for _ in range(50):  # no finite median or sigma overflows a draw
        assert dist.min_size <= dist.draw(rng) <= dist.max_size
    problems = get_task("sort", options).sample(3, seed)
    assert all(dist.min_size <= p.meta["size"] <= dist.max_size for p in problems)


def test_a_bad_task_option_is_one_line_at_load_time(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("task: {name: sort, options: {median: -3}}\n")
    with pytest.raises(UserError, match=r"task\.options\.median: must be > 0"):
        load_config(path, PipelineConfig)
    with pytest.raises(UserError, match=r"reward\.sft\.data_options\.min_size: 20 is above max_size 10"):
        load_config(path, PipelineConfig, ["task.options.median=3", "task.options.max_size=10",
                                           "reward.sft.data_options.min_size=20"])


SHAPE_KEYS = st.one_of(st.sampled_from(sorted(MODEL_SIZES["debug"])), st.sampled_from(["head_dim", "x"]))
SHAPE_VALUES = st.one_of(st.integers(-2, 9), st.sampled_from([16, 32, 48, 64, 96, 128, 10**6, 10**12]))


@SETTINGS
@given(shape=st.dictionaries(SHAPE_KEYS, SHAPE_VALUES, max_size=4))
def test_a_model_shape_builds_or_names_its_field(shape):
    from pivotrl.engines.bootstrap import build_config
    from pivotrl.engines.model import CausalLM

    try:
        check_shape("debug", shape)
    except FieldError as exc:
        assert exc.key in shape, exc
        with pytest.raises(UserError, match=r"^<config>: train\.sft\.shape\."):
            from pivotrl.config import validate

            validate({"train": {"sft": {"shape": shape}}}, PipelineConfig)
        return
    config = build_config(SFTConfig(shape=shape))
    size = sum(p.numel() for p in CausalLM.from_config(config, device="meta").parameters())
    if size <= 3_000_000:  # small enough to build for real and run: the forward pass works
        model = CausalLM.from_config(config)
        assert model(torch.zeros((1, 3), dtype=torch.long)).shape[:2] == (1, 3)


def test_the_shipped_shapes_pass():
    for base in MODEL_SIZES:
        check_shape(base, {})
    check_shape("debug", {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2})


LENGTH = st.fixed_dictionaries(
    {"dist": st.sampled_from(["lognormal", "constant", "uniform", "empirical"])},
    optional={
        "median": st.floats(1, 500), "sigma": st.floats(0, 2), "value": st.integers(1, 600),
        "low": st.integers(1, 50), "high": st.integers(50, 600), "min": st.integers(1, 20),
        "max": st.integers(20, 600), "samples": st.lists(st.integers(1, 600), min_size=1, max_size=5),
    },
)


@settings(max_examples=40, derandomize=True, deadline=None)
@given(prompt=LENGTH, response=LENGTH, critique=LENGTH, kv=st.integers(64, 2048), template=st.integers(0, 64))
def test_a_simulated_workload_loads_only_if_every_sequence_fits_its_kv_cache(
    prompt, response, critique, kv, template
):
    from pivotrl.sim.compare import simulate
    from pivotrl.sim.config import load_sim_config

    over = [f"cost.rollout.kv_tokens={kv}", f"cost.reward.kv_tokens={kv}",
            "workload.prompts_per_iteration=3", "workload.group_size=2", "workload.iterations=1",
            f"workload.judge_template_tokens={template}"]
    for name, dist in (("prompt_len", prompt), ("response_len", response), ("critique_len", critique)):
        over.append(f"workload.{name}=" + "{" + ", ".join(f"{k}: {v}" for k, v in dist.items()) + "}")
    try:
        cfg = load_sim_config("configs/sim/cpu-2dev.yaml", over)
    except UserError as exc:
        assert "\n" not in str(exc)
        return
    res = simulate(cfg, "colocated")  # core admits every sequence, or this raises
    assert res.finished


def test_a_run_whose_prompt_and_budget_exceed_the_kv_budget_stops_in_one_line(capsys, tmp_path, monkeypatch):
    from pivotrl import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(
        f"run: {{storage_root: {tmp_path / 'st'}}}\nrollout: {{engine: {{kv_budget_tokens: 16}}}}\n"
    )
    assert cli.main(["validate", "c.yaml"]) == 2
    err = capsys.readouterr().err
    assert "rollout.engine.kv_budget_tokens: 16 tokens cannot hold one sequence" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@settings(max_examples=200, derandomize=True, deadline=None)
@given(median=st.floats(1e-3, 1e3), sigma=st.floats(0, 5), low=st.integers(1, 20), span=st.integers(0, 80),
       seed=st.integers(0, 10**6))
def test_the_clipped_draw_is_the_plain_formula_where_that_does_not_overflow(median, sigma, low, span, seed):
    """Clipping in log space changes no size that `max(min, min(max, round(exp(x))))` gives: the task
    samples the same problems (and the bootstrap's cached models stay valid)."""
    import math

    from pivotrl.tasks.synthetic import LengthDistribution

    dist = LengthDistribution(median, sigma, low, low + span)
    ours, plain = random.Random(seed), random.Random(seed)
    for _ in range(200):
        x = plain.gauss(math.log(median), sigma)
        assert dist.draw(ours) == max(low, min(low + span, round(math.exp(x))))


@settings(max_examples=200, deadline=None)
@given(stem=st.text(min_size=1, max_size=12).filter(lambda s: "/" not in s and "\x00" not in s),
       suffix=st.sampled_from(["", ".jsonl", ".JSONL", ".json", ".parquet", ".pq", ".csv", ".txt",
                               ".jsonl.gz"]),
       generate=st.booleans())
def test_a_dataset_name_is_accepted_only_in_a_format_the_loader_reads(stem: str, suffix: str,
                                                                       generate: bool) -> None:
    """Any name: accepted only where the loader will read it (and a generator writes JSONL), else one
    error naming `task.dataset`, raised by the config before anything is read or written."""
    from pydantic import ValidationError

    from pivotrl.config import TaskConfig
    from pivotrl.tasks.datasets import DATASET_SUFFIXES, JSONL_SUFFIXES

    name = stem + suffix
    allowed = JSONL_SUFFIXES if generate else DATASET_SUFFIXES
    fields = {"name": "arith", "dataset": name, "generate": "arith-word-problems" if generate else None}
    try:
        TaskConfig(**fields)
    except ValidationError as exc:
        assert Path(name).suffix.lower() not in allowed, (name, exc)
        assert "[dataset]" in str(exc)
    else:
        assert Path(name).suffix.lower() in allowed, name


_text = st.text(alphabet=st.characters(codec=None, categories=("L", "N", "P", "Zs", "Cs")), max_size=6)
_tree = st.recursive(st.one_of(_text, st.integers(), st.none()),
                     lambda kids: st.one_of(st.lists(kids, max_size=3),
                                            st.dictionaries(_text, kids, max_size=3)),
                     max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(data=st.dictionaries(_text, _tree, max_size=4))
def test_not_text_finds_a_lone_surrogate_anywhere_and_only_there(data: dict) -> None:
    """Whatever the nesting: None exactly when every key and string encodes as UTF-8; otherwise the first
    such key or string in order, named by its dotted path and the index of its first surrogate."""
    from pivotrl.errors import not_text

    def bad(x, at=()):  # (dotted path, first surrogate's index) of every key or string that fails, in order
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
        for k, v in items:
            here = (*at, str(k))
            for t in (k, v):
                if isinstance(t, str):
                    hits = [i for i, c in enumerate(t) if 0xD800 <= ord(c) <= 0xDFFF]
                    if hits:
                        yield ".".join(here), hits[0]
            yield from bad(v, here)

    expected = next(bad(data), None)
    assert not_text(data) == expected
