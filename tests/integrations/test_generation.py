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


TEMPERING = [{"owned_by": "tempering", "structured_outputs": True}]
TOOLS = [{"name": "convert", "description": "Convert between units",
          "parameters": {"type": "object", "properties": {}}}]


def test_a_tempering_generator_gets_bounded_items_and_a_budget_that_holds_them_and_an_api_gets_arts():
    """ART's call (no max_tokens, no task bound): with the default model as generator it wrote inside
    one task for 13 minutes on a CPU and then failed."""
    from tempering.endpoint import answer_budget
    from tempering.integrations.autorl import generate_inputs
    from tempering.mcp import generate_scenarios

    scenarios = json.dumps({"scenarios": [{"task": f"task {i}", "difficulty": 2} for i in range(3)]})
    for models, max_tokens, max_length in [(TEMPERING, answer_budget(3, 200), 200),
                                           ([{"owned_by": "openai"}], 8000, None)]:
        client = ScriptedGenerator(scenarios, models=models)
        asyncio.run(generate_scenarios(TOOLS, num_scenarios=3, show_preview=False, generator_model="gen",
                                       generator_client=client))
        [request] = client.requests
        scenarios_schema = request["response_format"]["json_schema"]["schema"]["properties"]["scenarios"]
        task = scenarios_schema["items"]["properties"]["task"]
        assert request["max_tokens"] == max_tokens and task.get("maxLength") == max_length
        assert scenarios_schema["minItems"] == scenarios_schema["maxItems"] == 3
        assert '"convert"' in request["messages"][0]["content"]
        assert ("under 200 characters" in request["messages"][0]["content"]) == (max_length is not None)
    client = ScriptedGenerator(json.dumps({"inputs": ["a", "b"]}), models=TEMPERING)
    assert asyncio.run(generate_inputs("Say hi.", 2, generator_model="gen", generator_client=client)) == ["a", "b"]
    assert client.requests[0]["max_tokens"] == answer_budget(2, 300)
    inputs = client.requests[0]["response_format"]["json_schema"]["schema"]["properties"]["inputs"]
    assert inputs["items"]["maxLength"] == 300


def test_a_request_that_times_out_names_itself_its_wait_and_the_arguments_to_change():
    from tempering.errors import RequestTimeout

    timed_out = openai.APITimeoutError(request=httpx.Request("POST", "http://generator/v1/chat/completions"))
    client = ScriptedGenerator(timed_out)
    with pytest.raises(RequestTimeout, match=r"^who: request 1 of at most 3 to 'gen' \(for 3 inputs, max_tokens=100\) "
                                             r"got no answer in [\d.]+ s; change this") as error:
        generate(client, who="who", fix="change this")
    assert isinstance(error.value, TimeoutError)
