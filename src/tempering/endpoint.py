"""What serves a generator or judge model, and its requests that time out.

`generate_scenarios`, AutoRL and RULER ask an OpenAI-compatible endpoint for a long JSON answer.
A tempering server says that it is one in `/v1/models` (`owned_by: "tempering"`, and
`structured_outputs: true` when it holds sampling to a JSON schema). There the callers bound the
answer (a length per item in the schema, and `max_tokens` from it), so that even the default
135M model on a CPU finishes instead of writing until ART's 8,000-token budget runs out, and a
request that times out is not sent again (the same request takes as long again).

A request that times out raises `RequestTimeout`, which names the request, how long it waited
and which argument to change.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .errors import RequestTimeout

__all__ = ["EndpointInfo", "answer_budget", "create_completion", "describe_endpoint", "without_retries"]

TOKENS_PER_ITEM = 32
"""Tokens of JSON around one item of an answer list (keys, quotes, separators, a number) besides
its bounded text: `{"task": "...", "difficulty": 3}, ` is 14 tokens with SmolLM2's vocabulary."""


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    """What an endpoint's `/v1/models` says.

    Attributes:
        is_tempering: a tempering server serves it.
        has_structured_outputs: it is a tempering server that holds sampling to a JSON schema
            (False for other endpoints: what they do with `response_format` is not known here).
    """

    is_tempering: bool
    has_structured_outputs: bool


async def describe_endpoint(client: Any) -> EndpointInfo:
    """Ask `client`'s `/v1/models` once; any failure (another API, no such route) means not tempering."""
    models = getattr(client, "models", None)
    if models is None:
        return EndpointInfo(False, False)
    from openai import OpenAIError

    try:
        page = await models.list()
    except (OpenAIError, AttributeError, TypeError):  # no OpenAI-compatible models route
        return EndpointInfo(False, False)
    ours = [m for m in getattr(page, "data", []) if getattr(m, "owned_by", None) == "tempering"]
    return EndpointInfo(bool(ours), any(getattr(m, "structured_outputs", False) is True for m in ours))


def answer_budget(num_items: int, max_item_chars: int) -> int:
    """`max_tokens` for a JSON list of `num_items` items whose text is at most `max_item_chars`
    characters: room for one token per character (a sampled token holds at least one), so the
    schema, not the budget, ends the answer."""
    return num_items * (max_item_chars + TOKENS_PER_ITEM) + TOKENS_PER_ITEM


def without_retries(client: Any) -> Any:
    """`client` with the openai SDK's retries off (a copy; the caller's client is unchanged).

    For a tempering server: a generation that timed out would take as long again, and the SDK
    retries timeouts twice by default, which turned one 10-minute timeout into half an hour."""
    with_options = getattr(client, "with_options", None)
    return with_options(max_retries=0) if with_options is not None else client


async def create_completion(client: Any, request: dict[str, Any], *, what: str, fix: str) -> Any:
    """`client.chat.completions.create(**request)`.

    Args:
        what: the request, for the error ("generate_scenarios: request 2 of at most 3 to ...").
        fix: what to change, for the error ("pass a smaller max_tokens ...").

    Raises:
        RequestTimeout (a TimeoutError): the endpoint did not answer within the client's timeout.
    """
    from openai import APITimeoutError

    start = time.perf_counter()
    try:
        return await client.chat.completions.create(**request)
    except APITimeoutError:
        elapsed_s = time.perf_counter() - start
        timeout = getattr(client, "timeout", None)
        limit = f" (the client's timeout: {getattr(timeout, 'read', timeout)} s)" if timeout is not None else ""
        raise RequestTimeout(f"{what} got no answer in {elapsed_s:.1f} s{limit}; {fix}") from None
