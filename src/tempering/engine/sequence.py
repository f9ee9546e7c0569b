"""One sample being generated: its tokens, KV blocks, sampled logprobs and finish state."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from .request import GenerationRequest

__all__ = ["PENDING", "Sequence", "SequenceStatus"]

_ids = itertools.count()

PENDING = -1  # the id of a token a launched step is still sampling


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """Sample `sample_index` of `request`.

    `token_ids` holds the prompt followed by the sampled tokens. The KV cache holds the first
    `num_computed_tokens` of them, in the blocks of `block_table`; the first `num_cached_tokens`
    of those came from the prefix cache. The last `num_pending` entries are `PENDING`: tokens
    being sampled by a launched step, filled in when the step is collected. `grammar` is its
    matcher when the request is constrained (structured outputs), and `forced[i]` tells whether
    completion token i was the only one that grammar allowed.
    """

    request: GenerationRequest
    sample_index: int
    seed: int
    max_tokens: int
    token_ids: list[int]
    num_prompt_tokens: int
    adapter_key: Hashable
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_first_cached_tokens: int = 0  # num_cached_tokens when first scheduled (before any preemption)
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks of block_table published in the prefix cache
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its leading full blocks, computed once
    num_bypassed: int = 0  # times a later request was admitted before it while it waited (scheduler.py)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)  # per sampled token: the version that sampled it
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_pending: int = 0
    table_row: int = -1  # the model runner's block-table row (-1: none)
    num_table_synced: int = 0  # entries of block_table already in that row
    grammar: Any = None  # engine.grammar.GrammarMatcher | None
    forced: list[bool] = field(default_factory=list)
    routing: Any = None  # (routing.PendingRouting, index) once finished, when the request asked for its experts
    routing_at_preemption: Any = None  # (PendingRouting, index): its inputs' experts, gathered when it was preempted

    @classmethod
    def from_request(cls, request: GenerationRequest, sample_index: int, seed: int, max_tokens: int) -> Sequence:
        return cls(
            request=request,
            sample_index=sample_index,
            seed=seed,
            max_tokens=max_tokens,
            token_ids=list(request.prompt_ids),
            num_prompt_tokens=len(request.prompt_ids),
            adapter_key=(request.policy.adapter_name, request.policy.cache_version),
            grammar=request.params.grammar.matcher() if request.params.grammar is not None else None,
        )

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet (the whole prompt before prefill, 1 when decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        return (len(self.token_ids) + block_size - 1) // block_size

    def block_tokens(self, index: int, block_size: int) -> list[int]:
        return self.token_ids[index * block_size:(index + 1) * block_size]
