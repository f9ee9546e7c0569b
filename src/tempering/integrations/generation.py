"""Ask a model for a JSON list of items (scenarios, task inputs), whatever OpenAI-compatible API serves it.

The request carries `response_format={"type": "json_schema", ...}` with the answer's schema unless
the endpoint is a tempering server without structured outputs (its `/v1/models` says
`owned_by: "tempering"` and `structured_outputs: false`), or the caller says `structured=False`.
A tempering server holds sampling to the schema, so even the 135M default model answers with a
list that parses and has the requested length; OpenAI, OpenRouter and vLLM honour the schema too.
An endpoint that refuses `response_format` (HTTP 400) is asked again without it.

The answer's size follows the endpoint (`resolve_budget`): an external API gets ART's budget
(`max_tokens=8000`, items unbounded); a tempering server gets a length bound per item in the
schema and a `max_tokens` that just holds the answer (endpoint.py), since a small model on a CPU,
given 8,000 tokens and no bound, wrote inside one JSON string for over ten minutes.

Answers are parsed leniently (the outermost JSON value in the text; a bare list, `{"<key>": [...]}`
or a one-key object), each item is checked by the caller's `check_item`, bad items are dropped,
and the model is asked again until enough items are collected or `max_attempts` requests were made.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..endpoint import answer_budget, create_completion, describe_endpoint, without_retries
from ..errors import ConfigError, TemperingError

__all__ = ["Budget", "GenerationError", "generate_items", "make_client", "resolve_budget", "structured_mode"]

EXTERNAL_MAX_TOKENS = 8000  # ART's generate_scenarios budget, for hosted generators

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
    endpoint = await describe_endpoint(client)
    return not endpoint.is_tempering or endpoint.has_structured_outputs


@dataclass(frozen=True, slots=True)
class Budget:
    """How to ask one endpoint for a list: the client to use, `max_tokens` per request, the length
    bound of each item's text (None: unbounded) and whether to send the schema."""

    client: Any
    max_tokens: int
    max_item_chars: int | None
    structured: bool


async def resolve_budget(client: Any, *, num_items: int, max_tokens: int | None, max_item_chars: int | None,
                         structured: bool | None, tempering_item_chars: int) -> Budget:
    """The caller's `max_tokens`, `max_item_chars` and `structured`, with None resolved for the endpoint.

    A tempering server: items of at most `tempering_item_chars` characters, `max_tokens` enough
    for all of them (endpoint.answer_budget), no retries of a timed-out request. Another endpoint:
    `max_tokens` 8000 (ART's), items unbounded, the schema sent.
    """
    endpoint = await describe_endpoint(client)
    if structured is None:
        structured = not endpoint.is_tempering or endpoint.has_structured_outputs
    if not endpoint.is_tempering:
        return Budget(client, max_tokens or EXTERNAL_MAX_TOKENS, max_item_chars, structured)
    chars = max_item_chars if max_item_chars is not None else tempering_item_chars
    return Budget(without_retries(client), max_tokens or answer_budget(num_items, chars), chars, structured)


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
    who: str = "the generator",
    fix: str = "pass a smaller max_tokens, or a client with a longer timeout",
) -> list[T]:
    """`num_items` items, each `check_item(raw)` (which raises ValueError or TypeError for a bad one).

    Each request is `prompt(n)` for the n items still missing, answered as `{"<key>": [item, ...]}`
    (exactly n entries when the schema is sent).

    Args:
        who, fix: the caller's name and what to change, for the error of a request that times out.

    Raises:
        GenerationError: if `max_attempts` answers did not add up to `num_items` valid items.
        RequestTimeout (a TimeoutError): a request got no answer within the client's timeout.
    """
    if num_items < 1:
        raise ConfigError(f"ask for at least one item, not {num_items}")
    if structured is None:
        structured = await structured_mode(client)
    items: list[T] = []
    answers: list[str] = []
    problems: list[str] = []
    base_url = getattr(client, "base_url", None)
    for attempt in range(1, max_attempts + 1):
        missing = num_items - len(items)
        schema = {"type": "object", "properties": {key: {"type": "array", "items": item_schema, "minItems": missing,
                                                         "maxItems": missing}},
                  "required": [key], "additionalProperties": False}
        request: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt(missing)}],
                                   "max_tokens": max_tokens, "temperature": temperature}
        response_format = {"type": "json_schema", "json_schema": {"name": schema_name, "schema": schema, "strict": True}}
        what = (f"{who}: request {attempt} of at most {max_attempts} to {model!r}"
                + (f" at {base_url}" if base_url else "") + f" (for {missing} {key}, max_tokens={max_tokens})")
        text, structured = await _complete(client, request, response_format if structured else None, what, fix)
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


async def _complete(client: Any, request: dict[str, Any], response_format: dict[str, Any] | None, what: str,
                    fix: str) -> tuple[str, bool]:
    """The answer's text, and whether the endpoint took the schema (later requests leave it out if not)."""
    from openai import BadRequestError

    if response_format is not None:
        try:
            completion = await create_completion(client, {**request, "response_format": response_format}, what=what,
                                                 fix=fix)
            return completion.choices[0].message.content or "", True
        except BadRequestError as error:
            log.warning("the generator refused response_format (%s); asking without the schema", error)
    completion = await create_completion(client, request, what=what, fix=fix)
    return completion.choices[0].message.content or "", False
