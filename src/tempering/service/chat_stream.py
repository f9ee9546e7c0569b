"""Chat completions as OpenAI server-sent events (`stream=true`).

Tokens arrive from the engine's thread one by one. Text is sent as soon as it is certain: held
back while it ends in a partial UTF-8 character, in what could be the start of a stop string,
or, when tools are on, in whitespace (the content before a call loses its trailing whitespace)
and from the first `<tool_call>` on (a call is sent as a whole `tool_calls` delta when the
sample ends, or as plain text if it does not parse). The deltas of a choice
concatenate to exactly the content of the same request without streaming, and every chunk
carries its new `token_ids` and their `sampled_logprobs`; the last chunk of a choice carries the
`policy_versions` of all its tokens. OpenAI's `logprobs` entries (when the request asked for them)
cover the content tokens only (`num_content_tokens`): an entry is sent with the chunk whose text
its token completes, so they too concatenate to the non-streamed ones.

A chunk that would hold a non-finite float (a NaN logprob: the model's logits were not finite) is
not valid JSON: the stream ends with an error event instead, as the same request without
streaming gets a 500.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..chat.tools import TOOL_CALL_START
from ..engine import Completion

__all__ = ["StreamState", "num_content_tokens", "sse_chat_stream", "start_stream", "usage"]


def num_content_tokens(decode: Callable[[list[int]], str], ids: list[int], prefix: str | None, content: str | None) -> int:
    """How many leading tokens of `ids` OpenAI's `logprobs.content` covers: the fewest whose text
    (after the forced `prefix`) holds all of `content`. The stop token, tokens sampled past a stop
    string and a tool call's tokens are left out; `token_ids` and `sampled_logprobs` keep every
    sampled token (training reads those). All of `ids` if `content` is not a prefix of their text."""
    if not content:
        return 0
    prefix = prefix or ""
    k = len(ids)
    while k > 0 and (prefix + decode(ids[: k - 1])).startswith(content):
        k -= 1
    return k


def _held_back(text: str, patterns: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `patterns`."""
    longest = 0
    for p in patterns:
        for n in range(min(len(p) - 1, len(text)), 0, -1):
            if text.endswith(p[:n]):
                longest = max(longest, n)
                break
    return longest


class StreamState:
    """What one choice has streamed so far.

    Args:
        decode: token ids → text without special tokens.
        prefix: text the assistant turn was forced to start with (a tool call), or None.
        tools_on: whether tool calls are parsed (trailing whitespace and text from `<tool_call>`
            on are held back: `parse_tool_calls` drops the whitespace before a call).
        stop: the request's stop strings.
    """

    def __init__(self, decode: Callable[[list[int]], str], *, prefix: str | None, tools_on: bool, stop: list[str]) -> None:
        self.decode = decode
        self.prefix = prefix or ""
        self.tools_on = tools_on
        self.stop = stop
        self.ids: list[int] = []
        self.emitted = ""
        self.sampled: list[tuple[float, list]] = []  # (logprob, top logprobs) per token, kept when logprobs are sent
        self.num_entries_sent = 0  # OpenAI logprobs entries sent: the fewest tokens whose text holds `emitted`

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that can be sent now (possibly empty)."""
        self.ids.append(token_id)
        text = self.prefix + self.decode(self.ids)
        end = len(text)
        if text.endswith("\ufffd"):  # a character split across tokens
            return ""
        for s in self.stop:
            i = text.find(s)
            if i >= 0:
                end = min(end, i)
        if self.tools_on:
            i = text.find(TOOL_CALL_START)
            if i >= 0:
                end = min(end, i)
        patterns = self.stop + ([TOOL_CALL_START] if self.tools_on else [])
        if end == len(text):
            end -= _held_back(text, patterns)
        safe = text[:end].rstrip() if self.tools_on else text[:end]
        if not safe.startswith(self.emitted):
            return ""
        delta, self.emitted = safe[len(self.emitted):], safe
        return delta

    def entries_due(self) -> range:
        """Indices of the tokens whose logprobs entries can be sent now (those `emitted` needs)."""
        start = k = self.num_entries_sent
        while k < len(self.ids) and not (self.prefix + self.decode(self.ids[:k])).startswith(self.emitted):
            k += 1
        self.num_entries_sent = k
        return range(start, k)

    def rest(self, final_content: str | None) -> str:
        """What remains to send of the final content (empty when it does not extend what was sent)."""
        final_content = final_content or ""
        return final_content[len(self.emitted):] if final_content.startswith(self.emitted) else ""


def start_stream(submit: Callable[..., Any]) -> tuple[Any, asyncio.Queue]:
    """Queue a streamed request now, in the route (call it on the event loop): a request the
    engine refuses (a prompt too long for the KV cache, a closed engine) raises here and gets its
    HTTP error, instead of cutting a stream whose 200 was already sent.

    Args:
        submit: `submit(on_token)` queues the request and returns its concurrent Future.

    Returns:
        (the Future, the queue of its tokens, then None once it is done), for `sse_chat_stream`.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def on_token(index: int, token_id: int, logprob: float, top: list) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (index, token_id, logprob, top))

    future = submit(on_token)
    future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
    return future, queue


