"""A chat completion's response body (JSON, or server-sent events) → its first `Choice`.

The choice keeps every field the server sent besides OpenAI's: a tempering server's
`token_ids`, `sampled_logprobs`, `prompt_token_ids`, `logprob_temperature`, `policy_versions` and
`grammar_forced`, which training reads. A streamed completion is rebuilt from its chunks: content
and tool-call deltas are concatenated, per-token `logprobs.content` entries, `token_ids` and
`sampled_logprobs` are appended in order, and the other fields (sent once, in the first or the
last chunk) are kept as sent.
"""

from __future__ import annotations

import json
from typing import Any

from ..types import Choice

__all__ = ["parse_chat_completion"]

_MERGED = {"index", "delta", "logprobs", "finish_reason", "token_ids", "sampled_logprobs"}


def parse_chat_completion(body: bytes, *, is_stream: bool) -> tuple[Choice, dict[str, Any] | None] | None:
    """The first choice of a chat completion and the response's `usage`.

    Args:
        body: the decoded response body.
        is_stream: whether the body is server-sent events (`stream=true`).

    Returns:
        (choice, usage or None), or None when the body holds no finished first choice (an
        error, a stream the client stopped reading before its end, a body of another API).
    """
    try:
        if is_stream:
            return _from_events(_sse_events(body))
        payload = json.loads(body)
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not choices or not isinstance(choices[0], dict) or "message" not in choices[0]:
            return None
        return Choice.model_validate(choices[0]), payload.get("usage")
    except ValueError:  # broken JSON, or a choice that does not validate (pydantic's error is a ValueError)
        return None


def _sse_events(body: bytes) -> list[dict[str, Any]]:
    events = []
    # SSE ends lines with CRLF, LF or CR only: str.splitlines() would also split a JSON string at the
    # U+2028, U+2029 or U+0085 that a server writing raw UTF-8 (vLLM) leaves in the text
    for line in body.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data and data != "[DONE]":
            events.append(json.loads(data))
    return events


def _from_events(events: list[dict[str, Any]]) -> tuple[Choice, dict[str, Any] | None] | None:
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    logprobs: list[dict[str, Any]] = []
    token_ids: list[int] = []
    sampled_logprobs: list[float] = []
    extra: dict[str, Any] = {}
    finish_reason = None
    usage = None
    saw_token_ids = False
    for event in events:
        if "error" in event:
            return None
        usage = event.get("usage") or usage
        for c in event.get("choices") or []:
            if c.get("index", 0) != 0:
                continue
            delta = c.get("delta") or {}
            if delta.get("content"):
                content.append(delta["content"])
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call.get("index", len(calls)),
                                        {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                slot["id"] = call.get("id") or slot["id"]
                function = call.get("function") or {}
                slot["function"]["name"] += function.get("name") or ""
                slot["function"]["arguments"] += function.get("arguments") or ""
            if (c.get("logprobs") or {}).get("content"):
                logprobs += c["logprobs"]["content"]
            if c.get("token_ids") is not None:
                saw_token_ids = True
                token_ids += c["token_ids"]
            sampled_logprobs += c.get("sampled_logprobs") or []
            finish_reason = c.get("finish_reason") or finish_reason
            extra.update({k: v for k, v in c.items() if k not in _MERGED and v is not None})
    if finish_reason is None:  # the stream did not finish (or held no first choice)
        return None
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    choice: dict[str, Any] = {**extra, "index": 0, "message": message, "finish_reason": finish_reason,
                              "logprobs": {"content": logprobs} if logprobs else None}
    if saw_token_ids:
        choice["token_ids"] = token_ids
    if sampled_logprobs:
        choice["sampled_logprobs"] = sampled_logprobs
    return Choice.model_validate(choice), usage
