"""Verifiers of dataset tasks: they *measure* (held-out accuracy, judge agreement), never reward.

``exact``: the response equals the answer after whitespace normalisation. ``math``: a final answer is
extracted from the response (the last ``\\boxed{...}``, else the last ``answer: ...`` / ``#### ...``, else the
last number) and compared with the reference as a number when both parse (integers, decimals, ``1,000``,
``a/b``, ``\\frac{a}{b}``), else as text without whitespace or case. A reference is read by its box or
marker when it has one (GSM8K-style ``... #### 72`` works unchanged), else taken whole.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction

from pivotrl.tasks.base import normalize

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ANSWER = re.compile(r"(?:final answer|answer)\s*(?:is|:|=)\s*([^\n]+)|####\s*([^\n]+)", re.IGNORECASE)
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")


def _last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces included."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i : j - 1] if depth == 0 else None


def extract_answer(text: str) -> str | None:
    """The final answer a response states, or None when it states none (no box, marker or number)."""
    if not isinstance(text, str):
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    marked = _ANSWER.findall(text)
    if marked:
        a, b = marked[-1]
        return (a or b).strip().rstrip(".").strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def reference_answer(reference: str) -> str:
    """A reference's answer: its box or ``####``/``answer:`` marker, else the whole of it (a reference
    states its answer; its last number is not necessarily that answer, as in ``x + 1``)."""
    boxed = _last_boxed(reference)
    if boxed is not None:
        return boxed.strip()
    marked = _ANSWER.findall(reference)
    if marked:
        a, b = marked[-1]
        return (a or b).strip().rstrip(".").strip()
    return reference.strip()


def to_number(text: str) -> Fraction | None:
    """``text`` as an exact number when it is one (after stripping ``$``, spaces, a trailing period, a
    unit-free sign), else None."""
    t = _FRAC.sub(r"(\1)/(\2)", text.strip().strip("$").strip())
    t = t.replace("\\!", "").replace(" ", "").rstrip(".,")
    t = re.sub(r"^\((-?[\d.]+)\)/\((-?[\d.]+)\)$", r"\1/\2", t)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", t):
        t = t.replace(",", "")
    try:
        if "/" in t:
            num, den = t.split("/", 1)
            return Fraction(num) / Fraction(den)
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def _numeric(answer: str) -> Fraction | None:
    """An extracted answer as a number: the whole of it, else the number it starts with (``42 apples``,
    not the ``1`` of ``x+1``)."""
    value = to_number(answer)
    if value is None:
        lead = re.match(r"\s*\$?\s*(" + _NUMBER.pattern + r")(?:\s|$)", _FRAC.sub(r"\1/\2", answer))
        value = to_number(lead.group(1)) if lead else None
    return value


def math_equal(response: str, reference: str) -> bool:
    """The response's final answer equals the reference's: as numbers when both parse, else as text."""
    got = extract_answer(response)
    want = reference_answer(reference)
    if got is None or not want:
        return False
    a, b = _numeric(got), _numeric(want)
    if a is not None and b is not None:
        return a == b
    return "".join(got.split()).lower().rstrip(".") == "".join(want.split()).lower().rstrip(".")


def exact_equal(response: str, reference: str) -> bool:
    return normalize(response) == normalize(reference)


VERIFIERS: dict[str, Callable[[str, str], bool]] = {"exact": exact_equal, "math": math_equal}
