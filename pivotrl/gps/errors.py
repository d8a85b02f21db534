"""Errors of the Global Parameter Storage.

User mistakes (a bad model name, a version that does not exist, publishing a version twice) are
`UserError`s so the CLI prints them as one line; so is corruption found on read (`IntegrityError`), whose
message names the model, the version, the tier and the tensor. Background-write failures keep their own
type.
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


class IntegrityError(UserError, RuntimeError):
    """Stored bytes do not match the manifest's checksum (corruption), in every tier that was tried.

    Not the user's mistake, but nothing a traceback would add: the message names the model, the version,
    each tier and the tensors that failed, and the CLI prints it as that one line (exit 2)."""


class WriteBehindError(RuntimeError):
    """A background (write-behind) persist failed; raised by `flush()` or the next call, never dropped."""
