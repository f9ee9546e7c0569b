"""Tools, multi-turn exact tokens and streaming through the server, with the real openai client."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

import tempering as art
from tempering.training.tokenize import tokenize_trajectory


def tool(name):
    return {"type": "function", "function": {"name": name, "description": "The current time.", "parameters": {"type": "object", "properties": {}}}}


TOOLS = [tool("time"), tool("get_time"), tool("clock")]
SYSTEM = 'When asked for the time, call get_time like this:\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(serve_default_model):
    with serve_default_model("tools-test") as served:
        yield served


def run(served, coro):
    return served[2].run_until_complete(coro)


def test_a_three_turn_tool_conversation_trains_on_exactly_the_sampled_tokens(served):
    model, backend, _ = served
    client = model.openai_client()

    async def conversation():
        traj = art.Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": "What time is it?"}], tools=TOOLS)
        first = await client.chat.completions.create(model=model.name, messages=traj.messages(), tools=TOOLS,
                                                     tool_choice="required", max_tokens=40, temperature=1.0, n=32, seed=5)
        call_choice = next(c for c in first.choices if c.message.tool_calls)  # the model gets the format right often enough
        assert call_choice.finish_reason == "tool_calls"
        traj.messages_and_choices.append(call_choice)
        call = call_choice.message.tool_calls[0]
        assert call.function.name in {"time", "get_time", "clock"} and isinstance(json.loads(call.function.arguments), dict)
        traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": "12:30"})
        second = await client.chat.completions.create(model=model.name, messages=traj.messages(), tools=TOOLS,
                                                      max_tokens=16, temperature=0.7, seed=1)
        traj.messages_and_choices.append(second.choices[0])
        traj.messages_and_choices.append({"role": "user", "content": "Thanks! And the date?"})
        third = await client.chat.completions.create(model=model.name, messages=traj.messages(), tools=TOOLS,
                                                     tool_choice="none", max_tokens=16, temperature=0.7, seed=2)
        traj.messages_and_choices.append(third.choices[0])
        # the re-sent conversation came from the prefix cache: all of it but the last, partial KV block (16 tokens)
        previous = first.usage.prompt_tokens + len(call_choice.token_ids)
        assert previous - 16 <= second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens
        return traj

    traj = run(served, conversation())
    choices = [m for m in traj.messages_and_choices if isinstance(m, art.types.Choice)]
    service = backend._registry.get(model.name)
    [seq] = tokenize_trajectory(traj, service.renderer, max_seq_len=service.max_seq_len)  # one sequence: turns merged
    trained = [t for t, m in zip(seq.token_ids, seq.loss_mask) if m]
    assert trained == [t for c in choices for t in c.token_ids]  # exactly the sampled ids, nothing else
    assert [lp for lp, m in zip(seq.sampled_logprobs, seq.loss_mask) if m] == [lp for c in choices for lp in c.sampled_logprobs]
    for earlier, later in zip(choices, choices[1:]):  # each prompt extends the exact ids of the turn before
        head = earlier.prompt_token_ids + earlier.token_ids
        assert later.prompt_token_ids[: len(head)] == head


def test_tool_choice_none_keeps_the_prompt_but_calls_nothing_and_a_named_function_starts_the_call(served):
    model, _, _ = served
    client = model.openai_client()
    messages = [{"role": "user", "content": "What time is it?"}]

    async def go():
        plain = await client.chat.completions.create(model=model.name, messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
        none = await client.chat.completions.create(model=model.name, messages=messages, tools=TOOLS, tool_choice="none",
                                                    max_tokens=4, temperature=0)
        named = await client.chat.completions.create(model=model.name, messages=messages, tools=TOOLS, max_tokens=12,
                                                     tool_choice={"type": "function", "function": {"name": "clock"}}, temperature=0)
        return plain.choices[0], none.choices[0], named.choices[0]

    plain, none, named = run(served, go())
    assert none.prompt_token_ids == plain.prompt_token_ids and not none.message.tool_calls  # same prompt as "auto"
    tokenizer = served[1]._registry.get(model.name).tokenizer
    assert tokenizer.decode(named.prompt_token_ids).endswith('<|im_start|>assistant\n<tool_call>\n{"name": "clock", "arguments": ')
    if named.message.tool_calls:
        assert named.message.tool_calls[0].function.name == "clock"
    else:  # a malformed call is returned as text, with the forced start included
        assert named.message.content.startswith('<tool_call>\n{"name": "clock", "arguments": ')


def test_bad_tool_requests_are_400(served):
    model, _, _ = served
    url, headers = f"{model.inference_base_url}/chat/completions", {"Authorization": f"Bearer {model.inference_api_key}"}
    base = {"model": model.name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for extra in ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                  {"tool_choice": "required"},
                  {"tools": [{"type": "function"}]},
                  {"tools": TOOLS, "tool_choice": "sometimes"}):
        response = httpx.post(url, json={**base, **extra}, headers=headers, timeout=30)
        assert response.status_code == 400, (extra, response.text)


@dataclass
class Streamed:
    """What a streamed chat completion sent, per choice index."""

    content: dict = field(default_factory=dict)
    ids: dict = field(default_factory=dict)
    sampled_logprobs: dict = field(default_factory=dict)
    logprob_entries: dict = field(default_factory=dict)  # OpenAI's logprobs.content[i].logprob
    calls: dict = field(default_factory=dict)
    finish: dict = field(default_factory=dict)
    usage: Any = None


async def _stream(client, **kwargs) -> Streamed:
    stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    out = Streamed()
    async for chunk in stream:
        out.usage = chunk.usage or out.usage
        for c in chunk.choices:
            i = c.index
            out.content[i] = out.content.get(i, "") + (c.delta.content or "")
            out.ids[i] = out.ids.get(i, []) + (getattr(c, "token_ids", None) or [])
            out.sampled_logprobs[i] = out.sampled_logprobs.get(i, []) + (getattr(c, "sampled_logprobs", None) or [])
            out.logprob_entries[i] = out.logprob_entries.get(i, []) + [x.logprob for x in (c.logprobs.content if c.logprobs else [])]
            for call in c.delta.tool_calls or []:
                out.calls.setdefault(i, []).append((call.function.name, call.function.arguments))
            if c.finish_reason:
                out.finish[i] = c.finish_reason
    return out


def test_streaming_matches_non_streaming_for_the_same_seed(served):
    model, _, _ = served
    client = model.openai_client()
    kwargs = dict(model=model.name, messages=[{"role": "user", "content": "Tell me a short story."}], max_tokens=24,
                  temperature=1.0, seed=11, n=2, stop=["\n\n"])

    async def go():
        # the prompt's KV blocks cached first, so both requests below prefill the same uncached
        # suffix: a prefill over the whole prompt rounds differently (logprobs ~1e-6 apart)
        await client.chat.completions.create(**{**kwargs, "max_tokens": 1})
        return await _stream(client, **kwargs), await client.chat.completions.create(**kwargs)

    streamed, full = run(served, go())
    for i, choice in enumerate(full.choices):
        assert streamed.content[i] == (choice.message.content or "")
        assert streamed.ids[i] == choice.token_ids
        assert streamed.sampled_logprobs[i] == choice.sampled_logprobs
        assert streamed.logprob_entries[i] == []  # OpenAI's logprobs objects only when asked for
        assert streamed.finish[i] == choice.finish_reason
    assert streamed.usage.completion_tokens == sum(len(c.token_ids) for c in full.choices)
    asked = run(served, _stream(client, **kwargs, logprobs=True))
    # OpenAI's entries cover the content's tokens (not the stop token or the stop string's), sampled_logprobs all
    assert all(asked.logprob_entries[i] == asked.sampled_logprobs[i][: len(asked.logprob_entries[i])]
               and len(asked.ids[i]) == len(asked.sampled_logprobs[i]) for i in asked.ids)


def test_streamed_tool_calls_match_non_streaming(served):
    model, _, _ = served
    client = model.openai_client()
    kwargs = dict(model=model.name, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What time is it?"}],
                  tools=TOOLS, tool_choice="required", max_tokens=40, temperature=1.0, seed=5, n=8)

    async def go():
        # the prompt's KV blocks cached first, so both requests below prefill the same uncached
        # suffix: a prefill over the whole prompt rounds differently (logprobs ~1e-6 apart)
        await client.chat.completions.create(**{**kwargs, "max_tokens": 1})
        return await _stream(client, **kwargs), await client.chat.completions.create(**kwargs)

    streamed, full = run(served, go())
    assert any(c.message.tool_calls for c in full.choices)
    for i, choice in enumerate(full.choices):
        assert streamed.ids[i] == choice.token_ids and streamed.finish[i] == choice.finish_reason
        expected = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
        assert streamed.calls.get(i, []) == expected
        assert streamed.content[i] == (choice.message.content or "")


def test_a_client_that_disconnects_stops_its_generation(served):
    """A streamed request whose client closes the connection, and a plain one whose client times
    out, are aborted on the engine (their samples stop and free their blocks) instead of running to
    max_tokens; the server goes on serving."""
    import time

    model, backend, _ = served
    engine = backend.hub.service(model.name).engine
    client = model.openai_client()
    body = {"model": model.name, "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 3000, "ignore_eos": True, "temperature": 1.0}

    async def idle_within(seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not engine._pending and not engine.scheduler.has_work:
                return True
            await asyncio.sleep(0.05)
        return False

    async def go():
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=60,
                                     headers={"Authorization": f"Bearer {client.api_key}"}) as http:
            before = engine.stats.num_decode_tokens
            async with http.stream("POST", "chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                for _ in range(6):
                    await anext(lines)
            assert await idle_within(15)
            assert engine.stats.num_decode_tokens - before < 1000
            before = engine.stats.num_decode_tokens
            with pytest.raises(httpx.TimeoutException):
                await http.post("chat/completions", json={**body, "n": 2}, timeout=1.0)
            assert await idle_within(15)
            assert engine.stats.num_decode_tokens - before < 2000
            ok = await http.post("chat/completions", json={**body, "max_tokens": 4})
            assert ok.status_code == 200

    run(served, go())
