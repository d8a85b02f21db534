"""Engine tests run tiny models: one torch thread is fastest on a shared box (more only oversubscribe).

`fake_vllm` puts tests/engines/fake_vllm first on sys.path for a test that asks for it, then removes every
`vllm` module again, so that elsewhere `import vllm` still fails (or finds the real one) and the "vllm not
installed" paths keep being tested."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


FAKE = Path(__file__).parent / "fake_vllm"


def drop_vllm_modules() -> None:
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


@pytest.fixture
def fake_vllm(monkeypatch):
    drop_vllm_modules()
    monkeypatch.syspath_prepend(str(FAKE))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "unset-by-test")
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD")  # restored to its state before the test afterwards
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    import vllm

    assert vllm.__version__.endswith("+fake")
    yield vllm
    vllm.FAKE_DEVICE = None
    vllm.LIVE_ENGINES.clear()
    drop_vllm_modules()
