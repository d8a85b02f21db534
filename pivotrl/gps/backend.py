"""Storage back ends of a tier: the local file system (fast path) and any fsspec URL (multi-node).

Both store the same Zarr v3 layout; they differ only in how bytes move and in how the commit point is made
exclusive:

- `LocalBackend` reads chunk files with `os.preadv` straight into the caller's (freshly allocated) buffer and
  writes them with `os.writev` from the tensors' own memory, so no byte is copied in user space. Its commit
  point is `os.link` of a fully written temp file onto the final name: atomic (a reader sees the whole file or
  nothing) and exclusive (EEXIST for the second writer), unlike `rename`, which silently replaces.
- `FsspecBackend` uses `fs.open(path, "xb")` for the commit point (exclusive on local files, and on object
  stores whose fsspec driver supports conditional writes); on drivers without it, it falls back to an
  exists-check then write, which is atomic per object but can let two racing writers both think they won.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from typing import Protocol

from pivotrl.durable import fsync_dir

_IOV_MAX = 512


class Backend(Protocol):
    root: str

    def join(self, *parts: str) -> str: ...
    def read_small(self, path: str) -> bytes: ...
    def write_small(self, path: str, data: bytes) -> None: ...
    def create_exclusive(self, path: str, data: bytes) -> bool: ...
    def list_dir(self, path: str) -> list[str]: ...
    def exists(self, path: str) -> bool: ...
    def makedirs(self, path: str) -> None: ...
    def write_file(self, path: str, buffers: list[memoryview]) -> None: ...
    def read_into(self, path: str, offset: int, out: memoryview) -> None: ...
    def remove_file(self, path: str) -> None: ...
    def remove_tree(self, path: str) -> None: ...
    def retire_dir(self, path: str, trash: str, commit_file: str) -> None: ...
    def mtime(self, path: str) -> float | None: ...


class LocalBackend:
    """A directory on a local (or node-local, e.g. /dev/shm) file system."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = fsync
        os.makedirs(self.root, exist_ok=True)

    def __repr__(self) -> str:
        return f"LocalBackend({self.root!r})"

    def join(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def read_small(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write_small(self, path: str, data: bytes) -> None:
        self.write_file(path, [memoryview(data)])

    def create_exclusive(self, path: str, data: bytes) -> bool:
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        self.write_file(tmp, [memoryview(data)])
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        if self.fsync:
            fsync_dir(os.path.dirname(path))
        return True

    def list_dir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def write_file(self, path: str, buffers: list[memoryview]) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            bufs = [b for b in buffers if b.nbytes]
            while bufs:
                batch = bufs[:_IOV_MAX]
                n = os.writev(fd, batch)
                # writev may write less than asked (signals, huge requests): drop what was written, go on.
                while n and batch:
                    if n >= batch[0].nbytes:
                        n -= batch[0].nbytes
                        batch.pop(0)
                        bufs.pop(0)
                    else:
                        bufs[0] = batch[0] = batch[0][n:]
                        n = 0
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            done, total = 0, out.nbytes
            while done < total:
                n = os.preadv(fd, [out[done:]], offset + done)
                if n == 0:
                    raise EOFError(f"{path}: truncated, wanted {total} bytes at offset {offset}, got {done}")
                done += n
        finally:
            os.close(fd)

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def retire_dir(self, path: str, trash: str, commit_file: str) -> None:
        """Make a version invisible in one atomic step (rename away), then delete it at leisure."""
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def mtime(self, path: str) -> float | None:
        try:
            return os.stat(path).st_mtime
        except FileNotFoundError:
            return None

    def sync_dir(self, path: str) -> None:
        if self.fsync:
            fsync_dir(path)


class FsspecBackend:
    """Any fsspec URL (`file://`, `s3://`, `gs://`, `memory://` ...): the multi-node persistent tier."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.fs, path = fsspec.core.url_to_fs(url)
        self.url = url
        self.root = path.rstrip("/") or "/"
        self.fs.makedirs(self.root, exist_ok=True)

    def __repr__(self) -> str:
        return f"FsspecBackend({self.url!r})"

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def read_small(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def write_small(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
            return True
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError, TypeError):
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True

    def list_dir(self, path: str) -> list[str]:
        # Object-store clients (s3fs, gcsfs) cache listings with no expiry: a reader on another node would
        # never see a version committed after its first listing. Listings here are few and small.
        self.fs.invalidate_cache(path)
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False)]
        except FileNotFoundError:
            return []

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def write_file(self, path: str, buffers: list[memoryview]) -> None:
        with self.fs.open(path, "wb") as f:
            for b in buffers:
                f.write(b)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        data = self.fs.cat_file(path, start=offset, end=offset + out.nbytes)
        if len(data) != out.nbytes:
            raise EOFError(
                f"{path}: truncated, wanted {out.nbytes} bytes at offset {offset}, got {len(data)}"
            )
        out[:] = data

    def remove_file(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def remove_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    def retire_dir(self, path: str, trash: str, commit_file: str) -> None:
        """Object stores cannot rename atomically: deleting the commit file is the atomic step."""
        self.remove_file(commit_file)
        self.remove_tree(path)

    def mtime(self, path: str) -> float | None:
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        m = info.get("mtime") or info.get("created") or info.get("LastModified")
        return float(m.timestamp()) if hasattr(m, "timestamp") else (float(m) if m is not None else None)

    def sync_dir(self, path: str) -> None:
        return None


def make_backend(location: str | os.PathLike[str], *, fsync: bool = False) -> LocalBackend | FsspecBackend:
    """A plain path takes the local fast path; a URL (`file://` included) goes through fsspec."""
    loc = os.fspath(location)
    if "://" in loc:
        return FsspecBackend(loc)
    return LocalBackend(loc, fsync=fsync)
