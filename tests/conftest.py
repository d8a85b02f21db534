"""Shared fixtures: a deterministic `debug` model directory (HF format), built once per test session."""

from __future__ import annotations

import os

import pytest

from pivotrl.engines.bootstrap import MKL_REPRODUCIBLE

# As the bootstrap's worker processes run (`bootstrap._init_worker`): set before this process's first MKL
# call, so that a test training in-process gets the same bits on one thread and on two.
os.environ.setdefault(*MKL_REPRODUCIBLE)


@pytest.fixture(scope="session")
def debug_model_dir(tmp_path_factory):
    """Path of a `debug` (~1M parameter) Qwen2-style HF model dir with tokenizer, seed 0."""
    from pivotrl.engines.checkpoints import create_model

    return create_model("debug", tmp_path_factory.mktemp("models") / "debug", seed=0)
