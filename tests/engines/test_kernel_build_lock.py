"""A torch extension build lock left by a killed build no longer hangs every later run (slow: it compiles
the native kernels once into an empty cache)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_stale_build_lock_is_removed_and_the_build_completes(tmp_path):
    ext = tmp_path / "ext"
    code = (
        "from torch.utils.cpp_extension import _get_build_directory as d; from pathlib import Path; "
        "from pivotrl.engines.kernels import _build_name; "
        "p = Path(d(_build_name(), False)); p.mkdir(parents=True, exist_ok=True); "
        "(p / 'lock').touch(); print(p / 'lock')\n"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}
    made = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    lock = Path(made.stdout.strip())
    assert lock.exists()  # what a killed build leaves behind
    build = "from pivotrl.engines import kernels; print(kernels.native() is not None)"
    p = subprocess.run([sys.executable, "-c", build], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.stdout.strip() == "True", p.stderr[-2000:]
    assert not lock.exists()
