"""The package installs and imports without any GPU package; cheap entry points stay cheap."""

import subprocess
import sys

GPU_PACKAGES = ("vllm", "dask_cuda", "cupy", "pynvml")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_pulls_in_no_gpu_package():
    modules = ["pivotrl", "pivotrl.config", "pivotrl.cli", "pivotrl.tasks", "pivotrl.core"]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"bad = [m for m in {GPU_PACKAGES!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert 'torch' not in sys.modules and 'distributed' not in sys.modules\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr


def test_cli_help_lists_every_subcommand():
    proc = subprocess.run([sys.executable, "-m", "pivotrl.cli", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for cmd in ("submit", "bootstrap", "simulate", "plan"):
        assert cmd in proc.stdout
