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


def _build() -> object | None:
    try:
        from torch.utils.cpp_extension import load

        # -march=native: AVX-512 where the CPU has it. The build cache is per machine user; a home directory
        # shared by machines of different CPUs should set PIVOTRL_NATIVE_KERNELS=0 or its own
        # TORCH_EXTENSIONS_DIR.
        flags = ["-O3", "-march=native"]
        sources = [str(p) for p in _SOURCES]
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
