"""The JSON-list generator shared by generate_scenarios and AutoRL: parsing, asking again, the schema's fallback.

The client here answers from a script (as in tests/rewards/test_ruler.py): what is under test is
our handling of the answers; tests/integrations/test_mcp.py and test_autorl.py use the real model.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from tempering.errors import ConfigError
from tempering.integrations.generation import GenerationError, generate_items, make_client, parse_items, structured_mode


class ScriptedGenerator:
    """An OpenAI-compatible client whose answers are given in advance; an Exception in the script is raised."""

    def __init__(self, *answers, models=None):
        self.answers = list(answers)
        self.requests = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._create))
        if models is not None:
            self.models = SimpleNamespace(list=self._list(models))

    @staticmethod
    def _list(models):
        async def list_models():
            return SimpleNamespace(data=[SimpleNamespace(**m) for m in models])
        return list_models

    async def _create(self, **kwargs):
        self.requests.append(kwargs)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=answer))])


def refused() -> openai.BadRequestError:
    request = httpx.Request("POST", "http://generator/v1/chat/completions")
    return openai.BadRequestError("response_format is not supported", response=httpx.Response(400, request=request), body=None)


def generate(client, num_items=3, **kw):
    def check(raw):
        if not isinstance(raw, str) or not raw:
            raise ValueError("not a non-empty string")
        return raw

    options = {"client": client, "model": "gen", "prompt": lambda n: f"write {n}", "key": "inputs",
               "item_schema": {"type": "string"}, "num_items": num_items, "check_item": check, "max_tokens": 100,
               "temperature": 1.0, "structured": None, "max_attempts": 3, "schema_name": "inputs"}
    return asyncio.run(generate_items(**{**options, **kw}))


def test_parse_items_takes_the_keyed_list_a_bare_list_or_a_lone_list_and_names_problems():
    assert parse_items('Here: {"inputs": ["a", "b"]} done', "inputs") == ["a", "b"]
    assert parse_items('["a"]', "inputs") == ["a"]
    assert parse_items('{"items": ["a"]}', "inputs") == ["a"]
    for text, problem in [("nothing", "no JSON"), ('{"inputs": ["a", ', "cut off"), ('{"a": [1], "b": [2]}', '"inputs"')]:
        with pytest.raises(ValueError, match=problem):
            parse_items(text, "inputs")


def test_missing_items_are_asked_for_again_and_bad_ones_dropped():
    client = ScriptedGenerator(json.dumps({"inputs": ["a", "", 3]}), "not json", json.dumps({"inputs": ["b", "c"]}))
    assert generate(client) == ["a", "b", "c"]
    assert [r["messages"][0]["content"] for r in client.requests] == ["write 3", "write 2", "write 2"]
    schema = client.requests[1]["response_format"]["json_schema"]["schema"]["properties"]["inputs"]
    assert schema["minItems"] == schema["maxItems"] == 2  # no models route: not tempering, so the schema is sent


def test_too_few_valid_items_raise_a_generation_error_with_the_answers():
    client = ScriptedGenerator('{"inputs": [""]}', "no", '{"inputs": []}')
    with pytest.raises(GenerationError, match="0 valid items of the 3") as error:
        generate(client)
    assert len(error.value.answers) == 3 and isinstance(error.value, ValueError)


def test_an_endpoint_that_refuses_the_schema_is_asked_without_it_from_then_on():
    client = ScriptedGenerator(refused(), '{"inputs": ["a"]}', '{"inputs": ["b"]}')
    assert generate(client, num_items=2) == ["a", "b"]
    assert "response_format" in client.requests[0]
    assert "response_format" not in client.requests[1] and "response_format" not in client.requests[2]


def test_a_tempering_server_without_structured_outputs_gets_no_schema_and_others_do():
    without = ScriptedGenerator(models=[{"owned_by": "tempering", "structured_outputs": False}])
    with_ = ScriptedGenerator(models=[{"owned_by": "tempering", "structured_outputs": True}])
    other = ScriptedGenerator(models=[{"owned_by": "openai"}])
    assert [asyncio.run(structured_mode(c)) for c in (without, with_, other)] == [False, True, True]
    with pytest.raises(ConfigError, match="API key"):
        make_client(None, "https://openrouter.ai/api/v1", None, who="test")
