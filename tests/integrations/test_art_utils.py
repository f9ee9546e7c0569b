"""ART's `art.utils` helpers (`tempering.utils`): retry's backoff, format_message, log_http_errors,
get_model_step and init_weave_with_wandb. No model loads; nothing is timed (sleeps are recorded)."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import types

import httpx
import openai
import pytest

import tempering as art
from tempering.capture.transport import httpx as sdk_httpx  # the HTTP library the openai SDK's errors carry
from tempering.types import Choice

retry_module = importlib.import_module("tempering.utils.retry")  # `tempering.utils.retry` is the function


def test_retry_accepts_a_backoff_factor_below_one_and_shrinks_the_delays_as_arts_does(monkeypatch):
    slept: list[float] = []

    async def record_async(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(retry_module, "time", types.SimpleNamespace(sleep=slept.append))
    monkeypatch.setattr(retry_module, "asyncio", types.SimpleNamespace(sleep=record_async))
    calls = []

    @art.utils.retry(max_attempts=4, delay=1.0, backoff_factor=0.5, exceptions=(KeyError,))
    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise KeyError("again")
        return "done"

    assert flaky() == "done" and slept == [1.0, 0.5, 0.25]

    slept.clear()
    attempts = []

    @art.retry(max_attempts=3, delay=0.8, backoff_factor=0.0)
    async def flaky_async() -> int:
        attempts.append(1)
        if len(attempts) < 3:
            raise RuntimeError("again")
        return len(attempts)

    assert asyncio.run(flaky_async()) == 3 and slept == [0.8, 0.0]


def test_retry_rejects_a_negative_backoff_factor_naming_it():
    with pytest.raises(art.ConfigError, match=r"backoff_factor must be >= 0.*got -1\.0") as info:
        art.retry(backoff_factor=-1.0)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match=r"max_attempts must be >= 1.*; delay must be >= 0"):
        art.retry(max_attempts=0, delay=-1)


def test_format_message_shows_the_role_the_text_and_each_tool_call_as_arts_does():
    format_message = art.utils.format_message
    assert format_message({"role": "user", "content": "What is 2+2?"}) == "User:\nWhat is 2+2?"
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}
    assert format_message({"role": "assistant", "content": None, "tool_calls": [call]}) == \
        'Assistant:\nadd({"a": 2, "b": 2})'
    assert format_message({"role": "assistant", "content": "Let me add.", "tool_calls": [call, call]}) == \
        'Assistant:\nLet me add.\nadd({"a": 2, "b": 2})\nadd({"a": 2, "b": 2})'
    parts = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "data:"}}]
    assert format_message({"role": "user", "content": parts}) == "User:\nLook:\n[image_url]"
    choice = Choice.model_validate({"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "4", "tool_calls": [call]}})
    assert format_message(choice) == 'Assistant:\n4\nadd({"a": 2, "b": 2})'


def _status_error(status: int, body: bytes, *, library=httpx) -> tuple:
    request = library.Request("GET", "http://server/v1/models/m")
    response = library.Response(status, content=body, request=request)
    return request, response


def test_log_http_errors_logs_the_status_url_and_body_then_reraises_the_same_error(caplog):
    request, response = _status_error(404, json.dumps({"detail": "model 'm' is not registered"}).encode())
    error = httpx.HTTPStatusError("404 Not Found", request=request, response=response)

    @art.utils.log_http_errors
    async def fetch() -> None:
        raise error

    with caplog.at_level("ERROR", logger="tempering"), pytest.raises(httpx.HTTPStatusError) as info:
        asyncio.run(fetch())
    summary = "[HTTP 404] GET http://server/v1/models/m: model 'm' is not registered"
    assert info.value is error and summary in info.value.__notes__ and summary in caplog.text

    caplog.clear()
    _, sdk_response = _status_error(500, b"upstream exploded", library=sdk_httpx)

    @art.utils.log_http_errors
    def complete() -> None:  # sync functions too, and the openai SDK's errors
        raise openai.InternalServerError("Error code: 500", response=sdk_response, body=None)

    with caplog.at_level("ERROR", logger="tempering"), pytest.raises(openai.InternalServerError):
        complete()
    assert "[HTTP 500] GET http://server/v1/models/m: upstream exploded" in caplog.text

    caplog.clear()

    @art.utils.log_http_errors
    async def plain_failure() -> None:  # not an HTTP error: passes through, unlogged
        raise KeyError("k")

    with caplog.at_level("ERROR", logger="tempering"), pytest.raises(KeyError):
        asyncio.run(plain_failure())
    assert caplog.text == ""


def test_get_model_step_reads_the_latest_complete_checkpoint_under_the_storage_root(tmp_path):
    model = art.TrainableModel(name="m", project="p", base_model="unused")
    assert art.utils.get_model_step(model, str(tmp_path)) == 0  # ART's signature: (model, art_path)
    checkpoints = tmp_path / "p" / "models" / "m" / "checkpoints"
    for step in (2, 11):
        (checkpoints / f"{step:04d}").mkdir(parents=True)
        (checkpoints / f"{step:04d}" / "adapter_config.json").write_text("{}")
        (checkpoints / f"{step:04d}" / "adapter_model.safetensors").write_bytes(b"")
    (checkpoints / "0012").mkdir()  # being written: no weights yet
    assert art.utils.get_model_step(model, tmp_path) == 11

    with pytest.raises(art.BackendError, match=r"not registered.*art_path.*await model.get_step\(\)"):
        art.utils.get_model_step(model)
    model._backend = types.SimpleNamespace(path=tmp_path)  # as a LocalBackend(path=tmp_path) sets it
    assert art.utils.get_model_step(model) == 11


def test_init_weave_with_wandb_names_the_pip_extra_when_weave_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "weave", None)  # as if not installed
    with pytest.raises(ImportError, match=r'pip install "tempering\[weave\]"') as info:
        art.utils.init_weave_with_wandb("proj")
    assert isinstance(info.value, art.MissingDependencyError)


def test_init_weave_with_wandb_starts_weave_only_when_wandb_is_configured_as_arts_does(monkeypatch, caplog):
    started: list[str] = []

    def init(project: str) -> str:
        if project == "unreachable":
            raise ConnectionError("no network")
        started.append(project)
        return f"client of {project}"

    monkeypatch.setitem(sys.modules, "weave", types.SimpleNamespace(init=init))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert art.utils.init_weave_with_wandb("proj") is None and started == []
    monkeypatch.setenv("WANDB_API_KEY", "key")
    assert art.utils.init_weave_with_wandb("proj") == "client of proj" and started == ["proj"]
    with caplog.at_level("WARNING", logger="tempering"):  # tracing is optional: a failed init is logged
        assert art.utils.init_weave_with_wandb("unreachable") is None
    assert "weave.init failed" in caplog.text and "no network" in caplog.text
