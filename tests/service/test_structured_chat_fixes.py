"""Regression tests of the chat surface: OpenAI's `logprobs.content` covers exactly the returned
content's tokens (not the stop token, tokens past a stop string or a tool call's tokens), streamed
or not, while `token_ids`/`sampled_logprobs` keep every sampled token for training; and a NaN
logprob never puts invalid JSON into a stream."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math

import pytest

from tempering.engine import Completion
from tempering.service.chat_stream import StreamState, sse_chat_stream

ADD = [{"role": "user", "content": "What is 2+3? Answer with just the number."}]
COUNT = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]


@pytest.fixture(scope="module")
def served(serve_default_model):
    with serve_default_model("chat-fixes") as served:
        yield served


def _text_of(entries) -> str:
    return b"".join(bytes(e.bytes) for e in entries).decode()


async def _streamed_entries(client, **kwargs):
    stream = await client.chat.completions.create(stream=True, **kwargs)
    content, entries, ids = {}, {}, {}
    async for chunk in stream:
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            entries[c.index] = entries.get(c.index, []) + list((c.logprobs.content or []) if c.logprobs else [])
            ids[c.index] = ids.get(c.index, []) + (getattr(c, "token_ids", None) or [])
    return content, entries, ids


@pytest.mark.parametrize("messages, stop", [(ADD, None), (COUNT, [" 4"])], ids=["eos", "stop-string"])
def test_chat_logprobs_content_covers_exactly_the_content_tokens_streamed_or_not(served, messages, stop):
    model, _, loop = served
    client = model.openai_client()
    kwargs = dict(model=model.name, messages=messages, max_tokens=40, temperature=0, logprobs=True, top_logprobs=2,
                  stop=stop, n=2)

    async def go():
        await client.chat.completions.create(**{**kwargs, "max_tokens": 1, "n": 1})  # the prompt's blocks cached first
        return await client.chat.completions.create(**kwargs), await _streamed_entries(client, **kwargs)

    full, (content, entries, ids) = loop.run_until_complete(go())
    for i, choice in enumerate(full.choices):
        assert choice.finish_reason == "stop"
        got = choice.logprobs.content
        assert _text_of(got) == choice.message.content  # no <|im_end|>, nothing past the stop string
        assert len(got) < len(choice.token_ids)  # the stop token (or the stop string's token) is not content
        # training still gets every sampled token and its logprob
        assert len(choice.sampled_logprobs) == len(choice.token_ids)
        assert [e.logprob for e in got] == choice.sampled_logprobs[: len(got)]
        # streamed: the same entries, also concatenating to the content
        assert ids[i] == choice.token_ids and content[i] == choice.message.content
        assert [e.token for e in entries[i]] == [e.token for e in got]
        assert [e.logprob for e in entries[i]] == pytest.approx([e.logprob for e in got], abs=1e-4)


def test_a_tool_calls_tokens_are_not_logprobs_content(served):
    pytest.importorskip("llguidance")
    model, _, loop = served
    tools = [{"type": "function", "function": {"name": "get_time", "description": "The time.",
                                               "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]
    kwargs = dict(model=model.name, messages=[{"role": "user", "content": "What time is it?"}], tools=tools,
                  tool_choice="required", max_tokens=40, temperature=0, logprobs=True)
    client = model.openai_client()

    async def go():
        return await client.chat.completions.create(**kwargs), await _streamed_entries(client, **kwargs)

    full, (_, entries, _) = loop.run_until_complete(go())
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.logprobs.content == [] and entries[0] == []
    assert len(choice.sampled_logprobs) == len(choice.token_ids) > 0


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_nan_logprob_never_puts_invalid_json_into_the_stream():
    async def go():
        future = concurrent.futures.Future()
        future.set_result([Completion(token_ids=[5, 6], logprobs=[-0.5, math.nan], top_logprobs=[[], []], text="ab",
                                      finish_reason="stop", logprob_temperature=1.0, policy_versions=[0, 0])])
        queue = asyncio.Queue()
        for item in ((0, 5, -0.5, []), (0, 6, math.nan, []), None):
            queue.put_nowait(item)
        state = StreamState(lambda ids: "ab"[: len(ids)], prefix=None, tools_on=False, stop=[])
        events = sse_chat_stream(started=(future, queue), abort=lambda f: None, model="m", prompt_ids=[1], n=1,
                                 states=[state], token_entry=None,
                                 finish=lambda i, c: {"message": {"role": "assistant", "content": c.text},
                                                      "finish_reason": c.finish_reason},
                                 include_usage=True)
        return [e async for e in events]

    events = asyncio.run(go())
    payloads = [e.removeprefix("data: ").strip() for e in events]
    assert payloads[-1] == "[DONE]"
    parsed = [_strict_json(p) for p in payloads[:-1]]  # every event is valid JSON
    assert "non-finite" in parsed[-1]["error"]["message"]  # and the stream says why it ended
