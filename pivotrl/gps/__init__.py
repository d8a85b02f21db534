"""Global Parameter Storage: publish and fetch versioned model weights across tiers (see `store`)."""

from pivotrl.gps.errors import (
    GPSError,
    IntegrityError,
    InvalidModelName,
    NotFoundError,
    VersionExistsError,
    WriteBehindError,
)
from pivotrl.gps.manifest import Manifest, TensorEntry
from pivotrl.gps.store import ParameterStore

__all__ = [
    "GPSError",
    "IntegrityError",
    "InvalidModelName",
    "Manifest",
    "NotFoundError",
    "ParameterStore",
    "TensorEntry",
    "VersionExistsError",
    "WriteBehindError",
]
