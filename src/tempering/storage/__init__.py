"""On-disk state of a model: layout, checkpoints, history, trajectories, plots."""

from .checkpoints import (
    CheckpointInfo,
    delete_checkpoints,
    drop_training_state,
    latest_step,
    list_checkpoints,
    recover_checkpoints,
    set_aside,
    verify_checkpoint,
    write_atomically,
)
from .history import append_history, mark_resume, read_history
from .layout import ModelPaths, check_name
from .plots import plot_history
from .retention import retained_steps
from .trajectories import compact_trajectories, read_trajectories, write_trajectories

__all__ = [
    "CheckpointInfo",
    "ModelPaths",
    "append_history",
    "check_name",
    "compact_trajectories",
    "delete_checkpoints",
    "drop_training_state",
    "latest_step",
    "list_checkpoints",
    "mark_resume",
    "plot_history",
    "read_history",
    "read_trajectories",
    "recover_checkpoints",
    "retained_steps",
    "set_aside",
    "verify_checkpoint",
    "write_atomically",
    "write_trajectories",
]
