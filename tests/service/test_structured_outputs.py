"""Structured outputs through the server, with the real openai client and the default model.

JSON schemas, json_object, guided choice and regex (OpenAI and vLLM field names), forced tool
calls, streaming, a constrained and a free request sharing the engine's batches, every bad input,
and the forced-token flags reaching the trainer.
"""

from __future__ import annotations

import asyncio
import json
import math
import re

import httpx
import jsonschema
import pytest
import torch

import tempering as art
from tempering.training.tokenize import tokenize_trajectory

pytest.importorskip("llguidance")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "likes": {"type": "array", "items": {"type": "string", "enum": ["tea", "cats", "rain"]}, "maxItems": 3},
    },
    "required": ["name", "age", "likes"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time.",
                                         "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Describe a made-up person as JSON."}]


@pytest.fixture(scope="module")
def served(serve_default_model):
    with serve_default_model("structured-test") as served:
        yield served

def run(served, coro):
    return served[2].run_until_complete(coro)


def chat(served, **kwargs):
    model = served[0]
    kwargs.setdefault("model", model.name)
    kwargs.setdefault("messages", ASK)
    return run(served, model.openai_client().chat.completions.create(**kwargs))


def post(served, route, body):
    model = served[0]
    return httpx.post(f"{model.inference_base_url}/{route}", json={"model": model.name, **body},
                      headers={"Authorization": f"Bearer {model.inference_api_key}"}, timeout=120)


def json_schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_eight_samples_at_temperature_one_all_parse_and_validate_and_logprobs_are_the_unmasked_ones(served, hf_model):
    completion = chat(served, response_format=json_schema_format(PERSON), n=8, temperature=1.0, max_tokens=80, seed=3)
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert len(choice.grammar_forced) == len(choice.token_ids) == len(choice.sampled_logprobs)
        assert any(choice.grammar_forced) and not all(choice.grammar_forced)
    # the logprob of each sampled token is the model's own, before the mask: what the trainer recomputes
    reference, _ = hf_model
    choice = completion.choices[0]
    prompt, sampled = choice.prompt_token_ids, choice.token_ids
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + sampled])).logits[0, len(prompt) - 1: -1]
    unmasked = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(sampled)[:, None]).squeeze(1)
    served_lp = torch.tensor(choice.sampled_logprobs)
    assert (unmasked - served_lp).abs().max().item() < 1e-3
    assert any(lp < -1e-3 for lp, f in zip(served_lp.tolist(), choice.grammar_forced) if f)  # forced, yet not probability 1


def test_json_object_and_vllm_guided_json_give_json(served):
    first = chat(served, response_format={"type": "json_object"}, max_tokens=60, temperature=0.7, seed=1).choices[0]
    if first.finish_reason == "stop":
        assert isinstance(json.loads(first.message.content), dict)
    else:  # ran out of tokens inside the object: a prefix of one
        assert first.finish_reason == "length" and first.message.content.startswith("{")
    second = chat(served, extra_body={"guided_json": PERSON}, max_tokens=80, temperature=1.0, seed=2).choices[0]
    jsonschema.validate(json.loads(second.message.content), PERSON)


def test_guided_choice_returns_one_of_the_choices_in_both_spellings(served):
    options = ["rock", "paper", "scissors"]
    messages = [{"role": "user", "content": "Rock, paper or scissors?"}]
    old = chat(served, messages=messages, extra_body={"guided_choice": options}, n=4, temperature=1.0, max_tokens=8, seed=4)
    new = chat(served, messages=messages, extra_body={"structured_outputs": {"choice": options}}, n=4, temperature=1.0,
               max_tokens=8, seed=4)
    assert all(c.message.content in options and c.finish_reason == "stop" for c in old.choices + new.choices)
    assert [c.message.content for c in old.choices] == [c.message.content for c in new.choices]  # same seed, same constraint


def test_guided_regex_matches_on_chat_and_completions(served):
    pattern = r"[0-9]{3}-[0-9]{4}"
    choice = chat(served, messages=[{"role": "user", "content": "Give me a phone number."}],
                  extra_body={"guided_regex": pattern}, max_tokens=16, temperature=1.0, seed=5).choices[0]
    assert re.fullmatch(pattern, choice.message.content)
    response = post(served, "completions", {"prompt": "Phone: ", "max_tokens": 16, "temperature": 1.0, "seed": 5,
                                            "structured_outputs": {"regex": pattern}})
    assert response.status_code == 200, response.text
    body = response.json()["choices"][0]
    assert re.fullmatch(pattern, body["text"]) and len(body["grammar_forced"]) == len(body["token_ids"])


