"""Checks of an OpenAI request before it reaches the engine: each failure is a 400 naming the field.

- `reject_unsupported`: a field tempering would otherwise ignore although it changes the results
  (`logit_bias`, `min_p`, ...), a field OpenAI does not define, or a combination OpenAI refuses;
- `checked_tools`: the tools and `tool_choice`;
- `check_tokens`: token ids outside the vocabulary, a prompt that leaves no room to sample;
- `valid_unicode` (a dependency of every route): a string holding half a surrogate pair.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import HTTPException, Request

from .schemas import ChatCompletionRequest, CompletionRequest

__all__ = ["BadParam", "check_tokens", "checked_tools", "reject_unsupported", "valid_unicode"]


class BadParam(HTTPException):
    """A 400 naming the request field at fault (OpenAI's `error.param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(400, message)
        self.param = param


def checked_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The request's tools, checked, and tool_choice checked against them."""
    choice = body.tool_choice
    if choice is not None and choice not in ("auto", "none", "required") and not (
        isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
    ):
        raise BadParam("tool_choice", 'tool_choice must be "auto", "none", "required" or '
                                       '{"type": "function", "function": {"name": ...}}')
    if not body.tools:
        if isinstance(choice, dict) or choice == "required":
            raise BadParam("tool_choice", f"tool_choice {choice!r} needs a non-empty `tools` list")
        return None
    names = set()
    for i, tool in enumerate(body.tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadParam(f"tools[{i}]", f"tools[{i}] must be "
                                           "{'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
        if not _TOOL_NAME.fullmatch(fn["name"]):
            raise BadParam(f"tools[{i}].function.name",
                            f"tools[{i}].function.name {fn['name']!r} must be 1 to 64 letters, digits, '_' or '-' "
                            "(as OpenAI requires)")
        if fn["name"] in names:
            raise BadParam(f"tools[{i}].function.name", f"tools[{i}].function.name {fn['name']!r} is taken by an "
                                                          "earlier tool; give each tool its own name")
        names.add(fn["name"])
    if isinstance(choice, dict) and choice["function"].get("name") not in names:
        raise BadParam("tool_choice", f"tool_choice names {choice['function'].get('name')!r}, which is not in tools "
                                       f"{sorted(names)}")
    return body.tools


_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# OpenAI fields that change nothing sampled here
# parallel_tool_calls: a turn ends after its first call (the engine hands the call back to the agent),
# which both values allow: false forbids several calls in a turn, true permits them (LangChain's
# with_structured_output(method="function_calling") sends false)
_HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                       "parallel_tool_calls"})
# Fields (OpenAI's and vLLM's) that would change the results: refused unless they hold the value that
# changes nothing (null always does). field: (that value, what to do instead); None: any value is refused.
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "logit_bias": ({}, "constrain the output with guided_choice, guided_regex or response_format instead"),
    "min_p": (0, "use top_p or top_k"),
    "min_tokens": (0, "ignore_eos=true samples exactly max_tokens tokens"),
    "repetition_penalty": (1, "leave it at 1"),
    "include_stop_str_in_output": (False, "the text ends before the stop string; token_ids holds every sampled token"),
    "skip_special_tokens": (True, "the text never holds special tokens; token_ids holds them"),
    "guided_whitespace_pattern": (None, "JSON is generated without free whitespace"),
    # changes nothing for tempering's models' templates, so it would be silently ignored
    "reasoning_effort": (None, 'to turn off a Qwen3 model\'s thinking send chat_template_kwargs={"enable_thinking": false}'),
}
_UNSUPPORTED_CHAT = {
    **_UNSUPPORTED,
    "functions": (None, 'send them as tools=[{"type": "function", "function": {...}}]'),
    "function_call": (None, "use tool_choice"),
    "prediction": (None, "leave it out"),
    "modalities": (["text"], 'only text output is supported; send ["text"] or leave it out'),
    "audio": (None, "only text output is supported"),
    "continue_final_message": (False, "the reply is always a new assistant turn"),
    "add_generation_prompt": (True, "the prompt always ends with the assistant turn's header"),
}
_UNSUPPORTED_COMPLETIONS = {
    **_UNSUPPORTED,
    "best_of": (1, "sample n completions and pick among them yourself"),
    "suffix": (None, "leave it out"),
    "echo": (False, "prepend the prompt yourself (prompt_token_ids holds its ids)"),
}


