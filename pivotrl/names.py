"""The one rule for user-given names that become paths (run names, model names in the store).

Why one rule, checked at config load: a name such as `../../x` or `a/b` would make the run write (and,
before writing, delete) a directory outside `run.storage_root`; a trailing newline or a NUL makes a path
that no shell can name. Every such name is checked here before anything is created or deleted.
"""

from __future__ import annotations

import re

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")
RULE = "1-128 characters from [A-Za-z0-9_.-], starting with a letter or digit, no '..'"


def is_safe_name(name: object) -> bool:
    return isinstance(name, str) and _NAME.fullmatch(name) is not None and ".." not in name


def check_name(name: object, what: str = "name") -> str:
    """`name` if it is safe as one path component; else ValueError naming `what` and the rule."""
    if not is_safe_name(name):
        raise ValueError(f"{what} {name!r} is not a safe name: use {RULE}")
    return str(name)


def check_storage_root(path: object) -> str:
    """A storage root: a non-empty path without NUL or newline that is not an existing non-directory."""
    import os

    if not isinstance(path, str) or not path or any(c in path for c in "\x00\n\r"):
        raise ValueError(f"storage root {path!r} is not a usable path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"storage root {path} exists and is not a directory")
    return path


def writable_storage_root(path: str) -> None:
    """Create the storage root if it is missing and check that this process may write in it, else a
    `UserError` naming `run.storage_root`. The commands that write (submit, bootstrap) call it before any
    work, so a root that cannot be created fails in a second, not when the first model or run directory is
    saved (a bootstrap trained for minutes first). Never at config load: `validate` creates nothing."""
    import os

    from pivotrl.errors import UserError

    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UserError(f"run.storage_root: cannot create {path} ({exc.strerror or exc})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"run.storage_root: {path} is not writable by this user")


def check_output(output: object, inputs: list[object], what: str) -> None:
    """Refuse an output path that is one of the command's inputs (`simulate X.yaml --json X.yaml` would
    replace the user's config with the report). Compared after resolving links and relative parts."""
    import os

    if output is None:
        return
    out = os.path.realpath(str(output))
    for inp in inputs:
        if inp is not None and os.path.realpath(str(inp)) == out:
            from pivotrl.errors import UserError

            raise UserError(f"{what} {output}: is an input of this command; write the output elsewhere")
