"""Per-step metadata the attention layers need (built by the model runner)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["PrefillSpan", "StepContext"]


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's prefill chunk in the flat batch.

    Attributes:
        start: index of its first new token in the flat batch.
        num_new: tokens computed this step (the queries).
        context_len: tokens in the cache once this step has stored its K/V (the keys).
        block_table: [num_blocks] int64 cache blocks of the sequence.
    """

    start: int
    num_new: int
    context_len: int
    block_table: torch.Tensor


@dataclass(slots=True)
class StepContext:
    """Attention metadata of one flat batch of N tokens.

    The first `num_decode` tokens are decode rows, one per sequence; prefill chunks follow.

    Attributes:
        slot_mapping: [N] int64, cache slot (block_id * block_size + offset) each token's K/V goes to.
        num_decode: number of decode rows.
        decode_block_tables: [num_decode, max_blocks] int64 (padding points at scratch block 0).
        decode_context_lens: [num_decode] int64, keys per decode row including its new token.
        decode_shared_prefix: [1] int64, cascade attention: the leading keys (whole blocks) that
            every decode row reads from the same cache blocks, `decode_block_tables[0]`'s (0:
            none); None where cascade attention is off.
        prefill: the prefill chunks.
        prefill_key_slots: [Nk] int64, on GPU: the cache slots of every prefill chunk's keys
            (cached prefix and new tokens), chunk after chunk, for a packed varlen attention.
        cu_q, cu_k: [S + 1] int32 cumulative query and key lengths of the prefill chunks.
        max_q, max_k: their largest query and key lengths.
        prefill_block_tables: [Np, max_blocks] int64, each prefill token's sequence's blocks, and
        prefill_context_lens: [Np] int64, its keys (its position + 1): batch-invariant mode, where
            every prefill query runs the decode kernel as if decoded (layers/attention.py).
        prefill_query_blocks: [num_blocks, 2] int32, batch-invariant mode on GPU: (first prefill
            token, count) of each block of consecutive queries of one chunk that share an
            attention program; built by the first layer that needs it.
        routing_replay: [N, L_moe, k] int64 expert ids a mixture of experts routes each token to
            in each MoE layer instead of its router's top-k (rows of -1: its own), when scoring
            sampled sequences as the trainer replays them (Engine.score); None elsewhere.
    """

    slot_mapping: torch.Tensor
    num_decode: int
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    decode_shared_prefix: torch.Tensor | None = None
    prefill: list[PrefillSpan] = field(default_factory=list)
    prefill_key_slots: torch.Tensor | None = None
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    prefill_block_tables: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    prefill_query_blocks: torch.Tensor | None = None
    routing_replay: torch.Tensor | None = None
