"""Checkpoint directories: atomic writes, verification, listing, deletion, recovery after a crash.

A checkpoint is `checkpoints/<step:04d>/` holding a PEFT adapter (`adapter_config.json`,
`adapter_model.safetensors`), the training state a resume needs (`optimizer.pt`, `rng.pt`),
`trainer_state.json`, and `manifest.json`: every other file's size and CRC-32, so a truncated or
corrupted file (as a crashed copy leaves it) is named instead of loaded. It is written into a
temporary sibling directory and renamed into place, so a crash never leaves a half-written one.

Only the newest checkpoint needs the training state (a resume starts there): once a newer one is
in place, `drop_training_state` deletes it from the older ones, which keep what `fork` and
serving a past step read (the adapter). `recover_checkpoints` undoes what a killed process left
half done.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError

__all__ = [
    "CheckpointInfo",
    "delete_checkpoints",
    "drop_training_state",
    "latest_step",
    "list_checkpoints",
    "recover_checkpoints",
    "set_aside",
    "verify_checkpoint",
    "write_atomically",
]


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    step: int
    path: Path


WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")  # PEFT's, new and old
TRAINING_STATE_FILES = ("optimizer.pt", "rng.pt")  # what only a resume reads (the newest checkpoint's)
MANIFEST = "manifest.json"
_TMP, _OLD, _DEL = ".tmp-", ".old-", ".del-"  # being written, being replaced, being deleted


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


def _crc32(path: Path, *, sync: bool = False) -> int:
    """CRC-32 of a file's bytes, read in 4 MiB blocks; with `sync`, fsync it too (its contents on disk)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(4 << 20):
            crc = zlib.crc32(block, crc)
        if sync:
            os.fsync(f.fileno())
    return crc


def write_atomically(final_dir: Path, write: Callable[[Path], None]) -> Path:
    """Call `write(tmp_dir)`, add the manifest of what it wrote (sizes and CRC-32s), flush it all to
    disk, then rename `tmp_dir` to `final_dir` (replacing an older one).

    Raises:
        CheckpointError: if writing fails (a full disk: the OS's error, with the fix); `final_dir`
            is then untouched and no temporary directory is left.
    """
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = final_dir.parent / f"{_TMP}{final_dir.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        files = sorted(p for p in tmp.rglob("*") if p.is_file() and p.name != MANIFEST)
        manifest = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "crc32": _crc32(p, sync=True)} for p in files}
        (tmp / MANIFEST).write_text(json.dumps({"files": manifest}, indent=1))
        _crc32(tmp / MANIFEST, sync=True)
        old = None
        if final_dir.exists():
            old = final_dir.parent / f"{_OLD}{final_dir.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final_dir, old)
        os.rename(tmp, final_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, CheckpointError):
            fix = _SPACE_FIX if _out_of_space(exc, final_dir.parent) else ""
            raise CheckpointError(f"could not write {final_dir}: {exc}{fix}") from exc
        raise
    return final_dir


_SPACE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_SPACE_FIX = (". The disk (or a quota, or the file size limit) is full: free space, or keep fewer checkpoints "
              "(TrainConfig(keep_last_checkpoints=...)), then train again; the previous checkpoint is intact")


def _out_of_space(exc: BaseException, directory: Path) -> bool:
    """Whether a write failed for want of space: the OS's error number, its text in a library's message
    (safetensors writes from Rust: "File too large (os error 27)"), or, when the message gives no
    reason (torch.save: "file write failed"), a file system with under 64 MiB left."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _SPACE_ERRORS:
            return True
        if any(os.strerror(code) in str(seen) for code in _SPACE_ERRORS):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(directory).free < 64 << 20
    except OSError:
        return False


def verify_checkpoint(checkpoint_dir: Path, *, training_state: bool = True) -> None:
    """Check that a checkpoint's files are whole: present, and of the size and CRC-32 its manifest
    records (the adapter only, without `training_state`). A training-state file an older checkpoint
    no longer holds (`drop_training_state`) is not missing. A checkpoint written before manifests
    existed gets its adapter's header and length checked.

    Raises:
        CheckpointError: naming the first damaged or missing file, and the fix.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not is_complete(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir} is not a checkpoint: it lacks adapter_config.json or the adapter's "
                              "weights (adapter_model.safetensors)")
    manifest_path = checkpoint_dir / MANIFEST
    if not manifest_path.is_file():
        _check_safetensors(checkpoint_dir)
        return
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise _damaged(manifest_path, f"cannot be read ({exc})") from None
    for name, expected in files.items():
        path = checkpoint_dir / name
        if name in TRAINING_STATE_FILES and not (training_state and path.exists()):
            continue  # dropped on purpose (only the newest checkpoint keeps it), or not asked for
        if not path.is_file():
            raise _damaged(path, "is missing")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise _damaged(path, f"is truncated or overwritten ({size} bytes; {expected['bytes']} were written)")
        if _crc32(path) != expected["crc32"]:
            raise _damaged(path, "is corrupted (its CRC-32 differs from the one written with it)")