def reject_unsupported(body: Any) -> None:
    """400 for a field that tempering would ignore although it changes results, or for a combination OpenAI refuses."""
    if isinstance(body, CompletionRequest) and body.stream:
        raise BadParam("stream", "stream=true is supported on /v1/chat/completions only; send stream=false")
    if body.presence_penalty or body.frequency_penalty:
        raise BadParam("presence_penalty" if body.presence_penalty else "frequency_penalty",
                        "presence_penalty and frequency_penalty are not supported; leave them at 0")
    table = _UNSUPPORTED_CHAT if isinstance(body, ChatCompletionRequest) else _UNSUPPORTED_COMPLETIONS
    extra = body.model_extra or {}
    for name, value in extra.items():
        if name in table and value != table[name][0]:
            raise BadParam(name, f"{name} is not supported by tempering; {table[name][1]}")
    unknown = sorted(set(extra) - set(table) - _HARMLESS)
    if unknown:
        raise BadParam(unknown[0], f"Unrecognized request argument supplied: {', '.join(unknown)} "
                                 "(not supported by tempering; check the spelling, or leave it out)")
    if body.max_tokens is not None and getattr(body, "max_completion_tokens", None) not in (None, body.max_tokens):
        raise BadParam("max_completion_tokens",
                        f"max_tokens ({body.max_tokens}) and max_completion_tokens ({body.max_completion_tokens}) "
                                 "differ; send only one of them")
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise BadParam("top_logprobs", "top_logprobs needs logprobs=true")
        if body.stream_options is not None and not body.stream:
            raise BadParam("stream_options", "stream_options needs stream=true")


def check_tokens(service: Any, body: Any, prompt_ids: list[int]) -> None:
    """400 for token ids outside the vocabulary, or a prompt that leaves no room to sample."""
    given = {"stop_token_ids": body.stop_token_ids}
    if isinstance(getattr(body, "prompt", None), list):
        given["prompt token ids"] = prompt_ids
    for name, ids in given.items():
        vocab = len(service.tokenizer) if ids else 0
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadParam("stop_token_ids" if name == "stop_token_ids" else "prompt",
                            f"{name} must be in [0, {vocab}) (the model's vocabulary); {bad} is not")
    if len(prompt_ids) >= service.max_seq_len:
        raise BadParam("messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                        f"the prompt has {len(prompt_ids)} tokens but at most {service.max_seq_len - 1} fit in "
                        f"the model's context of {service.max_seq_len}; shorten it")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate, paired or not
_SURROGATE = re.compile("[\ud800-\udfff]")  # one that json.loads left unpaired


async def valid_unicode(request: Request) -> None:
    """400 naming the first string of the body that holds an unpaired UTF-16 surrogate (half an emoji,
    as JavaScript's `slice` leaves it), which no tokenizer can encode."""
    if request.method != "POST" or not _SURROGATE_ESCAPE.search(await request.body()):
        return
    try:
        data = await request.json()
    except (ValueError, RecursionError):
        return  # the body's validation reports it
    todo = [("", data)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str) and (found := _SURROGATE.search(value)):
            path = path.encode("utf-8", "backslashreplace").decode()  # the path itself may hold one (in a key)
            raise HTTPException(400, f"{path or 'the body'} holds an unpaired UTF-16 surrogate \\u{ord(found.group()):04x}; "
                                     "send whole characters (both halves of a surrogate pair)")
        if isinstance(value, dict):
            for key, item in reversed(value.items()):
                where = f"{path}.{key}" if path else key
                todo += [(where, item), (f"the key {where}", key)]
        elif isinstance(value, list):
            todo += [(f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value)))]
