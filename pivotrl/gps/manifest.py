"""The manifest of one published version, name validation and the dtype table.

A manifest says, for every tensor, which packed per-dtype array holds it, at which byte offset, its shape,
its torch dtype and an xxh3-64 checksum of its bytes. It is stored as the attributes of the version's Zarr
group (`<model>/v<version>/zarr.json`), whose creation is the commit point of a publish, so a reader that
can read the manifest can read the whole version.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pivotrl.gps.errors import InvalidModelName
from pivotrl.names import is_safe_name

FORMAT = "pivotrl-gps/1"
VERSION_DIGITS = 12

# torch dtype name -> (torch dtype, zarr/numpy data_type used on disk). bf16 has no zarr type: it is stored
# as its int16 bit pattern (bit-exact) and the torch dtype is recorded in the manifest.
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "float64"),
    "float32": (torch.float32, "float32"),
    "float16": (torch.float16, "float16"),
    "bfloat16": (torch.bfloat16, "int16"),
    "int64": (torch.int64, "int64"),
    "int32": (torch.int32, "int32"),
    "int16": (torch.int16, "int16"),
    "int8": (torch.int8, "int8"),
    "uint8": (torch.uint8, "uint8"),
    "bool": (torch.bool, "bool"),
}
_BY_TORCH = {td: name for name, (td, _) in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of a torch dtype, or a one-line error listing the supported ones."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise TypeError(f"GPS cannot store dtype {dtype}; supported: {', '.join(DTYPES)}") from None


def validate_model_name(model: str) -> str:
    """Reject names that could leave the store root (`..`, `/`, absolute paths) or are not portable."""
    if not is_safe_name(model):
        raise InvalidModelName(
            f"invalid model name {model!r}: use 1-128 characters from [A-Za-z0-9_.-], starting with a letter "
            "or digit, no '..' and no path separators"
        )
    return model


def validate_version(version: object) -> int:
    if (
        isinstance(version, bool)
        or not isinstance(version, int)
        or version < 0
        or version >= 10**VERSION_DIGITS
    ):
        raise InvalidModelName(f"invalid version {version!r}: expected an int in [0, 10**{VERSION_DIGITS})")
    return version


def version_dir(version: int) -> str:
    return f"v{version:0{VERSION_DIGITS}d}"


def parse_version_dir(name: str) -> int | None:
    if len(name) == VERSION_DIGITS + 1 and name[0] == "v" and name[1:].isdigit():
        return int(name[1:])
    return None


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch dtype name, a key of DTYPES
    shape: tuple[int, ...]
    array: str  # packed array (one per dtype) holding the bytes
    offset: int  # byte offset inside the packed array
    nbytes: int
    xxh3: str  # hex xxh3_64 of the tensor's bytes


@dataclass(frozen=True)
class ArrayEntry:
    name: str
    zarr_dtype: str
    itemsize: int
    nbytes: int  # bytes of real data (the array may carry < 1 chunk-element of zero padding per chunk)
    chunk_bytes: int
    nchunks: int


@dataclass(frozen=True)
class Manifest:
    model: str
    version: int
    data_id: str  # sub-group holding the arrays; unique per writer so racing writers never share files
    tensors: tuple[TensorEntry, ...]
    arrays: tuple[ArrayEntry, ...]
    created: float = field(default_factory=time.time)
    format: str = FORMAT

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def tensor_map(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    def array_map(self) -> dict[str, ArrayEntry]:
        return {a.name: a for a in self.arrays}

    def to_json(self) -> dict[str, Any]:
        # Built by hand: dataclasses.asdict deep-copies recursively and costs milliseconds per publish.
        return {
            "model": self.model,
            "version": self.version,
            "data_id": self.data_id,
            "tensors": [
                {
                    "name": t.name,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "array": t.array,
                    "offset": t.offset,
                    "nbytes": t.nbytes,
                    "xxh3": t.xxh3,
                }
                for t in self.tensors
            ],
            "arrays": [asdict(a) for a in self.arrays],
            "created": self.created,
            "format": self.format,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Manifest:
        if d.get("format") != FORMAT:
            raise ValueError(f"unknown manifest format {d.get('format')!r}, expected {FORMAT!r}")
        tensors = tuple(TensorEntry(**{**t, "shape": tuple(t["shape"])}) for t in d["tensors"])
        arrays = tuple(ArrayEntry(**a) for a in d["arrays"])
        return cls(
            model=d["model"],
            version=d["version"],
            data_id=d["data_id"],
            tensors=tensors,
            arrays=arrays,
            created=d["created"],
            format=d["format"],
        )
