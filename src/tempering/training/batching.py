"""Sequences → packed micro-batches under a token budget.

Sequences are packed first-fit-decreasing into rows of at most `max_tokens` tokens (a longer
sequence gets a row of its own). Inside a row each sequence's position ids restart at 0, and the
row carries the cumulative sequence lengths that the packed attention (attention.py) uses, so a
token attends only to its own sequence (no cross-contamination) and no compute is spent on
padding. A row is one micro-batch.

`MicroBatch.row()` gives the flat tensors the loss is computed on (`Row`): the row's tokens and,
for each trained token, the position that predicts it with its target, sampled logprob,
advantage, temperature and loss weight. `MicroBatch.row(shape)` pads them to a fixed `RowShape`,
so that a forward/backward captured once as a CUDA graph can be replayed for any row that fits
(cuda_graphs.py): padding tokens form sequences of their own (no real token attends to them),
padding predictions carry weight 0 and finite stand-in values, and neither changes the loss or
the gradient.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from .tokenize import TokenizedSequence

__all__ = ["MicroBatch", "Row", "RowShape", "pack_sequences"]


@dataclass(frozen=True, slots=True)
class RowShape:
    """The static sizes of a padded row.

    Attributes:
        num_tokens: T, tokens in the row.
        num_predictions: N, trained tokens (predictions) the loss is computed on.
        num_segments: S, attention segments (sequences, padding ones included); cu_seq_lens has S + 1.
        max_seq_len: L, the longest segment.
    """

    num_tokens: int
    num_predictions: int
    num_segments: int
    max_seq_len: int

    @classmethod
    def bucket(cls, micro: MicroBatch, *, min_tokens: int = 256) -> RowShape:
        """The smallest bucketed shape that `micro` fits: tokens and the longest segment rounded up to
        powers of two, predictions to a multiple of T/8; few shapes (few CUDA graphs) across a run,
        at most 2× padding."""
        T = _pow2(max(micro.num_tokens, min_tokens))
        L = min(_pow2(max(micro.max_seq_len, 128)), T)
        step = max(T // 8, 64)  # predictions: a multiple of T/8 (the LM head is a tenth of the step)
        N = min(-(-max(int(micro.loss_mask[0, 1:].sum()), 1) // step) * step, T)
        num_padding_segments = -(-(T - micro.num_tokens) // L)
        # one spare segment slot: padding predictions get a sequence index of their own
        S = _pow2(len(micro.sequences) + num_padding_segments + 1)
        return cls(T, N, S, L)


@dataclass(slots=True)
class Row:
    """One packed row as flat tensors: the input of the trainer's forward and loss.

    Attributes:
        input_ids: [T] int64 token ids.
        position_ids: [T] int64, restarting at 0 at each segment start.
        cu_seq_lens: [S + 1] int32 cumulative segment lengths.
        max_seq_len: the longest segment, tokens.
        pred_positions: [N] int64, the position whose hidden state predicts each trained token.
        targets: [N] int64 trained token ids.
        sampled_logprobs: [N] float32 logprob of each target at sampling time (0 on padding).
        advantages: [N] float32.
        temperature: [N] float32 (1 on padding).
        weights: [N] float32 loss weight of each prediction (0 on padding).
        seq_index: [N] int64 sequence of each prediction, in [0, num_seqs).
        valid: [N] bool, False on padding.
        num_seqs: number of sequence indices (real sequences, plus one for padding when padded).
        num_valid: the real predictions (N without padding).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_seq_len: int
    pred_positions: torch.Tensor
    targets: torch.Tensor
    sampled_logprobs: torch.Tensor
    advantages: torch.Tensor
    temperature: torch.Tensor
    weights: torch.Tensor
    seq_index: torch.Tensor
    valid: torch.Tensor
    num_seqs: int
    num_valid: int

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if torch.is_tensor(getattr(self, f.name))}

    def to(self, device: torch.device) -> Row:
        for name, t in self.tensors().items():
            setattr(self, name, t.to(device))
        return self


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


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
        self.sequences = list(sequences)
        lengths = [len(s) for s in self.sequences]
        # flat lists first, one tensor per field: per-sequence tensors cost a step milliseconds of host time
        ids: list[int] = []
        positions: list[int] = []
        mask: list[bool] = []
        sampled: list[float] = []
        temperature: list[float] = []
        for s, n in zip(self.sequences, lengths):
            ids += s.token_ids
            positions += range(n)
            mask += [False] + s.loss_mask[1:]  # a sequence's first token is never predicted from the previous one
            sampled += s.sampled_logprobs
            temperature += s.temperatures
        counts = torch.tensor(lengths)
        self.input_ids = _tensor(ids, "q")[None]
        self.position_ids = _tensor(positions, "q")[None]
        self.loss_mask = _tensor(mask, "b").bool()[None]
        self.sampled_logprobs = _tensor(sampled, "f")[None]
        self.advantages = torch.tensor([s.advantage for s in self.sequences], dtype=torch.float32).repeat_interleave(counts)[None]
        self.temperature = _tensor(temperature, "f")[None]
        self.token_weight = (torch.tensor(list(weights), dtype=torch.float32) if weights is not None
                             else torch.zeros(len(lengths))).repeat_interleave(counts)[None]
        self.seq_index = torch.arange(len(lengths)).repeat_interleave(counts)[None]
        self.num_tokens = sum(lengths)
        self.cu_seq_lens = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.max_seq_len = max(lengths)

    def row(self, shape: RowShape | None = None) -> Row:
        """The flat tensors of this row (on the CPU), padded to `shape` when given.

        Raises:
            ValueError: if the row does not fit `shape`.
        """
        pred_positions = self.loss_mask[0, 1:].nonzero()[:, 0]  # position t predicts token t + 1
        targets = pred_positions + 1
        n, T, S = len(pred_positions), self.num_tokens, len(self.sequences)

        def at_targets(t: torch.Tensor) -> torch.Tensor:
            return t[0].index_select(0, targets)

        row = Row(
            input_ids=self.input_ids[0], position_ids=self.position_ids[0], cu_seq_lens=self.cu_seq_lens,
            max_seq_len=self.max_seq_len, pred_positions=pred_positions, targets=at_targets(self.input_ids),
            sampled_logprobs=at_targets(self.sampled_logprobs), advantages=at_targets(self.advantages),
            temperature=at_targets(self.temperature), weights=at_targets(self.token_weight),
            seq_index=at_targets(self.seq_index), valid=torch.ones(n, dtype=torch.bool), num_seqs=S, num_valid=n,
        )
        if shape is None:
            return row
        L = shape.max_seq_len
        padding = shape.num_tokens - T
        segments = [min(L, padding - i) for i in range(0, padding, L)]  # padding as segments of at most L
        if padding < 0 or n > shape.num_predictions or self.max_seq_len > L or S + len(segments) + 1 > shape.num_segments:
            raise ValueError(f"a row of {T} tokens, {n} predictions, {S} sequences up to {self.max_seq_len} "
                             f"tokens does not fit {shape}")
        positions = [torch.arange(k) for k in segments]
        ends = torch.tensor(segments, dtype=torch.int32).cumsum(0) + T if segments else torch.zeros(0, dtype=torch.int32)
        fill = shape.num_segments + 1 - (S + 1 + len(segments))  # empty segments up to the static count
        row.input_ids = _pad(row.input_ids, shape.num_tokens, 0)
        row.position_ids = torch.cat([row.position_ids, *positions])
        row.cu_seq_lens = torch.cat([row.cu_seq_lens, ends.to(torch.int32),
                                     torch.full((fill,), shape.num_tokens, dtype=torch.int32)])
        row.max_seq_len = L
        N = shape.num_predictions
        row.num_seqs = shape.num_segments  # indices 0..S-1 are real sequences; the last one takes the padding
        for name, value in (("pred_positions", 0), ("targets", 0), ("sampled_logprobs", 0.0), ("advantages", 0.0),
                            ("temperature", 1.0), ("weights", 0.0), ("seq_index", shape.num_segments - 1),
                            ("valid", False)):
            setattr(row, name, _pad(getattr(row, name), N, value))
        return row


_DTYPES = {"q": torch.int64, "b": torch.int8, "f": torch.float32}


def _tensor(values: list, typecode: str) -> torch.Tensor:
    """A CPU tensor of a flat list through `array` (several times faster than torch.tensor on a list)."""
    if not values:
        return torch.zeros(0, dtype=_DTYPES[typecode])
    return torch.frombuffer(array.array(typecode, values), dtype=_DTYPES[typecode])


def _pad(t: torch.Tensor, size: int, value: float) -> torch.Tensor:
    return torch.cat([t, t.new_full((size - len(t),), value)])


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
