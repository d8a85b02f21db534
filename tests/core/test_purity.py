"""pivotrl.core must stay pure: no Dask, torch, I/O or wall clock (time is passed in by the driver)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "pivotrl" / "core"
FORBIDDEN_MODULES = {"dask", "distributed", "torch", "time", "datetime", "os", "io", "pathlib", "socket",
                     "subprocess", "threading", "asyncio", "random", "shutil", "tempfile", "logging"}
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval", "__import__"}


def _files() -> list[Path]:
    files = sorted(CORE.glob("*.py"))
    assert files, CORE
    return files


def test_core_imports_nothing_impure() -> None:
    for path in _files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in FORBIDDEN_MODULES, f"{path.name} imports {name}"
                if top == "pivotrl":
                    assert name.startswith("pivotrl.core"), f"{path.name} imports {name} outside core"


def test_core_calls_no_io_builtins() -> None:
    for path in _files():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in FORBIDDEN_CALLS, f"{path.name}:{node.lineno} calls {node.func.id}"


def test_importing_core_loads_no_heavy_module() -> None:
    code = ("import sys; import pivotrl.core; "
            "bad = [m for m in ('torch', 'dask', 'distributed') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=CORE.parents[1])
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
