"""`history.jsonl`: one JSON object per logged step, appended, never rewritten."""

from __future__ import annotations

import datetime
import json
import math
import os
from pathlib import Path
from typing import Any, TextIO

__all__ = ["append_history", "open_for_append", "read_history"]


def open_for_append(path: Path) -> TextIO:
    """`open(path, "a")` for JSONL, after ending a torn last line (a crash mid-write) with a newline,
    so that the next row starts a line of its own instead of being lost with the torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    return open(path, "a")


def append_history(path: Path, row: dict[str, Any]) -> dict[str, Any]:
    """Append `row` (plus `recorded_at`) as one line; non-finite floats are written as null."""
    row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    row.setdefault("recorded_at", datetime.datetime.now(datetime.UTC).isoformat())
    with open_for_append(path) as f:
        f.write(json.dumps(row) + "\n")
    return row


def read_history(path: Path) -> list[dict[str, Any]]:
    """All rows, oldest first; a torn last line (a crash mid-write) is skipped."""
    if not path.is_file():
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows
