"""`format_message`: a chat message as readable text, for printing a trajectory (ART's `art.utils`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ..types import Choice, MessageOrChoice, choice_to_message

__all__ = ["format_message"]


def format_message(message: MessageOrChoice) -> str:
    """The message as `"<Role>:\\n<content>"`, then one `name(arguments)` line per tool call.

    As ART's helper: the role capitalized on the first line, the text below it, and each tool
    call as `function_name(json_arguments)` on a line of its own. A `Choice` is shown as the
    assistant message it stands for; content given as a list of parts shows its text parts
    (other parts as `[<type>]`); a message with no content shows only its tool calls.

        >>> format_message({"role": "user", "content": "What is 2+2?"})
        'User:\\nWhat is 2+2?'

    Args:
        message: an OpenAI-format chat message dict, or an openai `Choice`.

    Returns:
        the text, without a trailing newline.
    """
    data: dict[str, Any] = choice_to_message(message) if isinstance(message, Choice) else message
    role = str(data.get("role") or "unknown").capitalize()
    content = _content_text(data.get("content"))
    calls = [_call_text(call) for call in data.get("tool_calls") or []]
    calls = [call for call in calls if call is not None]
    body = "\n".join(([content] if content else []) + calls)
    return f"{role}:\n{body}"


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, {"type": "image_url", ...}]
        parts = [p if isinstance(p, dict) else p.model_dump() if isinstance(p, BaseModel) else {"text": str(p)}
                 for p in content]
        return "\n".join(str(p["text"]) if "text" in p else f"[{p.get('type', 'part')}]" for p in parts)
    return str(content)


def _call_text(call: Any) -> str | None:
    """`name(arguments)` of an OpenAI tool call (a dict or the SDK's object); None for another kind."""
    if isinstance(call, BaseModel):
        call = call.model_dump()
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return None
    return f"{function.get('name', '')}({function.get('arguments', '')})"
