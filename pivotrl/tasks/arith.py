"""Arithmetic word problems with numeric answers: the worked example's dataset, generated here.

Why generated and not shipped: no data is downloaded or committed, and a user's own JSONL has exactly this
shape (``{"uid", "prompt", "answer", ...}``, extra fields kept as metadata), so the example exercises the
same loading, split and verifier path a real dataset does. Each row also carries a one-line ``solution``
(``12 + 7 = 19. answer: 19``) that the tiny bootstrap policy imitates; a real dataset needs none.

Deterministic in (rows, seed); ASCII only, so the character tokenizer of the tiny models covers it.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

NAMES = ["Ana", "Ben", "Caro", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo", "Kim", "Lea", "Max", "Noor"]
THINGS = ["apples", "books", "coins", "pens", "shells", "stamps", "marbles", "cards", "eggs", "beads"]


def _add(rng: random.Random) -> tuple[str, str, int]:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    return (
        f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?",
        f"{a} + {b}",
        a + b,
    )


def _sub(rng: random.Random) -> tuple[str, str, int]:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a = rng.randint(10, 90)
    b = rng.randint(1, a - 1)
    return f"{who} had {a} {what} and gave away {b}. How many {what} are left?", f"{a} - {b}", a - b


def _mul(rng: random.Random) -> tuple[str, str, int]:
    what = rng.choice(THINGS)
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    return (
        f"There are {a} boxes with {b} {what} in each. How many {what} are there in all?",
        f"{a} * {b}",
        a * b,
    )


def _div(rng: random.Random) -> tuple[str, str, int]:
    what = rng.choice(THINGS)
    k, q = rng.randint(2, 9), rng.randint(2, 12)
    return (
        f"{k * q} {what} are shared equally by {k} friends. How many {what} does each get?",
        f"{k * q} / {k}",
        q,
    )


def _two_step(rng: random.Random) -> tuple[str, str, int]:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(5, 50), rng.randint(2, 30)
    c = rng.randint(1, a + b - 1)
    text = f"{who} has {a} {what}, finds {b} more, then loses {c}. How many {what} does {who} have?"
    return text, f"{a} + {b} - {c}", a + b - c


KINDS: dict[str, Callable[[random.Random], tuple[str, str, int]]] = {
    "add": _add,
    "sub": _sub,
    "mul": _mul,
    "div": _div,
    "two_step": _two_step,
}


def word_problems(rows: int = 2400, seed: int = 0) -> list[dict[str, Any]]:
    """`rows` distinct problems (uids ``arith-<k>``) with their answers, kinds and one-line solutions."""
    rng = random.Random(f"arith:{seed}")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(out) < rows:
        kind = rng.choice(sorted(KINDS))
        prompt, expr, value = KINDS[kind](rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append(
            {
                "uid": f"arith-{len(out)}",
                "prompt": prompt,
                "answer": str(value),
                "kind": kind,
                "solution": f"{expr} = {value}. answer: {value}",
            }
        )
    return out


def write_jsonl(path: str | Path, rows: int = 2400, seed: int = 0) -> Path:
    """Write the problems to `path` atomically (a reader never sees half a file)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as fh:
        for row in word_problems(rows, seed):
            fh.write(json.dumps(row) + "\n")
    tmp.replace(out)
    return out


GENERATORS: dict[str, Callable[[Path], Path]] = {"arith-word-problems": write_jsonl}
