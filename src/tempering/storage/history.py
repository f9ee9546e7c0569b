"""`history.jsonl`: one JSON object per logged step, appended, never rewritten."""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any

__all__ = ["append_history", "read_history"]


def append_history(path: Path, row: dict[str, Any]) -> dict[str, Any]:
    """Append `row` (plus `recorded_at`) as one line; non-finite floats are written as null."""
    row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    row.setdefault("recorded_at", datetime.datetime.now(datetime.UTC).isoformat())
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
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
