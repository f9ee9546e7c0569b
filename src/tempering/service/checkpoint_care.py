"""A model's checkpoints across crashes and long runs: where a resume starts, and what is kept.

`resume_point` is called when a model's service starts: it clears what a killed process left half
done (temporary directories, an interrupted compaction), and picks the newest checkpoint whose
files are whole, setting aside a damaged one (a truncated or corrupted file, as a crashed copy
leaves it) with a warning that names the file. `tidy_checkpoints` runs after every saved step:
the older checkpoints lose their optimizer state (only a resume reads it, and it starts from the
newest), then the step's retention settings delete what they do not keep.
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import CheckpointError
from ..storage import (
    CheckpointInfo,
    ModelPaths,
    delete_checkpoints,
    drop_training_state,
    list_checkpoints,
    read_history,
    recover_checkpoints,
    retained_steps,
    set_aside,
    verify_checkpoint,
)
from ..storage.checkpoints import TRAINING_STATE_FILES
from ..storage.trajectories import remove_stray_files

__all__ = ["resume_point", "tidy_checkpoints"]

log = logging.getLogger("tempering")


def resume_point(paths: ModelPaths, *, repair: bool) -> CheckpointInfo | None:
    """The checkpoint a model resumes from: the newest whose files are whole (None: no checkpoint).

    With `repair` (the process that writes the model's files; not the other ranks of a multi-GPU
    run, which only read them) it first deletes the temporary files a killed process left, and
    renames each damaged checkpoint newer than the one returned to `<step>.damaged`. Every damaged
    checkpoint skipped is logged as a warning naming its file; so is a resume from a checkpoint
    without optimizer state (an older one, or a fork), whose AdamW moments then start from zero.
    """
    if repair:
        for line in recover_checkpoints(paths.checkpoints_dir):
            log.warning("%s: %s, left by a process that was stopped while writing it", paths.name, line)
        for path in remove_stray_files(paths.trajectories_dir):
            log.warning("%s: deleted %s, an unfinished compaction of a stopped process", paths.name, path)
    for info in reversed(list_checkpoints(paths.checkpoints_dir)):
        try:
            verify_checkpoint(info.path)
        except CheckpointError as exc:
            moved = f"; it was moved to {set_aside(info.path)}" if repair else ""
            log.warning("%s: not resuming from step %d: %s%s", paths.name, info.step, exc, moved)
            continue
        if any(not (info.path / name).is_file() for name in TRAINING_STATE_FILES) and info.step > 0:
            log.warning("%s: resuming from step %d, which holds no optimizer state (only the newest checkpoint "
                        "keeps it): AdamW's moments start from zero, so the next steps differ a little from an "
                        "uninterrupted run", paths.name, info.step)
        return info
    return None


def tidy_checkpoints(paths: ModelPaths, step: int, config: Any, *, live_step: int) -> list[int]:
    """After checkpoint `step` is in place: delete the older checkpoints' optimizer and RNG state,
    then every checkpoint `config`'s retention (`keep_last_checkpoints`, `best_checkpoint_metric`,
    a TrainConfig or TrainSFTConfig) does not keep; `live_step` (the served one) is always kept.
    Returns the deleted steps. A failure is logged, not raised: the step itself is saved."""
    directory = paths.checkpoints_dir
    try:
        drop_training_state(directory, step)
        keep_last = config.keep_last_checkpoints
        saved = [c.step for c in list_checkpoints(directory)]
        if keep_last is None or len(saved) <= keep_last:
            return []
        metric = config.best_checkpoint_metric
        keep = retained_steps(saved, read_history(paths.history) if metric else [], keep_last=keep_last,
                              best_metric=metric)
        return delete_checkpoints(directory, keep | {step, live_step})
    except OSError as exc:
        log.warning("%s: step %d is saved, but deleting older checkpoints' files failed (%s); they stay until the "
                    "next step's checkpoint, or delete them with model.delete_checkpoints()", paths.name, step, exc)
        return []
