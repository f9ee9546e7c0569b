"""Supervised fine-tuning data from JSONL files (OpenAI chat fine-tuning format)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import TrajectoryError
from .types import TrainResult, TrainSFTConfig, Trajectory

if TYPE_CHECKING:
    from .model import TrainableModel

__all__ = ["read_sft_jsonl", "train_sft_from_file"]


def read_sft_jsonl(path: str | Path) -> list[Trajectory]:
    """One Trajectory per line `{"messages": [...], "tools": [...]}` (tools optional).

    Raises:
        TrajectoryError: naming the line that is not JSON, has no messages, or has no assistant message.
    """
    trajectories = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TrajectoryError(f"{path}:{number}: not JSON ({exc})") from None
            messages = record.get("messages") if isinstance(record, dict) else None
            if not isinstance(messages, list) or not messages:
                raise TrajectoryError(f'{path}:{number}: expected {{"messages": [...]}}')
            if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
                raise TrajectoryError(f"{path}:{number}: no assistant message to learn from")
            trajectories.append(Trajectory(messages_and_choices=messages, tools=record.get("tools")))
    if not trajectories:
        raise TrajectoryError(f"{path} holds no examples")
    return trajectories


async def train_sft_from_file(
    model: TrainableModel,
    file_path: str | Path,
    *,
    epochs: int = 1,
    batch_size: int | str = "auto",
    learning_rate: float | list[float] = 5e-5,
) -> TrainResult:
    """`model.train_sft` on the examples of a JSONL file (see read_sft_jsonl)."""
    config = TrainSFTConfig(epochs=epochs, batch_size=batch_size, learning_rate=learning_rate)
    return await model.train_sft(read_sft_jsonl(file_path), config=config)
