"""Ask a model for a JSON list of items (scenarios, task inputs), whatever OpenAI-compatible API serves it.

The request carries `response_format={"type": "json_schema", ...}` with the answer's schema unless
the endpoint is a tempering server without structured outputs (its `/v1/models` says
`owned_by: "tempering"` and `structured_outputs: false`), or the caller says `structured=False`.
A tempering server with llguidance holds sampling to the schema, so even the 135M default model
answers with a list that parses and has the requested length; OpenAI, OpenRouter and vLLM honour
the schema too. An endpoint that refuses `response_format` (HTTP 400) is asked again without it.

Answers are parsed leniently (the outermost JSON value in the text; a bare list, `{"<key>": [...]}`
or a one-key object), each item is checked by the caller's `check_item`, bad items are dropped,
and the model is asked again until enough items are collected or `max_attempts` requests were made.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import ConfigError, TemperingError

__all__ = ["GenerationError", "generate_items", "make_client", "structured_mode"]

log = logging.getLogger("tempering")

T = TypeVar("T")


class GenerationError(TemperingError, ValueError):
    """The generator model did not produce enough valid items; `answers` holds the texts it returned."""

    def __init__(self, message: str, answers: list[str] | None = None) -> None:
        super().__init__(message)
        self.answers = answers or []


def make_client(client: Any, base_url: str | None, api_key: str | None, *, who: str) -> Any:
    """`client` if given, else an `openai.AsyncOpenAI` for `base_url` and `api_key`.

    Raises:
        ConfigError: if neither a client nor an API key is given (an unauthenticated request to a
            hosted API only fails later, less clearly).
    """
    if client is not None:
        return client
    if not api_key:
        raise ConfigError(f"{who}: pass an OpenAI-compatible client (e.g. `model.openai_client()` of a tempering "
                          f"model), or an API key for {base_url or 'the API'}")
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=base_url or None, api_key=api_key)


async def structured_mode(client: Any) -> bool:
    """Whether to send `response_format`: False only for a tempering server that cannot constrain."""
    models = getattr(client, "models", None)
    if models is None:
        return True
    from openai import OpenAIError

    try:
        page = await models.list()
    except (OpenAIError, AttributeError, TypeError):  # no models route: not tempering; send the schema as ART does
        return True
    ours = [m for m in getattr(page, "data", []) if getattr(m, "owned_by", None) == "tempering"]
    return not ours or any(getattr(m, "structured_outputs", False) is True for m in ours)


def parse_items(text: str, key: str) -> list[Any]:
    """The list in a model's answer: `{"<key>": [...]}`, a bare list, or an object with one list value.

    Raises:
        ValueError: naming what is wrong (no JSON, JSON that does not parse, no list).
    """
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        raise ValueError("the answer holds no JSON")
    start = min(starts)
    end = text.rfind("}" if text[start] == "{" else "]")
    try:
        data = json.loads(text[start:end + 1])
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON does not parse ({exc}); was the answer cut off by max_tokens?") from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        data = data[key] if isinstance(data.get(key), list) else (lists[0] if len(lists) == 1 else None)
    if not isinstance(data, list):
        raise ValueError(f'the JSON has no "{key}" list')
    return data


async def generate_items(
    *,
    client: Any,
    model: str,
    prompt: Callable[[int], str],
    key: str,
    item_schema: dict[str, Any],
    num_items: int,
    check_item: Callable[[Any], T],
    max_tokens: int,
    temperature: float,
    structured: bool | None,
    max_attempts: int,
    schema_name: str,
) -> list[T]:
    """`num_items` items, each `check_item(raw)` (which raises ValueError or TypeError for a bad one).

    Each request is `prompt(n)` for the n items still missing, answered as `{"<key>": [item, ...]}`
    (exactly n entries when the schema is sent).

    Raises:
        GenerationError: if `max_attempts` answers did not add up to `num_items` valid items.
    """
    if num_items < 1:
        raise ConfigError(f"ask for at least one item, not {num_items}")
    if structured is None:
        structured = await structured_mode(client)
    items: list[T] = []
    answers: list[str] = []
    problems: list[str] = []
    for _ in range(max_attempts):
        missing = num_items - len(items)
        schema = {"type": "object", "properties": {key: {"type": "array", "items": item_schema, "minItems": missing,
                                                         "maxItems": missing}},
                  "required": [key], "additionalProperties": False}
        request: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt(missing)}],
                                   "max_tokens": max_tokens, "temperature": temperature}
        response_format = {"type": "json_schema", "json_schema": {"name": schema_name, "schema": schema, "strict": True}}
        text, structured = await _complete(client, request, response_format if structured else None)
        answers.append(text)
        try:
            raw_items = parse_items(text, key)
        except ValueError as problem:
            problems.append(str(problem))
            continue
        for raw in raw_items[:missing]:
            try:
                items.append(check_item(raw))
            except (ValueError, TypeError, KeyError) as problem:
                problems.append(f"item {json.dumps(raw)[:80]} dropped: {problem}")
        if len(items) >= num_items:
            return items
    raise GenerationError(f"{model} gave {len(items)} valid items of the {num_items} asked for in {max_attempts} "
                          f"requests; problems: {problems[-3:]}", answers)


async def _complete(client: Any, request: dict[str, Any], response_format: dict[str, Any] | None) -> tuple[str, bool]:
    """The answer's text, and whether the endpoint took the schema (later requests leave it out if not)."""
    from openai import BadRequestError

    if response_format is not None:
        try:
            completion = await client.chat.completions.create(**request, response_format=response_format)
            return completion.choices[0].message.content or "", True
        except BadRequestError as error:
            log.warning("the generator refused response_format (%s); asking without the schema", error)
    completion = await client.chat.completions.create(**request)
    return completion.choices[0].message.content or "", False
