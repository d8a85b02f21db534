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


def _native():
    from pivotrl.engines import kernels

    return kernels.native()


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def kernel_isa(request):
    """Each instruction-set path of the native kernels in turn (`kernels.py`), skipped only where this CPU
    lacks it (or the kernels do not build); the module's own path is restored afterwards."""
    native = _native()
    if native is None:
        pytest.skip("native kernels do not build here")
    if request.param not in native.supported_isas():
        pytest.skip(f"this CPU has no {request.param}")
    before = native.isa()
    native.set_isa(request.param)
    yield request.param
    native.set_isa(before)


@pytest.fixture(params=["auto", "off"])
def amx(request, monkeypatch):
    """Large bf16 matmuls handed to oneDNN's AMX tiles (`cpu_pack.amx_handoff`), then not: each where this
    CPU can (``auto`` is skipped on a CPU without AMX-BF16, where it changes nothing)."""
    from pivotrl.engines import cpu_pack

    monkeypatch.setenv(cpu_pack.AMX_ENV, request.param)
    if request.param == "auto" and not cpu_pack.amx_handoff():
        pytest.skip("this CPU has no AMX-BF16 tiles")
    yield request.param
