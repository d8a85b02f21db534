"""Load problems from JSONL or parquet files.

Each row needs a non-empty string ``prompt`` and ``answer``; ``uid`` is optional (defaults to
``<file stem>-<line>``); every other field is kept as the problem's metadata. A bad row (not an object, a
missing field, invalid JSON, a uid seen before in the file) is either an error naming the file and line
(``on_bad_row="error"``, the default: nothing is silently dropped) or skipped and counted (``"skip"``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pivotrl.errors import UserError, not_text
from pivotrl.tasks.base import Problem


@dataclass
class LoadedDataset:
    problems: list[Problem]
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)


def _row_problem(row: Any, where: str, default_uid: str) -> Problem:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: row must be an object, got {type(row).__name__}")
    for key in ("prompt", "answer"):
        value = row.get(key)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where}: field '{key}' must be a non-empty string")
    uid = row.get("uid", default_uid)
    if uid is None or isinstance(uid, (dict, list)) or str(uid).strip() == "":
        raise ValueError(f"{where}: field 'uid' must be a non-empty string or number")
    bad = not_text(row)  # JSON may escape a lone surrogate (\ud800): a str no tokenizer, hash or file takes
    if bad is not None:
        raise ValueError(f"{where}: field {bad[0]!r} is not text (a lone surrogate at character "
                         f"{bad[1]})")
    meta = {k: v for k, v in row.items() if k not in ("prompt", "answer", "uid")}
    return Problem(uid=str(uid), prompt=row["prompt"], answer=row["answer"], meta=meta)


def _jsonl_rows(path: Path):
    """Each line decoded on its own, so one line that is not UTF-8 is one bad row (skippable), not a
    failure of the whole file."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, lineno, ValueError(f"{where}: not UTF-8 (byte {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                yield where, lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, lineno, ValueError(f"{where}: invalid JSON ({exc.msg})")
            except RecursionError:
                yield where, lineno, ValueError(f"{where}: invalid JSON (nested too deeply)")


def _parquet_rows(path: Path):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise UserError(f"{path}: not a readable parquet file ({exc})") from None
    for i, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}: row {i}", i, row


#: File suffixes of the dataset formats `load_dataset` reads (JSONL first: what a generator writes).
JSONL_SUFFIXES = (".jsonl", ".json")
DATASET_SUFFIXES = (*JSONL_SUFFIXES, ".parquet", ".pq")


def dataset_format_error(path: str, jsonl_only: bool = False) -> str | None:
    """Why `path` names no dataset format this loader reads (None: it does), from its suffix alone, so that
    a config is refused before any file is read or written."""
    allowed = JSONL_SUFFIXES if jsonl_only else DATASET_SUFFIXES
    if Path(path).suffix.lower() in allowed:
        return None
    return ("a generated dataset is JSONL: name the file *.jsonl" if jsonl_only
            else "unknown dataset format (use .jsonl or .parquet)")


def load_dataset(path: str | Path, on_bad_row: Literal["error", "skip"] = "error") -> LoadedDataset:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: dataset file not found")
    why = dataset_format_error(str(p))
    if why is not None:
        raise UserError(f"{p}: {why}")
    rows = _jsonl_rows(p) if p.suffix.lower() in JSONL_SUFFIXES else _parquet_rows(p)
    out = LoadedDataset(problems=[])
    seen: set[str] = set()
    for where, index, row in rows:
        try:
            if isinstance(row, Exception):
                raise row
            problem = _row_problem(row, where, default_uid=f"{p.stem}-{index}")
            if problem.uid in seen:  # the held-out split is by uid: two rows with one uid would straddle it
                raise ValueError(f"{where}: duplicate uid {problem.uid!r}")
            seen.add(problem.uid)
            out.problems.append(problem)
        except ValueError as exc:
            if on_bad_row == "error":
                raise UserError(str(exc)) from None
            out.skipped += 1
            if len(out.skipped_examples) < 5:
                out.skipped_examples.append(str(exc))
    if not out.problems:
        raise UserError(f"{p}: no valid rows ({out.skipped} skipped)")
    return out