def test_named_and_required_tool_choice_call_a_tool_whose_arguments_validate(served):
    messages = [{"role": "user", "content": "What's the weather like in Paris?"}]
    named = chat(served, messages=messages, tools=[WEATHER, TIME], n=4, temperature=1.0, max_tokens=40, seed=6,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    required = chat(served, messages=messages, tools=[WEATHER, TIME], tool_choice="required", n=4, temperature=1.0,
                    max_tokens=40, seed=7)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in named.choices + required.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert all(c.message.tool_calls[0].function.name == "get_weather" for c in named.choices)


def test_a_streamed_schema_bound_answer_concatenates_to_valid_json(served):
    model = served[0]

    async def go():
        stream = await model.openai_client().chat.completions.create(
            model=model.name, messages=ASK, response_format=json_schema_format(PERSON), max_tokens=80, temperature=1.0,
            seed=8, stream=True)
        text, ids, last = "", [], None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                ids += getattr(c, "token_ids", None) or []
                if c.finish_reason:
                    last = c
        return text, ids, last

    text, ids, last = run(served, go())
    jsonschema.validate(json.loads(text), PERSON)
    assert last.finish_reason == "stop" and len(last.grammar_forced) == len(ids)
    plain = chat(served, response_format=json_schema_format(PERSON), max_tokens=80, temperature=1.0, seed=8).choices[0]
    assert plain.message.content == text and plain.token_ids == ids


def test_a_constrained_and_a_free_request_share_the_engine_steps(served):
    model, backend, _ = served
    client = model.openai_client()
    engine = backend._registry.get(model.name).engine
    free = {"model": model.name, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 40,
            "temperature": 1.0, "seed": 9, "extra_body": {"ignore_eos": True}}

    async def together():
        return await asyncio.gather(
            client.chat.completions.create(model=model.name, messages=ASK, response_format=json_schema_format(PERSON),
                                           max_tokens=80, temperature=1.0, seed=9),
            client.chat.completions.create(**free),
        )

    before = engine.stats.num_steps
    constrained, shared = run(served, together())
    steps = engine.stats.num_steps - before
    assert steps < len(constrained.choices[0].token_ids) + len(shared.choices[0].token_ids)  # they decoded together
    jsonschema.validate(json.loads(constrained.choices[0].message.content), PERSON)
    assert getattr(shared.choices[0], "grammar_forced", None) is None and len(shared.choices[0].token_ids) == 40
    with pytest.raises(json.JSONDecodeError):  # the free row was not held to the schema
        json.loads(shared.choices[0].message.content)


def test_every_bad_input_is_a_400_naming_the_problem_and_the_server_keeps_serving(served):
    base = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    cases = [
        ({"response_format": json_schema_format({"type": "object", "dependentRequired": {"a": ["b"]}})}, "dependentRequired"),
        ({"response_format": json_schema_format({"type": "objekt"})}, "objekt"),
        ({"response_format": json_schema_format({"type": "string", "format": "credit-card"})}, "credit-card"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"response_format": {"type": "yaml"}}, "yaml"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 3]}, "guided_choice"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_regex": "(ab"}, "unclosed group"),
        ({"guided_grammar": "start: nowhere"}, "nowhere"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "one constraint"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structural_tag"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "at most one"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_choice": ["a"]}, "tool_choice"),
    ]
    model = served[0]

    async def go():
        good = model.openai_client().chat.completions.create(
            model=model.name, messages=ASK, response_format=json_schema_format(PERSON), max_tokens=80, temperature=1.0, seed=10)
        bad = [asyncio.to_thread(post, served, "chat/completions", {**base, **extra}) for extra, _ in cases]
        return await asyncio.gather(good, *bad)

    good, *responses = run(served, go())
    for (extra, needle), response in zip(cases, responses):
        assert response.status_code == 400, (extra, response.text)
        assert needle in response.json()["error"]["message"], (extra, response.text)
    jsonschema.validate(json.loads(good.choices[0].message.content), PERSON)  # the batch went on
    after = chat(served, extra_body={"guided_choice": ["yes", "no"]}, max_tokens=4, temperature=0)
    assert after.choices[0].message.content in ("yes", "no")


