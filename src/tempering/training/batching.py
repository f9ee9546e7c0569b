"""Sequences → packed micro-batches under a token budget.

Sequences are packed first-fit-decreasing into rows of at most `max_tokens` tokens (a longer
sequence gets a row of its own). Inside a row each sequence's position ids restart at 0, and the
row carries the cumulative sequence lengths that the packed attention (attention.py) uses, so a
token attends only to its own sequence (no cross-contamination) and no compute is spent on
padding. A row is one micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .tokenize import TokenizedSequence

__all__ = ["MicroBatch", "pack_sequences"]


class MicroBatch:
    """One packed row of T tokens holding several sequences.

    Attributes (all [1, T]):
        input_ids: int64.
        position_ids: int64, restarting at 0 at each sequence start.
        loss_mask: bool, True on tokens to train on (never the first token of a sequence).
        sampled_logprobs: float32 (nan outside loss_mask).
        advantages: float32, each sequence's advantage on all its tokens.
        temperature: float32, each token's logprob temperature.
        token_weight: float32, each trained token's weight in the loss (set by the trainer).
        seq_index: int64, index of the token's sequence in `sequences` (-1 on nothing).
        cu_seq_lens: [S + 1] int32 cumulative sequence lengths (0, len_0, len_0 + len_1, ...).
        max_seq_len: the longest packed sequence.
        sequences: the packed TokenizedSequences, in row order.
    """

    def __init__(self, sequences: Sequence[TokenizedSequence], weights: Sequence[float] | None = None) -> None:
        T = sum(len(s) for s in sequences)
        self.sequences = list(sequences)
        self.input_ids = torch.zeros(1, T, dtype=torch.long)
        self.position_ids = torch.zeros(1, T, dtype=torch.long)
        self.loss_mask = torch.zeros(1, T, dtype=torch.bool)
        self.sampled_logprobs = torch.full((1, T), float("nan"))
        self.advantages = torch.zeros(1, T)
        self.temperature = torch.ones(1, T)
        self.token_weight = torch.zeros(1, T)
        self.seq_index = torch.full((1, T), -1, dtype=torch.long)
        start = 0
        for i, s in enumerate(self.sequences):
            n = len(s)
            end = start + n
            self.input_ids[0, start:end] = torch.tensor(s.token_ids)
            self.position_ids[0, start:end] = torch.arange(n)
            mask = torch.tensor(s.loss_mask)
            mask[0] = False  # a sequence's first token is never predicted from the previous sequence
            self.loss_mask[0, start:end] = mask
            self.sampled_logprobs[0, start:end] = torch.tensor(s.sampled_logprobs)
            self.advantages[0, start:end] = s.advantage
            self.temperature[0, start:end] = torch.tensor(s.temperatures)
            self.token_weight[0, start:end] = weights[i] if weights is not None else 0.0
            self.seq_index[0, start:end] = i
            start = end
        self.num_tokens = T
        lengths = [len(s) for s in self.sequences]
        self.cu_seq_lens = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32)
        self.max_seq_len = max(lengths)

    def to(self, device: torch.device) -> MicroBatch:
        for name in ("input_ids", "position_ids", "loss_mask", "sampled_logprobs", "advantages", "temperature",
                     "token_weight", "seq_index", "cu_seq_lens"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def pack_sequences(
    sequences: Sequence[TokenizedSequence], *, max_tokens: int, weights: Sequence[float] | None = None
) -> list[MicroBatch]:
    """First-fit-decreasing packing into rows of at most `max_tokens` tokens.

    Args:
        sequences: the sequences to pack.
        max_tokens: token budget of one row (one forward/backward pass).
        weights: per-sequence weight of each trained token (same order as `sequences`).
    """
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]), reverse=True)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = len(sequences[i])
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max(max_tokens - n, 0))
    return [
        MicroBatch([sequences[i] for i in row], [weights[i] for i in row] if weights is not None else None)
        for row in rows
    ]
