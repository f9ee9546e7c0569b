"""ART's module path `art.trajectories`: the trajectory types (defined in `tempering.types`)."""

from .types import History, PydanticException, Trajectory, TrajectoryGroup

__all__ = ["History", "PydanticException", "Trajectory", "TrajectoryGroup"]
