"""When a sample ends, and the Completion it becomes (shared by both engines)."""

from __future__ import annotations

from typing import Any

from .request import Completion
from .sampling_params import SamplingParams

__all__ = ["completion_of", "finish_reason_at", "finish_reason_of"]


def finish_reason_of(
    completion_ids: list[int], params: SamplingParams, max_tokens: int, stop_token_ids: list[int], tokenizer: Any
) -> str | None:
    """"stop", "length" or None (go on), after the newest token of `completion_ids` was appended.

    Stop strings are looked for in the decoded tail only (long enough to hold the longest one),
    so the check costs the same at token 10 and at token 10,000.
    """
    return finish_reason_at(completion_ids, len(completion_ids) - 1, len(completion_ids), params, max_tokens,
                            stop_token_ids, tokenizer)


def finish_reason_at(
    token_ids: list[int], index: int, num_completion_tokens: int, params: SamplingParams, max_tokens: int,
    stop_token_ids, tokenizer: Any,
) -> str | None:
    """`finish_reason_of` for the token at `index` of `token_ids`, the `num_completion_tokens`-th
    of its completion, without copying the completion (the engine checks every token)."""
    last = token_ids[index]
    if last in params.stop_token_ids or (not params.ignore_eos and last in stop_token_ids):
        return "stop"
    if params.stop:
        window = max(len(s) for s in params.stop) + 4
        start = index + 1 - min(window, num_completion_tokens)
        tail = tokenizer.decode(token_ids[start:index + 1], skip_special_tokens=True)
        if any(s in tail for s in params.stop):
            return "stop"
    if num_completion_tokens >= max_tokens:
        return "length"
    return None


def completion_of(
    completion_ids: list[int],
    logprobs: list[float],
    top_logprobs: list[list[tuple[int, float]]],
    finish_reason: str | None,
    params: SamplingParams,
    tokenizer: Any,
    *,
    forced: list[bool] | None = None,
    policy_versions: list[int] | None = None,
) -> Completion:
    """The Completion of a finished sample: text without special tokens, cut before the first stop string."""
    raw_text = tokenizer.decode(completion_ids, skip_special_tokens=True)
    hits = [i for i in (raw_text.find(s) for s in params.stop) if i >= 0] if params.stop else []
    text = raw_text[: min(hits)] if hits else raw_text
    return Completion(
        token_ids=completion_ids,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        text=text,
        finish_reason=finish_reason or "length",
        logprob_temperature=params.logprob_temperature,
        forced=forced,
        policy_versions=list(policy_versions or []),
        raw_text=raw_text if hits else None,
    )
