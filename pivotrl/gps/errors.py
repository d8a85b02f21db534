"""Errors of the Global Parameter Storage.

User mistakes (a bad model name, a version that does not exist, publishing a version twice) are
`UserError`s so the CLI prints them as one line; data-integrity and background-write failures are not user
mistakes and keep their own types, but their messages still name the model, the version and the tensor.
"""

from __future__ import annotations

from pivotrl.errors import UserError


class GPSError(UserError):
    """A user-facing mistake when using the parameter store."""


class InvalidModelName(GPSError):
    """A model name that could escape the store root or is not portable across file systems."""


class NotFoundError(GPSError, LookupError):
    """A model, version or tensor that is not in the store; the message lists what exists."""


class VersionExistsError(GPSError):
    """(model, version) was already published: versions are immutable, exactly one writer wins."""


class IntegrityError(RuntimeError):
    """Stored bytes do not match the manifest's checksum (corruption), in every tier that was tried."""


class WriteBehindError(RuntimeError):
    """A background (write-behind) persist failed; raised by `flush()` or the next call, never dropped."""
