"""Native CPU kernels for the decode step, compiled on first use; the torch path stands in without them.

Why: see `csrc/decode_attention.cpp` — between its matmuls, one decode step is many tiny ops in torch
(RoPE, KV store, small batched attention matmuls, softmax, residual adds, norms, SwiGLU), and on CPU their
fixed costs, not their FLOPs, dominate a small model's step. The kernels fuse them: one attention call
per layer, one add+norm between sublayers, one silu*mul. `csrc/linear.cpp` adds the step's matmuls for
decode-sized batches (fp32 on AVX-512, bf16 on AVX512-BF16; `cpu_pack.PackedWeight` uses them, oneDNN
otherwise). The kernel is built with
`torch.utils.cpp_extension.load` (a C++ compiler and ninja are needed; the build is cached under torch's
extensions directory, about 40 s the first time on a 2-core box, instant after). Where it cannot be built
(no compiler, another platform) or `PIVOTRL_NATIVE_KERNELS=0`, `native()` returns None and the model runs
the equivalent torch ops, so nothing depends on the kernels being present.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)
_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("decode_attention.cpp", "linear.cpp")]
_lock = threading.Lock()
_loaded: dict[str, object] = {}


def enabled_by_env() -> bool:
    return os.environ.get("PIVOTRL_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _clear_stale_build_lock(name: str) -> contextlib.AbstractContextManager[object]:
    """Hold pivotrl's own build lease for `name` and drop torch's build `lock` file if one is there.

    Why: torch's extension build marks itself with a plain `lock` file and every later build of the same
    extension waits on it forever; a builder killed mid-build (a SIGKILLed driver, a test timeout) leaves it
    behind and every run after hangs. Every pivotrl builder holds this `flock` for the whole build, and the
    kernel drops an `flock` when its holder dies, so whoever holds it knows no live builder owns the file.
    """
    import fcntl

    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, False))
    build_dir.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def held():
        with open(build_dir / "pivotrl-build.lease", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # waits for a live builder in another process
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing a stale torch extension build lock left by a dead build: %s", stale)
                stale.unlink(missing_ok=True)
            yield None

    return held()


def _build() -> object | None:
    try:
        from torch.utils.cpp_extension import load

        # -march=native: AVX-512 where the CPU has it. The build cache is per machine user; a home directory
        # shared by machines of different CPUs should set PIVOTRL_NATIVE_KERNELS=0 or its own
        # TORCH_EXTENSIONS_DIR.
        flags = ["-O3", "-march=native"]
        sources = [str(p) for p in _SOURCES]
        with _clear_stale_build_lock("pivotrl_decode_attention"):
            return load(name="pivotrl_decode_attention", sources=sources, extra_cflags=flags, verbose=False)
    except Exception as exc:  # no compiler / ninja / headers: the torch path is used instead
        log.warning(
            "pivotrl native decode kernel unavailable (%s: %s); using torch ops", type(exc).__name__, exc
        )
        return None


def native() -> object | None:
    """The compiled module (`decode_attention`, `add_rms_norm`, `silu_mul`; see the C++ source), or None."""
    if not enabled_by_env():
        return None
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _build()
    return _loaded["module"]
