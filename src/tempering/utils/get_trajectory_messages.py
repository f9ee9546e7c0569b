"""`get_trajectory_messages`: a trajectory as plain chat messages, choices reduced to their text."""

from __future__ import annotations

from typing import Any

from ..types import Messages, Trajectory

__all__ = ["get_trajectory_messages"]


def get_trajectory_messages(trajectory: Trajectory) -> Messages:
    """The trajectory's messages, each `Choice` turned into `{"role": "assistant", "content": text}`.

    As ART's helper, a choice keeps only its text (no tool calls, no token ids); messages
    (dicts) are returned as they are. `trajectory.messages()` keeps a choice's tool calls.
    """
    messages: Messages = []
    for item in trajectory.messages_and_choices:
        data: Any = item if isinstance(item, dict) else item.to_dict()
        if "message" in data and "role" not in data:  # a Choice
            messages.append({"role": "assistant", "content": data["message"].get("content")})
        else:
            messages.append(data)
    return messages
