"""Make a student model reproduce a teacher's turn (ART's `art.guided_completion`, for RL distillation).

`get_guided_completion_params(teacher_completion, base_tools)` returns the request parameters
that force the student's next turn to be the teacher's: its text through `guided_choice`, or
its tool call through `tool_choice` plus a copy of that tool whose parameter schema admits only
the teacher's arguments. The student's sampled tokens (and their own logprobs) are then trained
like any rollout; keep `TrainConfig(exclude_forced_tokens=False)` (the default), since every
token of such a turn is forced. Same name, arguments and return value as ART's; the code is ours.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from typing import Any

from .errors import ConfigError

__all__ = ["freeze_tool_schema", "get_guided_completion_params"]


def freeze_tool_schema(tool: dict[str, Any], fixed_args: dict[str, Any]) -> dict[str, Any]:
    """A copy of `tool` whose parameters admit exactly `fixed_args` (each argument a JSON Schema `const`)."""
    frozen = copy.deepcopy(tool)
    frozen["function"]["parameters"] = {
        "type": "object",
        "properties": {name: {"const": value} for name, value in fixed_args.items()},
        "required": list(fixed_args),
        "additionalProperties": False,
    }
    return frozen


def get_guided_completion_params(
    completion: Any, base_tools: Iterable[dict[str, Any]] | None = None
) -> tuple[list[str] | None, dict[str, Any] | None, list[dict[str, Any]] | None]:
    """Parameters that make a student's next turn the teacher's turn in `completion`.

    Args:
        completion: the teacher's `ChatCompletion` (its first choice is used).
        base_tools: the tools the teacher had (needed when it called one).

    Returns:
        (guided_choice, tool_choice, tools): for a text answer `([content], None, None)`; for a
        tool call `(None, {"type": "function", "function": {"name": f}}, [f frozen to the
        teacher's arguments])`. Send them as `tools=tools, tool_choice=tool_choice,
        extra_body={"guided_choice": guided_choice}` (leaving out the ones that are None).

    Raises:
        ConfigError (a ValueError): if the turn has neither text nor a tool call, if it called a
            tool but `base_tools` is None or lacks it, or if its arguments are not a JSON object.
    """
    message = completion.choices[0].message
    calls = message.tool_calls or []
    if calls:
        call = calls[0]
        name = call.function.name
        if base_tools is None:
            raise ConfigError(f"the teacher called {name!r}; pass base_tools, the tools it had")
        tool = next((t for t in base_tools if t.get("function", {}).get("name") == name), None)
        if tool is None:
            raise ConfigError(f"the teacher called {name!r}, which is not in base_tools")
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError as exc:
            raise ConfigError(f"the teacher's arguments to {name!r} are not JSON: {exc}") from None
        if not isinstance(arguments, dict):
            raise ConfigError(f"the teacher's arguments to {name!r} are not a JSON object")
        return None, {"type": "function", "function": {"name": name}}, [freeze_tool_schema(tool, arguments)]
    if message.content is None:
        raise ConfigError("the teacher's completion has neither text nor a tool call")
    return [message.content], None, None
