"""Sequences → padded micro-batches under a token budget."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .tokenize import TokenizedSequence

__all__ = ["MicroBatch", "make_micro_batches"]


class MicroBatch:
    """B sequences right-padded to length T.

    Attributes:
        input_ids: [B, T] int64 (padding is token 0, masked out).
        attention_mask: [B, T] int64, 1 on real tokens.
        loss_mask: [B, T] bool, True on tokens to train on (never on padding).
        sampled_logprobs: [B, T] float32 (nan outside loss_mask).
        advantages: [B, T] float32, each sequence's advantage on all its tokens.
        temperature: [B, T] float32, each sequence's logprob temperature.
    """

    def __init__(self, sequences: Sequence[TokenizedSequence]) -> None:
        B, T = len(sequences), max(len(s) for s in sequences)
        self.input_ids = torch.zeros(B, T, dtype=torch.long)
        self.attention_mask = torch.zeros(B, T, dtype=torch.long)
        self.loss_mask = torch.zeros(B, T, dtype=torch.bool)
        self.sampled_logprobs = torch.full((B, T), float("nan"))
        self.advantages = torch.zeros(B, T)
        self.temperature = torch.ones(B, T)
        for b, s in enumerate(sequences):
            n = len(s)
            self.input_ids[b, :n] = torch.tensor(s.token_ids)
            self.attention_mask[b, :n] = 1
            self.loss_mask[b, :n] = torch.tensor(s.loss_mask)
            self.sampled_logprobs[b, :n] = torch.tensor(s.sampled_logprobs)
            self.advantages[b, :n] = s.advantage
            self.temperature[b, :n] = s.temperature
        self.num_tokens = int(self.attention_mask.sum())

    def to(self, device: torch.device) -> MicroBatch:
        for name in ("input_ids", "attention_mask", "loss_mask", "sampled_logprobs", "advantages", "temperature"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def make_micro_batches(sequences: Sequence[TokenizedSequence], *, max_tokens: int) -> list[MicroBatch]:
    """Group sequences of similar length so that B × T (padded tokens) stays <= max_tokens.

    A sequence longer than max_tokens gets a micro-batch of its own.
    """
    ordered = sorted(sequences, key=len, reverse=True)
    batches, current = [], []
    for seq in ordered:
        width = len(current[0]) if current else len(seq)  # sorted: the first is the longest
        if current and (len(current) + 1) * width > max_tokens:
            batches.append(MicroBatch(current))
            current = []
        current.append(seq)
    if current:
        batches.append(MicroBatch(current))
    return batches
