"""Bad input to the OpenAI routes: a 4xx naming the field and the fix, never a 500, and no parameter
that changes results silently ignored; the server keeps serving after each one."""

from __future__ import annotations

import copy
import json

import httpx
import jinja2
import pytest

HI = [{"role": "user", "content": "Say hi"}]
TOOL = {"type": "function",
        "function": {"name": "get_time", "description": "The time.", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def served(serve_default_model):
    """A LocalBackend serving an untrained default model; yields (model, backend)."""
    with serve_default_model("valid") as served:
        yield served[:2]

def post(served, body, path="/chat/completions", **kwargs):
    """The response to `body` (a dict, or raw bytes sent as JSON); a chat body gets model and a short max_tokens."""
    model, _ = served
    headers = {"Authorization": f"Bearer {model.inference_api_key}", "Content-Type": "application/json",
               **kwargs.pop("headers", {})}
    if isinstance(body, dict):
        body = json.dumps({"model": model.name, "max_tokens": 2, **({"messages": HI} if path == "/chat/completions" else {}),
                           **body}).encode()
    return httpx.post(model.inference_base_url + path, content=body, headers=headers, timeout=120)


def refused(response, status, *words):
    """The error message, after checking the status and that it names every one of `words`."""
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert all(w in message for w in words), (message, words)
    return message


def still_serving(served):
    assert post(served, {}).json()["choices"][0]["token_ids"]


def test_integers_that_reach_the_engine_are_bounded(served):
    for path, extra in (("/chat/completions", {}), ("/completions", {"prompt": "Hi"})):
        refused(post(served, {**extra, "top_k": 2**70}, path), 422, "top_k")
        refused(post(served, {**extra, "top_k": 2**31}, path), 422, "top_k")
        for ids in ([-1], [10**9], [2**70]):
            refused(post(served, {**extra, "stop_token_ids": ids}, path), 400, "stop_token_ids", "[0, 49152)")
    refused(post(served, {"prompt": [1, 2**70]}, "/completions"), 400, "prompt token ids", "[0, 49152)")
    assert post(served, {"top_k": 2**31 - 1, "stop_token_ids": [49151]}).status_code == 200
    still_serving(served)


def test_an_unpaired_surrogate_anywhere_is_a_400_naming_its_path(served):
    model, _ = served
    bodies = {
        b'"messages": [{"role": "system", "content": "Be nice \\ud83d"}, {"role": "user", "content": "hi"}]':
            "messages[0].content",
        b'"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc80"}]}]': "messages[0].content[0].text",
        b'"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", '
        b'"description": "x\\ud83d", "parameters": {}}}]': "tools[0].function.description",
        b'"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud83d"]': "stop[0]",
        b'"messages": [{"role": "user", "content": "hi"}], "metadata": {"\\ud83d": 1}': "the key metadata.\\ud83d",
        b'"messages": [{"role": "user", "content": "hi"}], "user": "\\udfff"': "user",
    }
    for fields, where in bodies.items():
        raw = b'{"model": "%s", "max_tokens": 2, %s}' % (model.name.encode(), fields)
        refused(post(served, raw), 400, where, "unpaired UTF-16 surrogate")
    refused(post(served, b'{"model": "%s", "prompt": "\\udc80"}' % model.name.encode(), "/completions"), 400, "prompt", "\\udc80")
    # a whole pair is one character (an emoji), and an escaped backslash is no escape
    ok = b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud83c\\udf89 \\\\ud83d"}]}'
    assert post(served, ok % model.name.encode()).status_code == 200
    still_serving(served)


def test_malformed_assistant_tool_calls_are_422_naming_the_path(served):
    def with_calls(calls):
        return {"tools": [TOOL], "messages": [HI[0], {"role": "assistant", "content": None, "tool_calls": calls},
                                              {"role": "tool", "tool_call_id": "c1", "content": "noon"}]}

    cases = [
        ([{"id": "c1", "type": "function"}], "messages[1].tool_calls[0].function is required"),
        ([{"id": "c1", "type": "function", "function": {"arguments": "{}"}}],
         "messages[1].tool_calls[0].function.name is required"),
        ({"id": "c1", "function": {"name": "get_time"}}, "messages[1].tool_calls"),
        ("abc", "messages[1].tool_calls"),
        (["abc"], "messages[1].tool_calls[0]"),
        ([{"id": "c1", "type": "code", "function": {"name": "get_time"}}], "messages[1].tool_calls[0].type"),
    ]
    for calls, words in cases:
        refused(post(served, with_calls(calls)), 422, words)
    good = [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    assert post(served, with_calls(good)).status_code == 200


def test_content_parts_must_be_text_parts_with_string_text(served):
    for text in (None, 5, ["a"]):
        refused(post(served, {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}), 422,
                "messages[0].content[0].text")
    refused(post(served, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}), 422,
            "messages[0].content[0]", "'image_url' are not supported")
    refused(post(served, {"messages": [{"role": "user", "content": 5}]}), 422,
            "messages[0].content", "string or a list of text parts")
    refused(post(served, {"messages": [{"content": "no role"}]}), 422, "messages[0].role is required")
    texts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]
    parts = post(served, {"messages": [{"role": "developer", "content": texts}]})
    joined = post(served, {"messages": [{"role": "system", "content": "Say hi"}]})
    assert parts.json()["choices"][0]["prompt_token_ids"] == joined.json()["choices"][0]["prompt_token_ids"]


def test_a_step_suffix_must_be_ascii_digits(served):
    model, _ = served
    for name in (f"{model.name}@²", f"{model.name}@٠", f"{model.name}@", f"{model.name}@abc"):
        response = post(served, {"model": name})
        refused(response, 404, "does not exist")
        assert response.json()["error"]["code"] == "model_not_found"
    assert post(served, {"model": f"{model.name}@0"}).status_code == 200


def test_tool_names_follow_openais_rule_and_are_unique(served):
    def named(name):
        schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
        return {"type": "function", "function": {"name": name, "parameters": schema}}

    for name in ("", "a b", "x" * 65, "ünï", "a.b"):
        refused(post(served, {"tools": [named(name)], "tool_choice": {"type": "function", "function": {"name": name}}}), 400,
                "tools[0].function.name", "1 to 64")
    refused(post(served, {"tools": [named("f"), TOOL, named("f")]}), 400, "tools[2].function.name", "earlier tool")
    assert post(served, {"tools": [named("Get_time-2"), TOOL]}).status_code == 200


def test_top_p_zero_keeps_only_the_most_likely_token(served):
    greedy = post(served, {"max_tokens": 8, "temperature": 0}).json()["choices"][0]["token_ids"]
    for top_p in (0, 1e-300):
        response = post(served, {"max_tokens": 8, "top_p": top_p, "seed": 1})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == greedy
    refused(post(served, {"top_p": -0.1}), 422, "top_p")


def test_fields_that_would_change_results_are_refused_and_harmless_ones_pass(served):
    chat = {
        "logit_bias": {"28": 100}, "functions": [{"name": "f"}], "function_call": "auto",
        "repetition_penalty": 1.2, "min_tokens": 3, "min_p": 0.1, "prediction": {"type": "content", "content": "x"},
        "modalities": ["text", "audio"], "audio": {"voice": "alloy"}, "continue_final_message": True,
        "add_generation_prompt": False, "include_stop_str_in_output": True, "guided_whitespace_pattern": " ",
        "skip_special_tokens": False, "reasoning_effort": "low",
    }
    for field, value in chat.items():
        refused(post(served, {field: value}), 400, f"{field} is not supported by tempering; ")
    for field, value in {"best_of": 2, "suffix": "x", "echo": True, "logit_bias": {"1": 1}}.items():
        refused(post(served, {"prompt": "Hi", field: value}, "/completions"), 400, f"{field} is not supported by tempering; ")
    refused(post(served, {"temperatur": 0.5, "top_n": 1}), 400, "Unrecognized request argument supplied: temperatur, top_n")
    refused(post(served, {"prompt": "Hi", "messages": HI}, "/completions"), 400, "Unrecognized", "messages")
    harmless = {"user": "u", "metadata": {"a": "b"}, "store": False, "service_tier": "auto", "prompt_cache_key": "k",
                "safety_identifier": "s", "logit_bias": {}, "parallel_tool_calls": True, "modalities": ["text"],
                "min_p": 0, "repetition_penalty": 1, "skip_special_tokens": True, "functions": None, "reasoning_effort": None}
    assert post(served, harmless).status_code == 200
    assert post(served, {"parallel_tool_calls": False}).status_code == 200  # a turn ends after its first call anyway
    assert post(served, {"prompt": "Hi", "echo": False, "best_of": 1, "user": "u"}, "/completions").status_code == 200


def test_chat_template_kwargs_reach_the_template(served, monkeypatch):
    model, backend = served
    tokenizer = backend.hub.registry.get(model.name).renderer.tokenizer
    seen = []
    render = tokenizer.apply_chat_template

    def spy(messages, **kwargs):
        seen.append(kwargs)
        return render(messages, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", spy)
    assert post(served, {"chat_template_kwargs": {"enable_thinking": False}}).status_code == 200
    assert seen[-1]["enable_thinking"] is False and seen[-1]["add_generation_prompt"] is True

    def strict(messages, **kwargs):  # as a template's raise_exception(...) does
        raise jinja2.TemplateError("Conversation roles must alternate user/assistant")

    monkeypatch.setattr(tokenizer, "apply_chat_template", strict)
    refused(post(served, {}), 400, "chat template", "roles must alternate")
    monkeypatch.setattr(tokenizer, "apply_chat_template", render)
    refused(post(served, {"chat_template_kwargs": {"tokenize": True}}), 422, "chat_template_kwargs", "tokenize")


def test_chat_template_kwargs_are_template_variables():
    from tempering.chat import ChatRenderer

    class Tokenizer:
        chat_template = "x"
        eos_token_id = 0

        def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=True, **variables):
            thinking = "" if variables.get("enable_thinking", True) else "<no-think>"
            return "".join(m["content"] for m in messages) + thinking

    renderer = ChatRenderer(Tokenizer())
    assert renderer.render_text(HI) == "Say hi"
    assert renderer.render_text(HI, template_kwargs={"enable_thinking": False}) == "Say hi<no-think>"


def test_openai_combination_rules(served):
    refused(post(served, {"top_logprobs": 5}), 400, "top_logprobs", "logprobs=true")
    refused(post(served, {"logprobs": False, "top_logprobs": 5}), 400, "top_logprobs")
    refused(post(served, {"stream_options": {"include_usage": True}}), 400, "stream_options", "stream=true")
    refused(post(served, {"stream": True, "stream_options": {"include_usage": "no"}}), 422, "stream_options.include_usage")
    refused(post(served, {"stream": True, "stream_options": {"usage": True}}), 422, "stream_options")
    refused(post(served, {"max_tokens": 8, "max_completion_tokens": 3}), 400, "max_tokens (8)", "max_completion_tokens (3)")
    assert post(served, {"max_tokens": 3, "max_completion_tokens": 3}).status_code == 200
    # error.param names the field, as OpenAI's does (the openai SDK exposes it as exc.param)
    for body, param in (({"top_logprobs": 5}, "top_logprobs"), ({"min_p": 0.1}, "min_p"),
                        ({"temperatur": 0.5}, "temperatur"), ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
                        ({"messages": [{"role": "user", "content": "hi " * 9000}]}, "messages")):
        assert post(served, body).json()["error"]["param"] == param, body
    streamed = post(served, {"stream": True, "stream_options": {"include_usage": True}})
    assert streamed.status_code == 200 and '"usage"' in streamed.text


def test_logprob_bytes_are_the_tokens_raw_bytes(served):
    body = {"messages": [{"role": "user", "content": "Reply with only the emoji 🎉🎉🎉"}], "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "max_tokens": 6}
    choice = post(served, body).json()["choices"][0]
    entries = [e for e, t in zip(choice["logprobs"]["content"], choice["token_ids"]) if t != 2]  # not <|im_end|>
    assert "🎉" in choice["message"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == choice["message"]["content"]
    assert any(e["token"] == "\ufffd" and e["bytes"] != [239, 191, 189] for e in entries)  # part of a character
    out = post(served, {"prompt": "🎉 is a", "max_tokens": 4, "temperature": 0, "logprobs": 1}, "/completions")
    out = out.json()["choices"][0]
    assert len(out["logprobs"]["text_offset"]) == len(out["token_ids"])
    assert out["logprobs"]["text_offset"][0] == 0

    from tempering.service.logprob_fields import token_decoder

    tokenizer = served[1].hub.registry.get(served[0].name).tokenizer
    decode = token_decoder(tokenizer)
    ids = tokenizer.encode("🎉 é\n<|im_end|>", add_special_tokens=False)
    assert b"".join(bytes(decode.bytes(t)) for t in ids) == "🎉 é\n<|im_end|>".encode()
    # transformers 5.17 builds this tokenizer's decoder as a Sequence around ByteLevel: the same bytes
    from tokenizers import decoders

    sequenced = copy.deepcopy(tokenizer)
    sequenced.backend_tokenizer.decoder = decoders.Sequence([
        decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " "), decoders.ByteLevel()])
    assert sequenced.decode(ids) == "🎉 é\n<|im_end|>"
    assert b"".join(bytes(token_decoder(sequenced).bytes(t)) for t in ids) == "🎉 é\n<|im_end|>".encode()


def test_clear_messages_for_common_mistakes(served):
    model, _ = served
    refused(post(served, b'{"model": "valid", "messages": ['), 422, "request body is not valid JSON", "at char 32")
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        body = json.dumps({"model": model.name, "messages": HI}).encode()
        refused(post(served, body, headers={"Content-Type": content_type}), 422, "Content-Type: application/json")
    nulls = {k: None for k in ("temperature", "top_p", "n", "max_completion_tokens", "presence_penalty", "frequency_penalty",
                               "logprobs", "top_logprobs", "stop", "seed", "top_k", "stream", "stream_options", "tools",
                               "tool_choice", "response_format", "user", "logit_bias", "parallel_tool_calls")}
    assert post(served, nulls).status_code == 200
    assert post(served, {"prompt": "Hi", "logprobs": None, "temperature": None, "echo": None}, "/completions").status_code == 200
    refused(post(served, b'{"model": "valid", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'), 422,
            "temperature", "finite")
    refused(post(served, {"prompt": ["a", "b"]}, "/completions"), 422, "send one request per prompt")
    refused(post(served, {"prompt": [[1, 2], [3]]}, "/completions"), 422, "send one request per prompt")
    message = refused(post(served, {"guided_choice": [f"w{i}" for i in range(50_001)]}), 400, "guided_choice", "50001 choices")
    assert "backtrace" not in message
    long = {"messages": [{"role": "user", "content": "word " * 9000}]}
    refused(post(served, long), 400, "the prompt has", "at most 8191 fit")
    refused(post(served, {**long, "stream": True}), 400, "the prompt has")  # not a stream cut after its 200
    refused(post(served, {"prompt": [1] * 8192}, "/completions"), 400, "the prompt has 8192 tokens but at most 8191 fit")
    still_serving(served)


def test_a_schema_with_no_finite_instance_is_refused(served):
    pytest.importorskip("llguidance")
    for schema in ({"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        refused(post(served, {"response_format": fmt}), 400, "response_format.json_schema.schema", "no finite instance")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    ok = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert post(served, {"response_format": ok, "max_tokens": 4}).status_code == 200


def test_an_unexpected_error_is_a_500_that_keeps_the_connection_open(served, monkeypatch):
    model, backend = served
    renderer = backend.hub.registry.get(model.name).renderer

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(renderer, "render_prompt_and_text", broken)
    body = {"model": model.name, "max_tokens": 2, "messages": HI}
    ports = []
    with httpx.Client(headers={"Authorization": f"Bearer {model.inference_api_key}"}, timeout=60) as client:
        for _ in range(2):
            response = client.post(model.inference_base_url + "/chat/completions", json=body)
            assert response.status_code == 500 and "boom" in response.json()["error"]["message"]
            assert response.json()["error"]["type"] == "server_error"
            ports.append(response.extensions["network_stream"].get_extra_info("client_addr")[1])
        monkeypatch.undo()
        assert client.post(model.inference_base_url + "/chat/completions", json=body).status_code == 200
    assert ports[0] == ports[1]  # the second request reused the first one's connection
