"""Regression tests of the chat surface: OpenAI's `logprobs.content` covers exactly the returned
content's tokens (not the stop token, tokens past a stop string or a tool call's tokens), streamed
or not, while `token_ids`/`sampled_logprobs` keep every sampled token for training; a NaN
logprob never puts invalid JSON into a stream; a tool call cut by max_tokens is "length" and plain
content, never a finished call; and a guided choice comes back whole, even one holding a stop
string."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math

import pytest

from tempering.chat import ChatRenderer
from tempering.chat.tools import forced_prefix, parse_tool_calls
from tempering.engine import Completion
from tempering.engine.stopping import completion_of, finish_reason_of
from tempering.service.chat_stream import StreamState, sse_chat_stream
from tempering.service.openai_routes import _params
from tempering.service.schemas import ChatCompletionRequest, CompletionRequest
from tempering.service.structured import compile_checked, request_spec

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


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    pytest.importorskip("llguidance")
    from tempering.engine.grammar import GrammarCompiler

    return GrammarCompiler(tokenizer, stop_token_ids=ChatRenderer(tokenizer).stop_token_ids, vocab_size=len(tokenizer))


NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
GET_TIME = {"type": "function", "function": {"name": "get_time", "parameters": NO_ARGUMENTS}}
NAMED = {"type": "function", "function": {"name": "get_time"}}


def _stream_events(tokenizer, completion, *, prefix, stop, finish):
    """The parsed chunks of `completion` streamed token by token, as the route streams it."""
    async def go():
        future = concurrent.futures.Future()
        future.set_result([completion])
        queue = asyncio.Queue()
        for t, lp in zip(completion.token_ids, completion.logprobs):
            queue.put_nowait((0, t, lp, []))
        queue.put_nowait(None)
        state = StreamState(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), prefix=prefix,
                            tools_on=True, stop=stop)
        events = sse_chat_stream(started=(future, queue), abort=lambda f: None, model="m", prompt_ids=[1], n=1,
                                 states=[state], token_entry=None, finish=lambda i, c: finish(c), include_usage=False)
        return [e async for e in events]

    events = asyncio.run(go())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def _sampled(tokenizer, text, finish_reason):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Completion(token_ids=ids, logprobs=[-0.1] * len(ids), top_logprobs=[[] for _ in ids],
                      text=tokenizer.decode(ids, skip_special_tokens=True), finish_reason=finish_reason,
                      logprob_temperature=1.0, policy_versions=[0] * len(ids))


@pytest.mark.parametrize("tool_choice, sampled", [
    ("auto", 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'),
    (NAMED, "{}}\n"),  # after the forced prefix '<tool_call>\n{"name": "get_time", "arguments": '
], ids=["auto", "named"])
def test_a_tool_call_whose_json_is_whole_but_that_max_tokens_cut_is_length_and_plain_content_streamed_or_not(
        tokenizer, tool_choice, sampled):
    from tempering.service.openai_routes import _chat_choice

    prefix = forced_prefix(tool_choice)
    whole = (prefix or "") + sampled
    [_] = parse_tool_calls(whole, allowed={"get_time"})[1]  # the JSON alone would parse as a call

    def finish(c):
        return _chat_choice(c, prefix=prefix, tool_names={"get_time"})

    # ended by the `</tool_call>` stop string (cut from the text): a finished call
    done = finish(_sampled(tokenizer, sampled, "stop"))
    assert done["finish_reason"] == "tool_calls" and done["message"]["tool_calls"][0]["function"]["name"] == "get_time"

    cut = _sampled(tokenizer, sampled, "length")  # max_tokens ran out before `</tool_call>` and the end of turn
    final = finish(cut)
    assert final["finish_reason"] == "length"
    assert "tool_calls" not in final["message"] and final["message"]["content"] == whole

    chunks = _stream_events(tokenizer, cut, prefix=prefix, stop=["</tool_call>"], finish=finish)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any("tool_calls" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


@pytest.mark.parametrize("request_type, constraint", [
    (ChatCompletionRequest, {"guided_choice": ["nonstop", "full stop"]}),
    (CompletionRequest, {"structured_outputs": {"choice": ["nonstop", "full stop"]}}),
], ids=["chat-guided_choice", "completions-structured_outputs"])
@pytest.mark.parametrize("chosen", ["nonstop", "full stop"])
def test_a_guided_choice_that_holds_a_stop_string_or_token_is_returned_whole(tokenizer, grammars, request_type, constraint,
                                                                    chosen):
    is_chat = request_type is ChatCompletionRequest
    where = {"messages": [{"role": "user", "content": "Pick."}]} if is_chat else {"prompt": "Pick:"}
    choice_ids = tokenizer(chosen, add_special_tokens=False)["input_ids"]
    # a stop string and a stop token id inside the option
    body = request_type(model="m", stop=["stop", "xyz"], stop_token_ids=[choice_ids[-1]], **where, **constraint)
    stop_ids = grammars.stop_token_ids
    grammar = compile_checked(grammars, request_spec(body))
    params = _params(body, 16, 100, 0, grammar)
    # the engine's stop checks, token by token, on the chosen option and the end of turn the grammar then allows
    ids = choice_ids + [stop_ids[0]]
    k = next(k for k in range(1, len(ids) + 1) if finish_reason_of(ids[:k], params, 16, stop_ids, tokenizer))
    assert k == len(ids)  # not ended inside the choice
    completion = completion_of(ids[:k], [0.0] * k, [[] for _ in range(k)], "stop", params, tokenizer)
    assert completion.text == chosen and completion.raw_text is None
    # streamed: nothing of the choice is held back as the start of a stop string
    state = StreamState(lambda t: tokenizer.decode(t, skip_special_tokens=True), prefix=None, tools_on=False,
                        stop=params.stop)
    assert "".join(state.push(t) for t in ids) == chosen
    # other constraints keep the request's stop strings
    regex = request_type(model="m", stop=["stop"], stop_token_ids=[choice_ids[-1]], guided_regex="[a-z ]+", **where)
    regex_params = _params(regex, 16, 100, 0, compile_checked(grammars, request_spec(regex)))
    assert regex_params.stop == ["stop"] and regex_params.stop_token_ids == [choice_ids[-1]]
    # with tools the model may call, a call's end is a stop string, except beside a choice (no call can be sampled)
    assert _params(body, 16, 100, 0, grammar, tools_on=True).stop == []
    assert _params(regex, 16, 100, 0, compile_checked(grammars, request_spec(regex)), tools_on=True).stop == [
        "stop", "</tool_call>"]


async def _streamed_choice(client, **kwargs):
    """(content, tool call deltas, finish reason) of a streamed request's only choice."""
    stream = await client.chat.completions.create(stream=True, **kwargs)
    content, calls, reason = "", [], None
    async for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            reason = c.finish_reason or reason
    return content, calls, reason


