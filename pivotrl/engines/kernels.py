"""Native CPU kernels for the decode step, compiled on first use; the torch path stands in without them.

Why: see `csrc/kernels_impl.h` — between its matmuls, one decode step is many tiny ops in torch
(RoPE, KV store, small batched attention matmuls, softmax, residual adds, norms, SwiGLU), and on CPU their
fixed costs, not their FLOPs, dominate a small model's step. The kernels fuse them: one attention call
per layer, one add+norm between sublayers, one silu*mul, and the step's matmuls for decode-sized batches
(fp32 on AVX-512 and AVX2, bf16 on AVX512-BF16; `cpu_pack.PackedWeight` uses them, oneDNN otherwise).

One build carries every instruction-set path (`csrc/kernels.h`): AVX-512, AVX2 + FMA and scalar, each
compiled for its own target, none with -march=native, and the module runs the best one the CPU's flags
allow (`isa()`). ``PIVOTRL_KERNEL_ISA`` = ``avx512`` | ``avx2`` | ``scalar`` forces one (``auto``, the
default, takes the best); asking for one the CPU lacks is an error, not a silent fallback. Tests run every
path the CPU has (`set_isa`), and the benchmarks record which one ran.

The kernel is built with `torch.utils.cpp_extension.load` (a C++ compiler and ninja are needed; the
build is cached under torch's extensions directory, compiled once per machine, instant after). Where it
cannot be built (no compiler, another platform) or `PIVOTRL_NATIVE_KERNELS=0`, `native()` returns None and
the model runs the equivalent torch ops, so nothing depends on the kernels being present.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [
    _CSRC / f"{name}.cpp" for name in ("bindings", "isa_scalar", "isa_avx2", "isa_avx512", "isa_avx512bf16")
]
_HEADERS = [_CSRC / "kernels.h", _CSRC / "kernels_impl.h"]  # torch's build cache does not see these
_NAME = "pivotrl_kernels"
ISAS = ("avx512", "avx2", "scalar")
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


def requested_isa() -> str:
    """``PIVOTRL_KERNEL_ISA`` (``auto`` when unset): the instruction-set path the kernels must run."""
    value = os.environ.get("PIVOTRL_KERNEL_ISA", "auto").strip().lower() or "auto"
    if value not in ("auto", *ISAS):
        raise ValueError(f"PIVOTRL_KERNEL_ISA={value!r}: expected one of auto, {', '.join(ISAS)}")
    return value


def _build_name() -> str:
    """The extension's name with a digest of the headers: torch's cache rebuilds when a listed source
    changes, but it does not read the headers they include."""
    import hashlib

    digest = hashlib.sha256(b"".join(p.read_bytes() for p in _HEADERS)).hexdigest()[:8]
    return f"{_NAME}_{digest}"


def _build() -> object | None:
    try:
        from torch.utils.cpp_extension import load

        # No -march=native: the build targets the baseline CPU and each kernel file its own instruction set
        # (csrc/kernels.h), so one cached build runs on any x86-64 CPU.
        flags = ["-O3"]
        sources = [str(p) for p in _SOURCES]
        name = _build_name()
        with _clear_stale_build_lock(name):
            module = load(name=name, sources=sources, extra_cflags=flags, verbose=False)
    except Exception as exc:  # no compiler / ninja / headers: the torch path is used instead
        log.warning(
            "pivotrl native decode kernel unavailable (%s: %s); using torch ops", type(exc).__name__, exc
        )
        return None
    module.set_isa(requested_isa())  # an ISA this CPU lacks raises: forcing a path must not fall back
    return module


def native() -> object | None:
    """The compiled module (`decode_attention`, `add_rms_norm`, `silu_mul`, `linear`; `isa()`,
    `set_isa(name)`, `supported_isas()`; see csrc/bindings.cpp), or None."""
    if not enabled_by_env():
        return None
    with _lock:
        if "module" not in _loaded:
            _loaded["module"] = _build()
    return _loaded["module"]


def isa() -> str:
    """The path the decode kernels run on: ``avx512`` | ``avx2`` | ``scalar``, or ``torch`` (no kernels)."""
    module = native()
    return "torch" if module is None else str(module.isa())
