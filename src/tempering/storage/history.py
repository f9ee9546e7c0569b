"""`history.jsonl`: one JSON object per logged step, appended, never rewritten.

A model that resumes at saved step S after later steps were trained without a checkpoint (or
logged) gets a marker row `{"step": S, "resumed_at_step": S}`: those later steps' policies are
gone, and their step numbers are trained again. `read_history` leaves out the rows of steps after
S logged before the marker (they stay in the file), so each step's metrics are those of the policy
that exists.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from pathlib import Path
from typing import Any, TextIO

__all__ = ["append_history", "mark_resume", "open_for_append", "read_history"]

RESUMED = "resumed_at_step"


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
    """The rows, oldest first; a torn line (a crash mid-write) is skipped, and so are the rows of
    steps after a resume's step logged before its marker (`mark_resume`), and the markers."""
    if not path.is_file():
        return []
    rows: list[dict[str, Any]] = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if RESUMED in row:
                rows = [r for r in rows if not isinstance(r.get("step"), int) or r["step"] <= row[RESUMED]]
            else:
                rows.append(row)
    return rows


def mark_resume(path: Path, step: int) -> bool:
    """Record that the model resumes at saved step `step`, if rows of later steps were logged (their
    policies were never saved); returns whether a marker was written."""
    if not any(isinstance(r.get("step"), int) and r["step"] > step for r in read_history(path)):
        return False
    append_history(path, {"step": step, RESUMED: step})
    return True
