"""Checkpoint directories: atomic writes, listing, deletion.

A checkpoint is `checkpoints/<step:04d>/` holding a PEFT adapter (`adapter_config.json`,
`adapter_model.safetensors`), `optimizer.pt` and `trainer_state.json`. It is written into a
temporary sibling directory and renamed into place, so a crash never leaves a half-written one.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

__all__ = ["CheckpointInfo", "delete_checkpoints", "latest_step", "list_checkpoints", "write_atomically"]


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    step: int
    path: Path


WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's, new and old


def is_complete(checkpoint_dir: Path) -> bool:
    """Whether a checkpoint directory holds an adapter's config and its weights."""
    return (checkpoint_dir / "adapter_config.json").is_file() and any((checkpoint_dir / f).is_file() for f in WEIGHTS_FILES)


def list_checkpoints(checkpoints_dir: Path) -> list[CheckpointInfo]:
    """Complete checkpoints (named by their step, holding an adapter's config and weights), oldest first."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for entry in checkpoints_dir.iterdir():
        if entry.name.isdigit() and is_complete(entry):
            found.append(CheckpointInfo(int(entry.name), entry))
    return sorted(found, key=lambda c: c.step)


def latest_step(checkpoints_dir: Path) -> int:
    """The highest saved step, or 0 when there is none."""
    found = list_checkpoints(checkpoints_dir)
    return found[-1].step if found else 0


def write_atomically(final_dir: Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_dir)`, then rename `tmp_dir` to `final_dir` (replacing an older one).

    Raises:
        CheckpointError: if writing fails; `final_dir` is then untouched.
    """
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = final_dir.parent / f".tmp-{final_dir.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        for path in tmp.rglob("*"):  # flush file contents before the rename makes them visible
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        old = None
        if final_dir.exists():
            old = final_dir.parent / f".old-{final_dir.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final_dir, old)
        os.rename(tmp, final_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, CheckpointError):
            raise CheckpointError(f"could not write {final_dir}: {exc}") from exc
        raise
    return final_dir


def delete_checkpoints(checkpoints_dir: Path, keep_steps: Iterable[int]) -> list[int]:
    """Delete every checkpoint whose step is not in `keep_steps`, the highest saved step always
    kept (a resume starts there); return the deleted steps."""
    saved = list_checkpoints(checkpoints_dir)
    keep = set(keep_steps) | ({saved[-1].step} if saved else set())
    deleted = []
    for info in saved:
        if info.step not in keep:
            shutil.rmtree(info.path)
            deleted.append(info.step)
    return deleted


def read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)
