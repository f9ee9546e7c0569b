"""The built-in task behind `tempering demo`: two-number addition, scored exactly."""

from .run import DemoResult, run_demo
from .task import AdditionTask

__all__ = ["AdditionTask", "DemoResult", "run_demo"]
