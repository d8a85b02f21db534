"""Code that runs *inside* vLLM's GPU worker processes: the weight push, as a vLLM worker extension.

Why a worker extension and raw bytes: since vLLM 0.9, `LLM.collective_rpc` serialises its call with
msgpack and refuses a Python function (pickling code across processes is insecure), so the method must be
a *name* on the worker, which vLLM adds to its worker class when the engine is built with
`worker_extension_cls="pivotrl.engines.vllm_worker.WeightLoader"`. The arguments cross the same msgpack
channel untyped: a `torch.Tensor` argument arrives as a bare `[dtype, shape, index]` list whose buffer is
gone, so each tensor is sent as `(name, dtype, shape, bytes)` — plain msgpack types — and rebuilt here.
The push needs no file (the old path wrote a safetensors copy of the whole model to /dev/shm, which is
64 MB in a default container and 15–61 GB for the paper's models), and the chunks bound its memory.

This module must stay importable without vllm (it is imported by vLLM's worker, and by the tests' fake).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

WORKER_EXTENSION = "pivotrl.engines.vllm_worker.WeightLoader"
LOAD_METHOD = "pivotrl_load_weights"
CHUNK_BYTES = 256 << 20  # per collective_rpc call: bounds the push's extra host memory

WireTensor = tuple[str, str, list[int], bytes]  # name, torch dtype name, shape, raw little-endian bytes


def to_wire(name: str, t: torch.Tensor) -> WireTensor:
    """One tensor as msgpack-native values (bf16 included: the bytes are the tensor's own)."""
    cpu = t.detach().to("cpu").contiguous()
    raw = cpu.reshape(-1).view(torch.uint8).numpy().tobytes() if cpu.numel() else b""
    return name, str(cpu.dtype).removeprefix("torch."), list(cpu.shape), raw


def from_wire(item: WireTensor | list) -> tuple[str, torch.Tensor]:
    """The inverse of `to_wire` (msgpack may hand the tuple back as a list, and bytes as a memoryview)."""
    if not isinstance(item, list | tuple) or len(item) != 4:
        raise TypeError(f"expected a (name, dtype, shape, bytes) wire tensor, got {str(item)[:80]}")
    name, dtype_name, shape, raw = item
    dtype = getattr(torch, str(dtype_name), None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name}: unknown dtype {dtype_name!r}")
    if not len(raw):
        return str(name), torch.empty([int(s) for s in shape], dtype=dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return str(name), flat.view(dtype).reshape([int(s) for s in shape])


def wire_chunks(
    state: Mapping[str, torch.Tensor], chunk_bytes: int = CHUNK_BYTES, skip: Iterable[str] = ()
) -> Iterator[list[WireTensor]]:
    """The state dict in chunks of about `chunk_bytes` (a tensor larger than that travels alone)."""
    skipped = set(skip)
    chunk: list[WireTensor] = []
    size = 0
    for name, t in state.items():
        if name in skipped:
            continue
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(to_wire(name, t))
        size += nbytes
    if chunk:
        yield chunk


class WeightLoader:
    """Mixed into vLLM's GPU worker class by `worker_extension_cls`; `self` is the worker."""

    model_runner: object

    def pivotrl_load_weights(self, chunk: list) -> int:
        """Load one chunk of HF-named tensors into this worker's model; returns how many it loaded."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        tensors = [from_wire(item) for item in chunk]
        model.load_weights(weights=iter(tensors))
        return len(tensors)
