"""One generation request, the policy it samples from, and what it returns."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..types import out_of_vocabulary
from .sampling_params import SamplingParams

__all__ = ["BasePolicy", "Completion", "GenerationRequest", "Policy", "TokenCallback", "new_request"]


class Policy(Protocol):
    """The weights a request samples from: the base model, the live adapter, or an older step.

    Attributes:
        key: requests with equal keys may share a batch of the transformers engine.
        adapter_name: the PEFT adapter to apply (None: the base weights).
        cache_version: changes whenever that adapter's weights change, so KV blocks computed
            under older weights are never reused (part of the prefix-cache key).
        version: the policy version of these weights (the training step that produced them);
            read at every step under the engine's lock and stamped on each token sampled.
    `activate()` makes these weights the ones the transformers model computes with.
    """

    key: Hashable
    adapter_name: str | None
    cache_version: Hashable
    version: int

    def activate(self) -> contextlib.AbstractContextManager[None]: ...


class BasePolicy:
    """The model as loaded, with nothing switched."""

    key: Hashable = "base"
    adapter_name: str | None = None
    cache_version: Hashable = 0
    version: int = 0

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        yield


@dataclass(slots=True)
class Completion:
    """One sample.

    Attributes:
        token_ids: the sampled ids, including the final stop token when there is one.
        logprobs: natural-log probability of each sampled id, at `logprob_temperature`.
        top_logprobs: per sampled token, the (id, logprob) pairs of the most likely tokens
            (empty lists when none were asked for).
        text: the decoded completion without special tokens, cut before any stop string.
        raw_text: the same decode before that cut, when a stop string cut `text` (None: `text`
            is the whole decode).
        finish_reason: "stop" (a stop token or string) or "length" (max_tokens reached).
        logprob_temperature: the temperature the logprobs were computed at.
        forced: for a grammar-constrained sample, per sampled token whether the grammar allowed
            only that token; None for a free sample.
        policy_versions: per sampled token, the policy version of the weights that sampled it
            (a sample that spans a training step has two).
        routed_experts: for a mixture of experts, when asked for (`SamplingParams.return_routed_experts`):
            [P + C - 1, moe_layers, k] uint8 (int16 past 256 experts) numpy array, the experts each
            token of prompt + completion but the last was routed to; None otherwise.
        num_cached_tokens: prompt tokens taken from the prefix cache when the sample was first
            scheduled (OpenAI's `usage.prompt_tokens_details.cached_tokens`; a recomputation after
            a preemption does not change it).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: str
    logprob_temperature: float
    forced: list[bool] | None = None
    policy_versions: list[int] = field(default_factory=list)
    routed_experts: Any = None
    raw_text: str | None = None
    num_cached_tokens: int = 0


TokenCallback = Callable[[int, int, float, list[tuple[int, float]]], None]


@dataclass(slots=True)
class GenerationRequest:
    """A prompt to sample `n` completions of.

    `on_token(sample_index, token_id, logprob, top_logprobs)`, when set, is called from the
    engine's thread for every sampled token (streaming); `future` resolves to the n Completions.
    """

    prompt_ids: list[int]
    params: SamplingParams
    n: int
    policy: Policy
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    on_token: TokenCallback | None = None


def new_request(prompt_ids: list[int], params: SamplingParams, n: int, policy: Policy, on_token: TokenCallback | None,
                *, max_seq_len: int, limits: str, vocab_size: int | None = None) -> GenerationRequest:
    """A validated request (both engines' `submit`).

    Raises:
        ConfigError: if the prompt is empty, holds an id outside [0, vocab_size), leaves no room
            for a token (`limits` says which limits apply), or n < 1.
    """
    from ..errors import ConfigError

    if not prompt_ids:
        raise ConfigError("the prompt is empty: send at least one message or token")
    if vocab_size is not None and (bad := out_of_vocabulary(prompt_ids, vocab_size)) is not None:
        raise ConfigError(f"the prompt holds token id {bad}, outside the model's vocabulary [0, {vocab_size}); "
                          "tokenize it with this model's tokenizer")
    if len(prompt_ids) >= max_seq_len:
        raise ConfigError(f"the prompt has {len(prompt_ids)} tokens but at most {max_seq_len - 1} fit ({limits}); shorten it")
    if n < 1:
        raise ConfigError(f"n must be >= 1, got {n}")
    return GenerationRequest(list(prompt_ids), params, n, policy, on_token=on_token)
