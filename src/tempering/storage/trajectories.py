"""Trajectories of a step as JSONL, one trajectory per line: `trajectories/<split>/<step:04d>.jsonl`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .history import open_for_append

__all__ = ["write_trajectories"]


def write_trajectories(path: Path, groups: Iterable[Iterable[Any]]) -> None:
    """Append each trajectory of each group (a `Trajectory`) with its group index, one per line."""
    with open_for_append(path) as f:
        for group_index, group in enumerate(groups):
            for trajectory in group:
                record = trajectory.for_logging()
                record["group"] = group_index
                f.write(json.dumps(record, default=str) + "\n")