def usage(num_prompt: int, results: list[Completion]) -> dict[str, Any]:
    """OpenAI's `usage` of a request: token counts, and `prompt_tokens_details.cached_tokens`, the prompt
    tokens served from the prefix cache (its first sample's, as vLLM reports them)."""
    num_completion = sum(len(c.token_ids) for c in results)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion, "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": results[0].num_cached_tokens if results else 0}}


async def sse_chat_stream(
    *,
    started: tuple[Any, asyncio.Queue],
    abort: Callable[[Any], None],
    model: str,
    prompt_ids: list[int],
    n: int,
    states: list[StreamState],
    token_entry: Callable[[int, float, list], dict[str, Any]] | None,
    finish: Callable[[int, Completion], dict[str, Any]],
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events of one streamed chat completion.

    Args:
        started: `start_stream`'s (future, queue) of the request.
        abort: `abort(future)` stops the generation; called when the stream ends early (the
            client disconnected: Starlette cancels the stream's task).
        states: one StreamState per choice.
        token_entry: (token id, logprob, top logprobs) → a logprobs `content` entry; None when
            the request did not ask for logprobs (`logprobs` is then null in every chunk).
        finish: (choice index, Completion) → the choice's final message dict (content and tool
            calls, as without streaming) and finish reason: {"message": ..., "finish_reason": ...},
            with "grammar_forced" for a constrained choice and "routed_experts" when asked for
            (sent in its last chunk).
    """
    future, queue = started
    try:
        chunk_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def event(choices: list[dict[str, Any]], **extra: Any) -> str:
            data = {"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices, **extra}
            return f"data: {json.dumps(data, allow_nan=False)}\n\n"  # ValueError for NaN/inf: not JSON

        yield event([
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
             "prompt_token_ids": prompt_ids}
            for i in range(n)
        ])

        def failed(message: str) -> str:
            return f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n"

        while (item := await queue.get()) is not None:
            i, token_id, logprob, top = item
            state = states[i]
            text = state.push(token_id)
            logprobs = None
            if token_entry is not None:
                state.sampled.append((logprob, top))
                logprobs = {"content": [token_entry(state.ids[t], *state.sampled[t]) for t in state.entries_due()]}
            try:
                chunk = event([{
                    "index": i, "delta": {"content": text} if text else {}, "finish_reason": None,
                    "logprobs": logprobs, "token_ids": [token_id], "sampled_logprobs": [logprob],
                }])
            except ValueError as exc:  # a NaN logprob: end the stream as the engine's failure would
                yield failed(f"the sample holds a non-finite logprob (the model's logits are not finite): {exc}")
                yield "data: [DONE]\n\n"
                return
            yield chunk
        try:
            completions = future.result()
        except Exception as exc:  # the engine failed: tell the client in the stream, then end it
            yield failed(str(exc))
            yield "data: [DONE]\n\n"
            return
        for i, completion in enumerate(completions):
            final = finish(i, completion)
            message = final["message"]
            state = states[i]
            delta: dict[str, Any] = {}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            rest = state.rest(message.get("content"))
            if rest:
                delta["content"] = rest
            logprobs = None
            if token_entry is not None:  # the entries of the content's last tokens, held back with their text
                end = num_content_tokens(state.decode, completion.token_ids, state.prefix, message.get("content"))
                logprobs = {"content": [token_entry(completion.token_ids[t], completion.logprobs[t], completion.top_logprobs[t])
                                        for t in range(state.num_entries_sent, end)]}
            extra = {k: final[k] for k in ("grammar_forced", "routed_experts") if k in final}
            yield event([{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": final["finish_reason"],
                          "logprob_temperature": completion.logprob_temperature,
                          "policy_versions": completion.policy_versions, **extra}])
        if include_usage:
            yield event([], usage=usage(len(prompt_ids), completions))
        yield "data: [DONE]\n\n"
    finally:  # the client left (Starlette cancelled this stream) or the stream is done
        if not future.done():
            abort(future)
