"""Global Parameter Storage: any process fetches any model's weights, at any version, on demand.

    store = ParameterStore("storage/gps", host_tier="/dev/shm/pivotrl-gps", device="cuda")
    store.publish("policy", 3, model.state_dict())      # snapshot + write-behind; store.flush() to wait
    sd = store.fetch("policy", "latest", device="cuda")  # device tier -> host tier -> persistent tier
    part = store.fetch("genrm", 1, names=["lm_head.weight"])
    store.pin("policy", 0); store.gc("policy", keep_last=3)

Modules: `store` (tiers, write-behind, fallback), `layout` (the Zarr v3 on-disk format, exclusive commit,
direct chunk I/O), `manifest` (names, dtypes, checksums), `backend` (local fast path / fsspec URLs),
`device_tier` (in-process LRU in bytes), `errors`.
"""

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
