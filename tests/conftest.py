"""Shared fixtures: a deterministic `debug` model directory (HF format), built once per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def debug_model_dir(tmp_path_factory):
    """Path of a `debug` (~1M parameter) Qwen2-style HF model dir with tokenizer, seed 0."""
    from pivotrl.engines.checkpoints import create_model

    return create_model("debug", tmp_path_factory.mktemp("models") / "debug", seed=0)
