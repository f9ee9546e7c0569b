"""Reporting a model's metrics to Weights & Biases (optional; `pip install wandb`).

A model reports when its `report_metrics` lists "wandb", or, when `report_metrics` is None, when
W&B is configured in the environment (`WANDB_API_KEY`, or `WANDB_MODE=offline`) and installed.
Rows are logged with `training_step` as their x-axis, so validation logged after a step and
train metrics logged at it land on the same axis (as ART does).
"""

from __future__ import annotations

import os
from typing import Any

from .errors import MissingDependencyError

__all__ = ["WandbReporter", "wandb_wanted"]


def wandb_wanted(report_metrics: list[str] | None) -> bool:
    if report_metrics is not None:
        return "wandb" in report_metrics
    if not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in ("offline", "dryrun")):
        return False
    try:
        import wandb  # noqa: F401
    except ImportError:
        return False
    return True


class WandbReporter:
    """One W&B run per model (id = model name, resumed if it exists)."""

    def __init__(self, *, project: str, name: str, config: dict[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise MissingDependencyError("report_metrics=['wandb'] needs wandb: pip install wandb") from exc
        self.run = wandb.init(project=project, name=name, id=name, resume="allow", config=config or {}, reinit="create_new")
        self.run.define_metric("training_step")
        self.run.define_metric("*", step_metric="training_step")

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        self.run.log({"training_step": step, **{k: v for k, v in metrics.items() if isinstance(v, int | float)}})

    def finish(self) -> None:
        self.run.finish()
