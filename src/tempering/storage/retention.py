"""Which checkpoints a retention policy keeps: the newest K, and the best by a logged metric.

A LoRA checkpoint is small, but a run saves one per step: a rank-8 adapter of a 7B model is about
80 MB, so 1,000 steps kept whole would fill 80 GB (240 GB with each one's AdamW state). Keeping the
10 newest and the best one holds such a run under 1.1 GB (the newest alone keeps its optimizer
state, `checkpoints.drop_training_state`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["retained_steps"]


def retained_steps(saved_steps: Iterable[int], history: Iterable[dict[str, Any]], *, keep_last: int,
                   best_metric: str | None) -> set[int]:
    """The saved steps to keep: the `keep_last` highest, and the one whose `best_metric` (a key of the
    history rows, logged at the step whose policy it measured, e.g. "val/reward") is highest, ties
    to the later step, as ART's `delete_checkpoints` picks it. Steps never scored are not "best".

    Args:
        saved_steps: the steps that have a checkpoint.
        history: rows of history.jsonl (`read_history`).
        keep_last: how many of the newest checkpoints to keep (>= 1).
        best_metric: None to keep no best one.
    """
    saved = sorted(set(saved_steps))
    keep = set(saved[-keep_last:])
    if best_metric is not None:
        scored = [(row[best_metric], row["step"]) for row in history
                  if isinstance(row.get(best_metric), int | float) and not isinstance(row.get(best_metric), bool)
                  and row.get("step") in saved]
        if scored:
            keep.add(max(scored)[1])
    return keep