def test_a_named_tool_call_cut_after_its_json_ends_with_length_through_the_server(served):
    pytest.importorskip("llguidance")
    model, backend, loop = served
    client = model.openai_client()
    tokenizer = backend._registry.get(model.name).tokenizer
    kwargs = {"model": model.name, "messages": [{"role": "user", "content": "What time is it?"}], "tools": [GET_TIME],
              "tool_choice": NAMED, "temperature": 0}
    prefix = forced_prefix(NAMED)

    async def go(max_tokens):
        return (await client.chat.completions.create(max_tokens=max_tokens, **kwargs),
                await _streamed_choice(client, max_tokens=max_tokens, **kwargs))

    full, _ = loop.run_until_complete(go(40))
    ids = full.choices[0].token_ids
    assert full.choices[0].finish_reason == "tool_calls"
    # the fewest tokens whose text is the whole call but its `</tool_call>`
    k = next(k for k in range(1, len(ids) + 1) if parse_tool_calls(prefix + tokenizer.decode(ids[:k]))[1])
    assert "</tool_call>" not in tokenizer.decode(ids[:k]) and k < len(ids)
    cut, (content, calls, reason) = loop.run_until_complete(go(k))
    choice = cut.choices[0]
    assert choice.token_ids == ids[:k]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content == prefix + tokenizer.decode(ids[:k])
    assert (content, calls, reason) == (choice.message.content, [], "length")


def test_a_guided_choice_holding_a_stop_string_comes_back_whole_through_the_server(served):
    pytest.importorskip("llguidance")
    model, _, loop = served
    client = model.openai_client()
    options = ["nonstop", "full stop"]
    kwargs = {"model": model.name, "messages": [{"role": "user", "content": "Pick one."}], "stop": ["stop"],
              "max_tokens": 8, "temperature": 1.0, "seed": 3, "extra_body": {"guided_choice": options}}

    async def go():
        return (await client.chat.completions.create(n=4, **kwargs), await _streamed_choice(client, **kwargs),
                await client.completions.create(model=model.name, prompt="Pick one:", stop=["stop"], max_tokens=8,
                                                n=4, temperature=1.0, seed=3, extra_body={"guided_choice": options}))

    chat, (content, _, reason), text = loop.run_until_complete(go())
    assert all(c.message.content in options and c.finish_reason == "stop" for c in chat.choices)
    assert content in options and reason == "stop"
    assert all(c.text in options and c.finish_reason == "stop" for c in text.choices)
