"""Automatic trajectory capture (ART's `auto_trajectory` / `capture_auto_trajectory`).

Inside `await capture_auto_trajectory(rollout(...))`, every chat completion made through a
capturing client (`model.openai_client()`, `capture_client(client)`, LangChain models from
`tempering.langgraph.init_chat_model`) is recorded into one `Trajectory`, streamed or not:

- a request whose messages extend a conversation already recorded (the earlier messages equal,
  each recorded `Choice` standing for the assistant message it produced) continues that
  conversation: its new messages are appended, then its first choice;
- any other request starts a conversation of its own in `trajectory.additional_histories`
  (a sub-agent, a summarizer call, a second sample of the same prompt); the first one recorded
  is the trajectory's main conversation.

Messages are compared as the model sees them: role, text, tool calls (name and arguments, the
arguments as parsed JSON) and tool_call_id; so a framework that re-serializes an assistant turn
(None for "", `{"a": 1}` for `{"a":1}`) still extends its conversation. Each recorded choice is
the server's own, with token ids and logprobs, ready to train on. Only the first choice of an
`n > 1` request is recorded, as in ART.

Scopes nest: a call is recorded in the innermost one only. Concurrent calls within one scope are
recorded in the order their responses close.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

from ..errors import TrajectoryError
from ..types import History, Trajectory
from .transport import Exchange, listen

__all__ = ["CaptureScope", "NoCaptureError", "auto_trajectory", "capture_auto_trajectory", "capture_scope", "record_exchange"]


class NoCaptureError(TrajectoryError, RuntimeError):
    """`auto_trajectory(required=True)` outside a capture (a RuntimeError, as ART raises there)."""


_current: contextvars.ContextVar[CaptureScope | None] = contextvars.ContextVar("tempering_auto_trajectory", default=None)


class CaptureScope:
    """The trajectory that one `capture_scope()` block records into, and how many calls it holds."""

    def __init__(self, trajectory: Trajectory | None = None) -> None:
        self.trajectory = trajectory if trajectory is not None else Trajectory(messages_and_choices=[])
        self.num_calls = 0
        self._lock = threading.Lock()  # sync clients may record from several threads

    def on_request(self, request: dict[str, Any]) -> bool:
        return _current.get() is self  # False: an inner scope is current, and records the call

    def on_response(self, is_mine: bool, exchange: Exchange | None) -> None:
        if not is_mine or exchange is None:
            return
        with self._lock:
            record_exchange(self.trajectory, exchange.request, exchange.choice)
            self.num_calls += 1


@contextlib.contextmanager
def capture_scope(trajectory: Trajectory | None = None) -> Iterator[CaptureScope]:
    """Record the block's chat completions into `trajectory` (a new, empty one by default)."""
    scope = CaptureScope(trajectory)
    token = _current.set(scope)
    try:
        with listen(scope):
            yield scope
    finally:
        _current.reset(token)


def auto_trajectory(*, required: bool = False) -> Trajectory | None:
    """The trajectory being captured by the enclosing `capture_auto_trajectory` (to set its reward).

    Raises:
        NoCaptureError (a TrajectoryError and a RuntimeError): if `required` and no capture is in progress.
    """
    scope = _current.get()
    if scope is None:
        if required:
            raise NoCaptureError(
                "no trajectory is being captured here: auto_trajectory(required=True) must run inside "
                "`await art.capture_auto_trajectory(rollout(...))` (or a tempering.langgraph wrap_rollout)"
            )
        return None
    return scope.trajectory


async def capture_auto_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Run `coroutine` and return the trajectory of the chat completions it made.

    The coroutine's own return value is discarded (as in ART); set the reward with
    `art.auto_trajectory().reward = ...` inside it. `metrics["duration"]` is set on return.

    Raises:
        Exception: whatever the coroutine raises, with a note of how many calls had been captured.
    """
    with capture_scope() as scope:
        try:
            await coroutine
        except Exception as exc:
            exc.add_note(f"(raised in a captured rollout after {scope.num_calls} chat completions)")
            raise
    return scope.trajectory.finish()


def record_exchange(trajectory: Trajectory, request: dict[str, Any], choice: Any) -> None:
    """Append one request's new messages and its choice to the conversation of `trajectory` it extends."""
    messages = request["messages"]
    tools = request.get("tools") or None
    wanted = [_comparable(m) for m in messages]
    best: Trajectory | History | None = None
    best_len = -1
    for history in (trajectory, *trajectory.additional_histories):
        have = [_comparable(m) for m in history.messages()]
        extends = wanted[: len(have)] == have and (not have or _comparable_tools(history.tools) == _comparable_tools(tools))
        if extends and len(have) > best_len:
            best, best_len = history, len(have)
    if best is None:
        best, best_len = History(messages_and_choices=[]), 0
        trajectory.additional_histories.append(best)
    best.messages_and_choices.extend(messages[best_len:])
    best.messages_and_choices.append(choice)
    best.tools = tools


def _comparable(message: dict[str, Any]) -> tuple:
    role = message.get("role")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = tuple(
        (call.get("function", {}).get("name"), _canonical_json(call.get("function", {}).get("arguments")))
        for call in message.get("tool_calls") or []
    )
    return ("system" if role == "developer" else role, content or "", calls, message.get("tool_call_id"))


def _canonical_json(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True)


def _comparable_tools(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)
