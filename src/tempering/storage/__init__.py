"""On-disk state of a model: layout, checkpoints, history, trajectories, plots."""

from .checkpoints import CheckpointInfo, delete_checkpoints, latest_step, list_checkpoints, write_atomically
from .history import append_history, mark_resume, read_history
from .layout import ModelPaths, check_name
from .plots import plot_history
from .trajectories import write_trajectories

__all__ = [
    "CheckpointInfo",
    "ModelPaths",
    "append_history",
    "check_name",
    "delete_checkpoints",
    "latest_step",
    "list_checkpoints",
    "mark_resume",
    "plot_history",
    "read_history",
    "write_atomically",
    "write_trajectories",
]
