"""Supervised fine-tuning data from JSONL files (OpenAI chat fine-tuning format)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import TrajectoryError
from .training.sft import message_weight
from .types import TrainResult, TrainSFTConfig, Trajectory

if TYPE_CHECKING:
    from .model import TrainableModel

__all__ = ["read_sft_jsonl", "train_sft_from_file"]


def read_sft_jsonl(path: str | Path) -> list[Trajectory]:
    """One Trajectory per line `{"messages": [...], "tools": [...]}` (tools optional).

    A message's `"weight"` is 1 (learn from it, the default) or 0 (context only), as in OpenAI's
    format; it is kept in the message for training, which strips it before the chat template.

    Raises:
        TrajectoryError: naming the line that is not JSON, has no messages, has a weight other than
            0 or 1 (and its message), or has no assistant message of weight 1.
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
            try:
                for i, m in enumerate(messages):
                    message_weight(m if isinstance(m, dict) else {}, i)
            except TrajectoryError as exc:
                raise TrajectoryError(f"{path}:{number}: {exc}") from None
            assistant = [m for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
            if not assistant:
                raise TrajectoryError(f"{path}:{number}: no assistant message to learn from")
            if all(m.get("weight", 1) == 0 for m in assistant):
                raise TrajectoryError(f'{path}:{number}: every assistant message has "weight": 0, so there is nothing '
                                      "to learn from; give at least one weight 1 (or no weight)")
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
