"""Trajectories of a step as JSONL, one trajectory per line: `trajectories/<split>/<step:04d>.jsonl`.

A split's newest step file stays plain JSONL (appended to, readable with `tail`); once a later
step's file is written, older ones are compacted to `<step:04d>.jsonl.gz` (about 5x smaller; `zcat`
reads them, and so does `read_trajectories`).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .history import open_for_append

__all__ = ["compact_trajectories", "read_trajectories", "write_trajectories"]

_GZ = ".gz"


def write_trajectories(path: Path, groups: Iterable[Iterable[Any]]) -> None:
    """Append each trajectory of each group (a `Trajectory`) with its group index, one per line,
    then compact the split's files of earlier steps (`compact_trajectories`)."""
    with open_for_append(path) as f:
        for group_index, group in enumerate(groups):
            for trajectory in group:
                record = trajectory.for_logging()
                record["group"] = group_index
                f.write(json.dumps(record, default=str) + "\n")
    compact_trajectories(path.parent, before_step=int(path.name.split(".")[0]))


def _gz(path: Path) -> Path:
    return path.with_name(path.name + _GZ)


def compact_trajectories(split_dir: Path, *, before_step: int) -> list[Path]:
    """Gzip each `<step>.jsonl` of `split_dir` with a step below `before_step`; returns the new files.

    The compressed copy is written under a temporary name and renamed into place before the plain
    file is deleted, so a crash loses nothing; a plain file whose step already has a `.gz` of other
    content (the step was logged again after its compaction) stays as it is.
    """
    made = []
    for plain in sorted(split_dir.glob("*.jsonl")):
        stem = plain.name.split(".")[0]
        if not stem.isdigit() or int(stem) >= before_step:
            continue
        packed = _gz(plain)
        if packed.exists():
            if _same_content(packed, plain):  # a compaction killed before its last unlink
                plain.unlink()
            continue
        tmp = plain.with_name(f".{plain.name}{_GZ}.tmp")
        with open(plain, "rb") as src, gzip.open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, packed)
        plain.unlink()
        made.append(packed)
    return made


def _same_content(packed: Path, plain: Path) -> bool:
    try:
        with gzip.open(packed, "rb") as f:
            return f.read() == plain.read_bytes()
    except (OSError, EOFError):
        return False


def read_trajectories(path: Path) -> list[dict[str, Any]]:
    """The trajectories logged for one split and step (`ModelPaths.trajectories(split, step)`), from the
    plain file, its compacted `.gz`, or both; a torn last line (a crash mid-write) is skipped."""
    path = Path(path)
    packed, texts = _gz(path), []
    if packed.is_file():
        with gzip.open(packed, "rt") as f:
            texts.append(f.read())
    if path.is_file() and not (packed.is_file() and _same_content(packed, path)):
        texts.append(path.read_text())
    records = []
    for line in "\n".join(texts).splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def remove_stray_files(trajectories_dir: Path) -> list[Path]:
    """Delete the temporary files of compactions a killed process left; returns them."""
    stray = list(trajectories_dir.glob(f"*/.*{_GZ}.tmp")) if trajectories_dir.is_dir() else []
    for path in stray:
        path.unlink()
    return stray
