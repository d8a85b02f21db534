"""User-facing errors.

A `UserError` is bad input from a user (a config field, a data file, a command-line flag). The CLI prints
its message as one line and exits with code 2, with no traceback; everything else is a bug and keeps its
traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input that the user can fix; the message names the field or file."""

    exit_code = 2