def test_a_grammar_that_cannot_finish_within_max_tokens_ends_with_length_and_the_partial_text(served):
    choice = chat(served, extra_body={"guided_regex": "a{40}"}, max_tokens=3, temperature=1.0, seed=11).choices[0]
    assert choice.finish_reason == "length" and len(choice.token_ids) == 3
    assert choice.message.content and set(choice.message.content) == {"a"} and len(choice.message.content) < 40


def test_forced_token_flags_reach_the_trainer_and_can_be_left_out_of_the_loss(served):
    model, backend, _ = served
    service = backend._registry.get(model.name)
    messages = [{"role": "user", "content": "Rock, paper or scissors?"}]
    trajectories = []
    for seed in (12, 13):
        first = chat(served, messages=messages, response_format=json_schema_format(PERSON), max_tokens=80, temperature=1.0,
                     seed=seed).choices[0]
        traj = art.Trajectory(messages_and_choices=[*messages, first, {"role": "user", "content": "Again, freely."}])
        second = chat(served, messages=traj.messages(), max_tokens=8, temperature=1.0, seed=seed).choices[0]
        traj.messages_and_choices.append(second)
        traj.reward = float(seed)
        trajectories.append(art.Trajectory.model_validate_json(traj.model_dump_json()))  # through JSON, as stored

    for traj in trajectories:
        first, second = [m for m in traj.messages_and_choices if isinstance(m, art.types.Choice)]
        [kept] = tokenize_trajectory(traj, service.renderer, max_seq_len=service.max_seq_len)
        [dropped] = tokenize_trajectory(traj, service.renderer, max_seq_len=service.max_seq_len, exclude_forced_tokens=True)
        assert [f for f, m in zip(kept.forced, kept.loss_mask) if m] == first.grammar_forced + [False] * len(second.token_ids)
        assert dropped.num_completion_tokens == kept.num_completion_tokens - sum(first.grammar_forced)
        assert all(math.isnan(lp) for lp, f in zip(dropped.sampled_logprobs, dropped.forced) if f)

    group = art.TrajectoryGroup(trajectories)
    kept = run(served, backend.train(model, [group], learning_rate=1e-6, save_checkpoint=False))
    dropped = run(served, backend.train(model, [group], learning_rate=1e-6, save_checkpoint=False, exclude_forced_tokens=True))
    num_forced = sum(sum(t.messages_and_choices[1].grammar_forced) for t in trajectories)
    assert kept.metrics["data/step_completion_tokens"] - dropped.metrics["data/step_completion_tokens"] == num_forced
    # every token forced and left out: nothing to train on, said as such (it ran a step on no token)
    for traj in trajectories:
        for choice in [m for m in traj.messages_and_choices if isinstance(m, art.types.Choice)]:
            choice.grammar_forced = [True] * len(choice.token_ids)
    nothing = run(served, backend.train(model, [group], learning_rate=1e-6, save_checkpoint=False, exclude_forced_tokens=True))
    assert nothing.is_adapter_unchanged and nothing.num_groups_trainable == 0


def test_guided_completion_params_make_the_student_repeat_the_teachers_text_and_tool_call(served):
    from tempering.guided_completion import get_guided_completion_params

    messages = [{"role": "user", "content": "What's the weather like in Paris?"}]
    teacher_call = chat(served, messages=messages, tools=[WEATHER, TIME], max_tokens=40, temperature=1.0, seed=14,
                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice, tool_choice, tools = get_guided_completion_params(teacher_call, base_tools=[WEATHER, TIME])
    assert choice is None and tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    student = chat(served, messages=messages, tools=tools, tool_choice=tool_choice, max_tokens=40, temperature=1.0, seed=15)
    [call] = student.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == json.loads(teacher_call.choices[0].message.tool_calls[0].function.arguments)

    teacher_text = chat(served, messages=messages, max_tokens=24, temperature=1.0, seed=16)
    choice, tool_choice, tools = get_guided_completion_params(teacher_text)
    assert tool_choice is None and tools is None
    student = chat(served, messages=messages, extra_body={"guided_choice": choice}, max_tokens=64, temperature=1.0, seed=17)
    assert student.choices[0].message.content == teacher_text.choices[0].message.content
    with pytest.raises(ValueError, match="base_tools"):
        get_guided_completion_params(teacher_call)
