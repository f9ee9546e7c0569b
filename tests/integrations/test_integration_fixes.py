"""Regression tests of the integrations (capture, langgraph, utils), against stub endpoints: no model loads."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import openai
import pytest

import tempering as art
from tempering.capture import capturing_http_client, capturing_sync_http_client
from tempering.capture.transport import httpx
from tempering.types import Choice


def _chunk(delta: dict, finish_reason: str | None, token_ids: list[int]) -> dict:
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "token_ids": token_ids}]}


def _stub_endpoint(request: httpx.Request) -> httpx.Response:
    """A chat completions endpoint that answers "reply<number of messages>" as tokens [1, 2]."""
    body = json.loads(request.content)
    text = f"reply{len(body['messages'])}"
    if body.get("stream"):
        chunks = [_chunk({"role": "assistant", "content": text[:2]}, None, [1]),
                  _chunk({"content": text[2:]}, "stop", [2])]
        events = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events.encode())
    return httpx.Response(200, json={"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop", "token_ids": [1, 2]}]})


def _choices(history) -> list[Choice]:
    return [m for m in history.messages_and_choices if isinstance(m, Choice)]


def test_a_streamed_completion_through_a_replayable_transport_is_captured_once_async_and_sync():
    # httpx's MockTransport and ASGITransport hand back streams that can be iterated again; the openai
    # SDK iterates the body a second time after [DONE] (to drain it), which once doubled the captured
    # text and token ids, so the next turn no longer extended the conversation
    async_client = openai.AsyncOpenAI(base_url="http://stub/v1", api_key="k", max_retries=0,
                                      http_client=capturing_http_client(transport=httpx.MockTransport(_stub_endpoint)))
    sync_client = openai.OpenAI(base_url="http://stub/v1", api_key="k", max_retries=0,
                                http_client=capturing_sync_http_client(transport=httpx.MockTransport(_stub_endpoint)))

    def sync_turn(messages: list[dict]) -> str:
        chunks = sync_client.chat.completions.create(model="m", messages=messages, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks)

    async def rollout() -> None:
        messages = [{"role": "user", "content": "hi"}]
        for turn in range(2):
            stream = await async_client.chat.completions.create(model="m", messages=messages, stream=True)
            text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"more {turn}"}]

            text = await asyncio.to_thread(sync_turn, list(messages))
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"again {turn}"}]

    trajectory = asyncio.run(art.capture_auto_trajectory(rollout()))
    assert trajectory.additional_histories == []
    assert [c.message.content for c in _choices(trajectory)] == ["reply1", "reply3", "reply5", "reply7"]
    assert all(c.token_ids == [1, 2] for c in _choices(trajectory))


def test_auto_trajectory_required_outside_a_capture_raises_a_runtime_error_as_arts_does():
    with pytest.raises(RuntimeError, match="capture_auto_trajectory"):
        art.auto_trajectory(required=True)
    with pytest.raises(art.TrajectoryError):
        art.auto_trajectory(required=True)


def test_a_streamed_completion_in_raw_utf8_with_a_unicode_line_separator_in_its_text_is_captured():
    # SSE lines end at CR/LF only; a server that writes raw UTF-8 JSON (vLLM does) may send U+2028 or
    # U+0085 inside a string, where str.splitlines() once cut the event and the call went unrecorded
    text = "line\u2028next\x85end"

    def endpoint(request: httpx.Request) -> httpx.Response:
        chunks = [_chunk({"role": "assistant", "content": text}, None, [7]), _chunk({}, "stop", [8])]
        events = "".join(f"data: {json.dumps(c, ensure_ascii=False)}\r\n\r\n" for c in chunks) + "data: [DONE]\r\n\r\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events.encode())

    client = openai.AsyncOpenAI(base_url="http://stub/v1", api_key="k", max_retries=0,
                                http_client=capturing_http_client(transport=httpx.MockTransport(endpoint)))

    async def rollout() -> None:
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                      stream=True)
        assert "".join([chunk.choices[0].delta.content or "" async for chunk in stream]) == text

    trajectory = asyncio.run(art.capture_auto_trajectory(rollout()))
    [choice] = _choices(trajectory)
    assert choice.message.content == text and choice.token_ids == [7, 8]


def test_one_limit_concurrency_decorator_holds_every_function_it_wraps_to_one_limit_as_arts_does():
    limit = art.utils.limit_concurrency(2)
    running = peak = 0

    async def work() -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1

    @limit
    async def search(query: str) -> None:
        await work()

    @limit
    async def judge(answer: str) -> None:
        await work()

    async def main() -> None:
        await asyncio.gather(*(search("q") for _ in range(3)), *(judge("a") for _ in range(3)))

    asyncio.run(main())
    assert peak == 2


class _StubServer(BaseHTTPRequestHandler):
    """A chat completions endpoint over real HTTP/1.1 that notes the client port of each request."""

    protocol_version = "HTTP/1.1"
    client_ports: ClassVar[list[int]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["content-length"]))
        self.client_ports.append(self.client_address[1])
        body = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_the_chat_models_of_many_rollouts_share_one_connection_pool():
    # ART's code calls init_chat_model() in every rollout; each call once built new HTTP clients, so
    # every LLM call opened a connection of its own (hundreds open at once for a batch of rollouts)
    pytest.importorskip("langchain_openai")
    from tempering.langgraph import init_chat_model

    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    model = art.Model(name="m", project="p", inference_base_url=f"http://127.0.0.1:{server.server_port}/v1",
                      inference_api_key="k")
    try:
        async def rollouts() -> None:
            for _ in range(24):
                assert (await init_chat_model(model).ainvoke("hi")).content == "ok"

        _StubServer.client_ports = []
        asyncio.run(rollouts())
        assert len(_StubServer.client_ports) == 24 and len(set(_StubServer.client_ports)) <= 16

        _StubServer.client_ports = []
        for _ in range(12):
            assert init_chat_model(model).invoke("hi").content == "ok"
        assert len(_StubServer.client_ports) == 12 and len(set(_StubServer.client_ports)) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_wrap_rollout_returns_the_rollouts_own_trajectory_with_a_warning_when_nothing_was_captured(caplog):
    # ART's wrap_rollout returns the rollout's trajectory as it is when its log holds no LLM call;
    # tempering once raised TrajectoryError, failing rollouts that ART code expects to come back
    pytest.importorskip("langchain_openai")
    from tempering.langgraph import wrap_rollout

    model = art.Model(name="m", project="p", inference_base_url="http://127.0.0.1:9/v1")
    scored = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=0.5, metrics={"x": 1.0})

    async def scored_without_llm_calls() -> art.Trajectory:
        return scored

    async def returns_nothing() -> None:
        return None

    with caplog.at_level("WARNING", logger="tempering"):
        returned = asyncio.run(wrap_rollout(model, scored_without_llm_calls)())
    assert returned is scored and returned.messages_and_choices == [{"role": "user", "content": "hi"}]
    assert returned.reward == 0.5 and returned.metrics["x"] == 1.0
    assert "no LLM call" in caplog.text and "init_chat_model" in caplog.text
    with pytest.raises(art.TrajectoryError, match="returned None"):  # no trajectory at all to hand back
        asyncio.run(wrap_rollout(model, returns_nothing)())


def test_scenario_json_without_a_scenarios_key_raises_a_value_error_naming_the_key_and_the_shape():
    from tempering.integrations.mcp.types import GeneratedScenarioCollection

    with pytest.raises(ValueError, match=r'no "scenarios" key \(found keys \[\'items\'\]\).*"task"') as info:
        GeneratedScenarioCollection.from_json('{"items": [{"task": "t", "difficulty": 1}]}')
    assert isinstance(info.value, art.ConfigError) and not isinstance(info.value, KeyError)
    with pytest.raises(art.ConfigError, match="holds a str where a list of scenarios belongs"):
        GeneratedScenarioCollection.from_json('"just text"')
    with pytest.raises(art.ConfigError, match=r"needs 'difficulty', found keys \['task'\]"):
        GeneratedScenarioCollection.from_json('{"scenarios": [{"task": "t"}]}')
    collection = GeneratedScenarioCollection.from_json('{"scenarios": [{"task": "t", "difficulty": 2}]}')
    assert GeneratedScenarioCollection.from_json(collection.to_json()).to_dicts() == [{"task": "t", "difficulty": 2}]