def _check_safetensors(checkpoint_dir: Path) -> None:
    """A checkpoint without a manifest: its safetensors header must parse and fit the file."""
    path = checkpoint_dir / WEIGHTS_FILES[0]
    if not path.is_file():
        return
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as exc:
        raise _damaged(path, f"cannot be read ({exc})") from None


def _damaged(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint file {path} {problem}, as an interrupted copy or a failing disk leaves it. Copy the checkpoint "
        f"again from where it came from, or delete {path.parent} to resume from the checkpoint before it")


def set_aside(checkpoint_dir: Path) -> Path:
    """Rename a damaged checkpoint to `<step>.damaged` (never listed, never loaded; kept for inspection)."""
    target = checkpoint_dir.with_name(f"{checkpoint_dir.name}.damaged")
    n = 1
    while target.exists():
        n += 1
        target = checkpoint_dir.with_name(f"{checkpoint_dir.name}.damaged-{n}")
    os.rename(checkpoint_dir, target)
    return target


def drop_training_state(checkpoints_dir: Path, newest_step: int) -> list[Path]:
    """Delete the optimizer and RNG state of every checkpoint older than `newest_step` (call once
    `newest_step`'s checkpoint, with its own state, is in place); returns the deleted files."""
    dropped = []
    for info in list_checkpoints(checkpoints_dir):
        if info.step < newest_step:
            for name in TRAINING_STATE_FILES:
                path = info.path / name
                if path.is_file():
                    path.unlink()
                    dropped.append(path)
    return dropped


def recover_checkpoints(checkpoints_dir: Path) -> list[str]:
    """Undo what a process killed inside `write_atomically` or `delete_checkpoints` left behind: a
    checkpoint renamed aside (`.old-<step>-*`) whose replacement never arrived is put back, and
    every other temporary directory is deleted. Call it before anything writes (at a clean start). Returns what it did,
    one line each."""
    done: list[str] = []
    if not checkpoints_dir.is_dir():
        return done
    for entry in sorted(checkpoints_dir.iterdir()):
        if not entry.is_dir() or not entry.name.startswith((_TMP, _OLD, _DEL)):
            continue
        step_name = entry.name.split("-")[1]
        final = checkpoints_dir / step_name
        if entry.name.startswith(_OLD) and not final.exists() and is_complete(entry):
            os.rename(entry, final)
            done.append(f"restored {final} (its replacement was never written)")
        else:
            shutil.rmtree(entry, ignore_errors=True)
            done.append(f"deleted the unfinished {entry}")
    return done


def delete_checkpoints(checkpoints_dir: Path, keep_steps: Iterable[int]) -> list[int]:
    """Delete every checkpoint whose step is not in `keep_steps`, the highest saved step always
    kept (a resume starts there); return the deleted steps."""
    saved = list_checkpoints(checkpoints_dir)
    keep = set(keep_steps) | ({saved[-1].step} if saved else set())
    deleted = []
    for info in saved:
        if info.step not in keep:
            doomed = info.path.with_name(f"{_DEL}{info.path.name}-{uuid.uuid4().hex[:8]}")
            os.rename(info.path, doomed)  # gone at once; a kill inside rmtree leaves no half checkpoint
            shutil.rmtree(doomed, ignore_errors=True)
            deleted.append(info.step)
    return deleted


def read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)
