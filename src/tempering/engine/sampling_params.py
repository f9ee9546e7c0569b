"""What one generation request asks for."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .grammar import CompiledGrammar

from ..errors import ConfigError

__all__ = ["MIN_TEMPERATURE", "SamplingParams", "row_seed"]

MIN_TEMPERATURE = 1e-5  # below it sampling is greedy (as vLLM's _SAMPLING_EPS)
MAX_TOP_K = 2**31 - 1


@dataclass(slots=True)
class SamplingParams:
    """Sampling options of one request (OpenAI semantics).

    Attributes:
        max_tokens: most new tokens per sample, including the final stop token.
        temperature: 0 means greedy decoding; otherwise logits are divided by it. Values below
            MIN_TEMPERATURE become 0 (float32 logits / T would overflow; vLLM does the same).
        top_p: nucleus sampling mass in [0, 1]; 1 turns it off; the most likely token is always
            kept, so 0 samples among the top token only.
        top_k: sample among the k most likely tokens; 0 or -1 turns it off.
        seed: makes sampling reproducible: the same seed gives the same tokens, whatever else
            shares the batch; the n samples of one request use different streams.
        stop: strings that end a sample; the returned text stops before the first one.
        stop_token_ids: ids that end a sample besides the model's end-of-turn ids.
        ignore_eos: keep sampling past the model's end-of-turn ids (benchmarks); `stop_token_ids`
            still end a sample, as in vLLM.
        num_top_logprobs: how many most likely alternatives to return per token (0-20).
        grammar: a compiled grammar (engine/grammar) every sample must follow, or None.
        return_routed_experts: a mixture of experts returns each token's experts per MoE layer
            (`Completion.routed_experts`, for routing replay in training).

    Raises:
        ConfigError: for out-of-range values.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    num_top_logprobs: int = 0
    grammar: CompiledGrammar | None = None
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ConfigError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if not 0.0 <= self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in [0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise ConfigError(f"top_k must be -1, 0 (off) or in [1, {MAX_TOP_K}], got {self.top_k}")
        if not 0 <= self.num_top_logprobs <= 20:
            raise ConfigError(f"top_logprobs must be in [0, 20], got {self.num_top_logprobs}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")
        if self.seed is not None:
            try:
                self.seed = operator.index(self.seed)
            except TypeError:
                raise ConfigError(f"seed must be an integer, got {self.seed!r}") from None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        """The temperature logprobs are computed at: the sampling one, or 1 for greedy decoding."""
        return 1.0 if self.is_greedy else self.temperature


def row_seed(seed: int | None, sample_index: int, rng) -> int:
    """The random stream (a 31-bit int) of sample `sample_index` of a request.

    A request's seed gives reproducible streams; without one, `rng` (a random.Random) draws one.
    """
    if seed is None:
        return rng.getrandbits(31)
    return (seed * 0x9E3779B1 + sample_index * 0x85EBCA77 + 0x165667B1) & 0x7FFFFFFF
