"""Tool calls in the Hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Qwen2.5/Qwen3 chat templates render tools and expect this format. For a template that ignores
`tools` (SmolLM2's does), the tool schemas go into the system prompt with Hermes-style
instructions instead, and the same format is parsed, so tool use works with every model.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "ToolCall",
    "forced_prefix",
    "parse_tool_calls",
    "tool_call_text",
    "tools_system_prompt",
]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)(?:" + re.escape(TOOL_CALL_END) + r"|$)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: `arguments` is the JSON text of the arguments object (OpenAI's format)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Hermes-style instructions listing the tools' JSON schemas (for templates that ignore `tools`)."""
    schemas = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return (
        "You can call functions. Their signatures are inside <tools></tools>:\n"
        f"<tools>\n{schemas}\n</tools>\n"
        "To call a function, reply with a JSON object holding its name and arguments inside "
        "<tool_call></tool_call> tags, like this:\n"
        '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>'
    )


def tool_call_text(name: str, arguments: str | dict[str, Any]) -> str:
    """The Hermes text of one call (how an assistant turn with `tool_calls` is rendered back).
    Empty `arguments` ("", as some clients send a call without any) render as {}, as the model
    writes such a call; text that is not JSON is rendered as a string."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    return f"{TOOL_CALL_START}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{TOOL_CALL_END}"


def forced_prefix(tool_choice: Any) -> str | None:
    """Text that starts the assistant turn so that the model must call a tool.

    "required" starts a call; {"type": "function", "function": {"name": f}} starts a call of f
    up to its arguments. Anything else forces nothing.
    """
    if tool_choice == "required":
        return TOOL_CALL_START + "\n"
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name:
            return TOOL_CALL_START + "\n" + '{"name": ' + json.dumps(name) + ', "arguments": '
    return None


def parse_tool_calls(text: str, *, allowed: set[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """Split model output into plain content and tool calls.

    Each `<tool_call>...</tool_call>` block (the closing tag may be missing at the very end)
    must hold a JSON object with a string "name" (one of `allowed`, when given) and an object
    "arguments". If any block is malformed, the whole text is returned as plain content with no
    calls: a model's broken call is never a server error.

    Returns:
        (content: the text outside the blocks without trailing whitespace, or None when that is
        empty; calls). Leading whitespace is kept: a stream has sent it before any call began, and
        the streamed deltas must concatenate to this content.
    """
    if TOOL_CALL_START not in text:
        return text, []
    calls = []
    for match in _BLOCK.finditer(text):
        try:
            data = json.loads(match.group(1).strip())
        except json.JSONDecodeError:
            return text, []
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return text, []
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return text, []
        if not isinstance(arguments, dict) or (allowed is not None and data["name"] not in allowed):
            return text, []
        calls.append(ToolCall("call_" + uuid.uuid4().hex[:24], data["name"], json.dumps(arguments, ensure_ascii=False)))
    content = _BLOCK.sub("", text).rstrip()
    return content or None, calls
