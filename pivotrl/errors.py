"""User-facing errors.

A `UserError` is bad input from a user (a config field, a data file, a command-line flag). The CLI prints
its message as one line and exits with code 2, with no traceback; everything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

from typing import Any


class UserError(Exception):
    """Bad input that the user can fix; the message names the field or file."""

    exit_code = 2


class FieldError(ValueError):
    """A check of one field of a free-form mapping failed (a task option, a model shape): `key` is the
    field as given and `why` the reason; the message names it as ``<prefix>.<key>: <why>`` on one line, and
    a caller that knows the mapping's place in a config re-raises it under that name."""

    def __init__(self, prefix: str, key: object, why: str) -> None:
        self.key, self.why = key, why
        super().__init__(f"{prefix}{'.' if prefix else ''}{shown_key(key)}: {why}")


def shown_key(key: object) -> str:
    """A mapping key as it appears in a one-line message: as written when it is a plain name, else quoted
    (a key with a newline or other control character must not break the line)."""
    text = str(key)
    return text if text.isprintable() and text and ":" not in text and " " not in text else repr(text)


def not_text(data: Any, at: tuple[str, ...] = ()) -> tuple[str, int] | None:
    """The first key or string value of `data` that is not encodable text (a lone surrogate, which YAML's
    and JSON's escapes can write: no tokenizer, hash or file takes it), as (dotted key, character index)."""
    items: Any = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        here = (*at, str(key))
        for text in (key, value):
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as exc:
                    return ".".join(here), exc.start
        found = not_text(value, here)
        if found is not None:
            return found
    return None
