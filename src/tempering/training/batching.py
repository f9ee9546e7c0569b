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

Shared prompts (`pack_sequences(share_prefixes=True)`): the trajectories of an RL group usually
start with the same prompt (system prompt, tools, worked examples, the question), often most of
their tokens. Sequences whose tokens before their first trained token are identical are packed
as that prompt once, followed by each one's own remainder (a "suffix"). The prompt is a
segment of its own; each suffix's queries attend to the prompt's keys and then to their own,
causally (the key index list `key_index`, with `cu_keys`), with the positions they have in
their own sequence, and the first token of each suffix is predicted from the prompt's last
position. The gradient that flows into the prompt's keys and values is the sum over the
suffixes, as it would be with each sequence computed whole; every trained token keeps its own
advantage, weight and sampled logprob. The forward and backward then cost one prompt per group
instead of one per trajectory.
"""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from .tokenize import TokenizedSequence

__all__ = ["MicroBatch", "Row", "RowShape", "pack_sequences"]


@dataclass(frozen=True, slots=True)
class RowShape:
    """The static sizes of a padded row.

    Attributes:
        num_tokens: T, tokens in the row.
        num_predictions: N, trained tokens (predictions) the loss is computed on.
        num_segments: S, attention segments (sequences, shared prompts and padding ones included);
            cu_seq_lens has S + 1.
        max_seq_len: L, the longest segment.
        num_keys: K, entries of `key_index` in a row with shared prompts (0: a row without).
        max_key_len: the most keys of a segment in a row with shared prompts (0: a row without).
    """

    num_tokens: int
    num_predictions: int
    num_segments: int
    max_seq_len: int
    num_keys: int = 0
    max_key_len: int = 0

    @classmethod
    def bucket(cls, micro: MicroBatch, *, min_tokens: int = 256) -> RowShape:
        """The smallest bucketed shape that `micro` fits: tokens and the longest segment rounded up to
        powers of two, predictions to a multiple of T/8; few shapes (few CUDA graphs) across a run,
        at most 2× padding. With shared prompts, the key entries (the row's, then one per padding
        token) and the most keys of a segment are rounded up to powers of two too."""
        T = _pow2(max(micro.num_tokens, min_tokens))
        L = min(_pow2(max(micro.max_seq_len, 128)), T)
        step = max(T // 8, 64)  # predictions: a multiple of T/8 (the LM head is a tenth of the step)
        N = min(-(-max(int(micro.loss_mask[0, 1:].sum()), 1) // step) * step, T)
        num_padding_segments = -(-(T - micro.num_tokens) // L)
        # one spare segment slot: padding predictions get a sequence index of their own
        S = _pow2(micro.num_segments + num_padding_segments + 1)  # num_segments >= len(micro.sequences)
        if not micro.shares_prefixes:
            return cls(T, N, S, L)
        K = _pow2(len(micro.key_index) + T - micro.num_tokens)  # padding segments attend to themselves
        return cls(T, N, S, L, K, max(_pow2(micro.max_key_len), L))

    @classmethod
    def padded(cls, micro: MicroBatch, multiple: int) -> RowShape:
        """`micro`'s own sizes with its tokens padded up to a multiple of `multiple` (one padding
        segment of fewer than `multiple` tokens): a row that a tensor-parallel trainer splits
        evenly over its ranks (sequence parallelism)."""
        T = -(-micro.num_tokens // multiple) * multiple
        padding = T - micro.num_tokens
        L = max(micro.max_seq_len, padding, 1)
        N = max(int(micro.loss_mask[0].sum()), 1)
        S = micro.num_segments + (1 if padding else 0) + 1  # one spare segment slot, as `bucket`
        if not micro.shares_prefixes:
            return cls(T, N, S, L)
        return cls(T, N, S, L, len(micro.key_index) + padding, max(micro.max_key_len, L))


@dataclass(slots=True)
class Row:
    """One packed row as flat tensors: the input of the trainer's forward and loss.

    Attributes:
        input_ids: [T] int64 token ids.
        position_ids: [T] int64, each token's position in its own sequence.
        cu_seq_lens: [S + 1] int32 cumulative segment lengths (the attention's queries).
        max_seq_len: the longest segment, tokens.
        key_index: [K] int64 row index of each segment's attention keys, segment after segment,
            when some segment attends to a shared prompt; None: each segment attends to itself.
        cu_keys: [S + 1] int32 cumulative key counts (with key_index).
        max_key_len: the most keys of a segment (with key_index; 0 otherwise).
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
        routed_experts: [T, L_moe, k] int16 experts each token was routed to when sampled (-1:
            unknown, the model routes it itself), for a mixture of experts' routing replay; None
            when no sequence of the row carries them.
        exact_logprobs: [N] float32 the engine's recomputed logprob of each target (0 on padding),
            when every sequence of the row has them (TokenizedSequence.exact_logprobs); else None.
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
    key_index: torch.Tensor | None = None
    cu_keys: torch.Tensor | None = None
    max_key_len: int = 0
    routed_experts: torch.Tensor | None = None
    exact_logprobs: torch.Tensor | None = None

    @property
    def keys(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(key_index, cu_keys, max_key_len) when segments attend to shared prompts, else None."""
        return (self.key_index, self.cu_keys, self.max_key_len) if self.key_index is not None else None

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
        position_ids: int64, each token's position in its own sequence.
        loss_mask: bool, True on tokens to train on (never the first token of a sequence).
        sampled_logprobs: float32 (nan outside loss_mask).
        advantages: float32, each sequence's advantage on all its tokens.
        temperature: float32, each token's logprob temperature.
        token_weight: float32, each trained token's weight in the loss (set by the trainer).
        seq_index: int64, index of the token's sequence in `sequences` (-1 on a shared prompt).
        predictor: int64, the row position whose hidden state predicts the token (-1: none).
        cu_seq_lens: [S + 1] int32 cumulative segment lengths (0, len_0, len_0 + len_1, ...).
        routed_experts: [T, L_moe, k] int16 (see `Row`), or None.
        max_seq_len: the longest segment.
        key_index, cu_keys, max_key_len: see `Row` (None, None, 0 without shared prompts).
        sequences: the packed TokenizedSequences, in row order.

    Args:
        sequences: the row's sequences.
        weights: per-sequence weight of each trained token.
        groups: [(prefix, members)]: the members (indices into `sequences`) share their first
            `prefix` tokens, which the row holds once (prefix 0: each member on its own). None:
            every sequence on its own. Members of a group with a prefix must have no trained
            token among those `prefix` tokens, and at least one token after them.
    """

    def __init__(self, sequences: Sequence[TokenizedSequence], weights: Sequence[float] | None = None,
                 groups: Sequence[tuple[int, Sequence[int]]] | None = None) -> None:
        self.sequences = list(sequences)
        if groups is None:
            groups = [(0, [i]) for i in range(len(self.sequences))]
        w = list(weights) if weights is not None else [0.0] * len(self.sequences)
        # flat lists first, one tensor per field: per-sequence tensors cost a step milliseconds of host time
        ids: list[int] = []
        positions: list[int] = []
        mask: list[bool] = []
        sampled: list[float] = []
        exact: list[float] = []  # with every sequence's exact_logprobs
        has_exact = all(s.exact_logprobs is not None for s in self.sequences)
        temperature: list[float] = []
        advantages: list[float] = []
        token_weight: list[float] = []
        seq_index: list[int] = []
        predictor: list[int] = []
        segments: list[int] = []  # query segment lengths
        keys: list[tuple[int, int, int]] = []  # per segment: (its prompt's start, prompt length, its own start)
        routed = next((s.routed_experts for s in self.sequences if s.routed_experts is not None), None)
        routing: list[np.ndarray] = []  # pieces of routed_experts in row order (when some sequence has them)

        def routing_of(s: TokenizedSequence, start: int, stop: int) -> np.ndarray:
            if s.routed_experts is not None:
                return s.routed_experts[start:stop]
            return np.full((stop - start, *routed.shape[1:]), -1, dtype=np.int16)

        shared = False
        for prefix, members in groups:
            prompt_start = len(ids)
            if prefix:
                shared = True
                first = self.sequences[members[0]]
                assert all(self.sequences[m].token_ids[:prefix] == first.token_ids[:prefix] for m in members)
                ids += first.token_ids[:prefix]
                positions += range(prefix)
                mask += [False] * prefix
                sampled += [math.nan] * prefix
                if has_exact:
                    exact += [math.nan] * prefix
                temperature += [1.0] * prefix
                advantages += [0.0] * prefix
                token_weight += [0.0] * prefix
                seq_index += [-1] * prefix
                predictor += [-1, *range(prompt_start, prompt_start + prefix - 1)]
                segments.append(prefix)
                keys.append((prompt_start, 0, prompt_start))
                if routed is not None:  # the prompt's tokens as its first member computed them
                    routing.append(routing_of(first, 0, prefix))
            for m in members:
                s = self.sequences[m]
                assert not any(s.loss_mask[:prefix]) and len(s) > prefix, "a shared prompt must hold no trained token"
                start, n = len(ids), len(s) - prefix
                ids += s.token_ids[prefix:]
                positions += range(prefix, len(s))
                mask += ([False] if not prefix else []) + s.loss_mask[prefix + (not prefix):]
                sampled += s.sampled_logprobs[prefix:]
                if has_exact:
                    exact += s.exact_logprobs[prefix:]
                temperature += s.temperatures[prefix:]
                advantages += [s.advantage] * n
                token_weight += [w[m]] * n
                seq_index += [m] * n
                # a sequence's first token is never predicted; a suffix's first token is, from the prompt's end
                predictor += [prompt_start + prefix - 1 if prefix else -1, *range(start, start + n - 1)]
                segments.append(n)
                keys.append((prompt_start, prefix, start))
                if routed is not None:
                    routing.append(routing_of(s, prefix, len(s)))
        self.input_ids = _tensor(ids, "q")[None]
        self.position_ids = _tensor(positions, "q")[None]
        self.loss_mask = _tensor(mask, "b").bool()[None]
        self.sampled_logprobs = _tensor(sampled, "f")[None]
        self.exact_logprobs = _tensor(exact, "f")[None] if has_exact else None
        self.advantages = _tensor(advantages, "f")[None]
        self.temperature = _tensor(temperature, "f")[None]
        self.token_weight = _tensor(token_weight, "f")[None]
        self.seq_index = _tensor(seq_index, "q")[None]
        self.predictor = _tensor(predictor, "q")[None]
        self.num_tokens = len(ids)
        self.routed_experts = torch.from_numpy(np.concatenate(routing)) if routed is not None else None
        self.cu_seq_lens = torch.tensor([0] + segments, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.max_seq_len = max(segments)
        self.key_index = self.cu_keys = None
        self.max_key_len = 0
        if shared:  # each segment's keys: its prompt's (if any), then its own
            index: list[int] = []
            counts = []
            for (prompt_start, prefix, start), n in zip(keys, segments):
                index += [*range(prompt_start, prompt_start + prefix), *range(start, start + n)]
                counts.append(prefix + n)
            self.key_index = _tensor(index, "q")
            self.cu_keys = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
            self.max_key_len = max(counts)

    @property
    def shares_prefixes(self) -> bool:
        """Whether some sequences of the row share a prompt."""
        return self.key_index is not None

    @property
    def num_segments(self) -> int:
        """Attention segments of the row: its sequences, or its shared prompts and their suffixes."""
        return len(self.cu_seq_lens) - 1

    def row(self, shape: RowShape | None = None) -> Row:
        """The flat tensors of this row (on the CPU), padded to `shape` when given.

        Raises:
            ValueError: if the row does not fit `shape`.
        """
        targets = self.loss_mask[0].nonzero()[:, 0]  # trained tokens (row positions)
        n, T, S = len(targets), self.num_tokens, len(self.sequences)

        def at_targets(t: torch.Tensor) -> torch.Tensor:
            return t[0].index_select(0, targets)

        row = Row(
            input_ids=self.input_ids[0], position_ids=self.position_ids[0], cu_seq_lens=self.cu_seq_lens,
            max_seq_len=self.max_seq_len, pred_positions=at_targets(self.predictor), targets=at_targets(self.input_ids),
            sampled_logprobs=at_targets(self.sampled_logprobs), advantages=at_targets(self.advantages),
            exact_logprobs=at_targets(self.exact_logprobs) if self.exact_logprobs is not None else None,
            temperature=at_targets(self.temperature), weights=at_targets(self.token_weight),
            seq_index=at_targets(self.seq_index), valid=torch.ones(n, dtype=torch.bool), num_seqs=S, num_valid=n,
            key_index=self.key_index, cu_keys=self.cu_keys, max_key_len=self.max_key_len,
            routed_experts=self.routed_experts,
        )
        if shape is None:
            return row
        L = shape.max_seq_len
        padding = shape.num_tokens - T
        segments = [min(L, padding - i) for i in range(0, padding, L)]  # padding as segments of at most L
        num_real = self.num_segments + len(segments)  # segments with tokens (at least S: the spare one is S's)
        keys = len(self.key_index) + padding if self.shares_prefixes else 0
        if (padding < 0 or n > shape.num_predictions or self.max_seq_len > L or num_real + 1 > shape.num_segments
                or self.shares_prefixes != (shape.num_keys > 0)
                or keys > shape.num_keys or self.max_key_len > shape.max_key_len):
            raise ValueError(f"a row of {T} tokens, {n} predictions, {self.num_segments} segments up to "
                             f"{self.max_seq_len} tokens, {keys} key entries does not fit {shape}")
        positions = [torch.arange(k) for k in segments]
        lengths = torch.tensor(segments, dtype=torch.int32).cumsum(0) if segments else torch.zeros(0, dtype=torch.int32)
        fill = shape.num_segments - num_real  # empty segments up to the static count
        row.input_ids = _pad(row.input_ids, shape.num_tokens, 0)
        if row.routed_experts is not None:  # padding tokens route by themselves
            tail = row.routed_experts.new_full((padding, *row.routed_experts.shape[1:]), -1)
            row.routed_experts = torch.cat([row.routed_experts, tail])
        row.position_ids = torch.cat([row.position_ids, *positions])
        row.cu_seq_lens = torch.cat([row.cu_seq_lens, (lengths + T).to(torch.int32),
                                     torch.full((fill,), shape.num_tokens, dtype=torch.int32)])
        row.max_seq_len = L
        if self.shares_prefixes:  # padding segments attend to their own tokens; entries past the last are not read
            own = torch.arange(T, shape.num_tokens, dtype=torch.int64)
            row.key_index = _pad(torch.cat([self.key_index, own]), shape.num_keys, 0)
            row.cu_keys = torch.cat([self.cu_keys, (lengths + self.cu_keys[-1]).to(torch.int32),
                                     torch.full((fill,), keys, dtype=torch.int32)])
            row.max_key_len = shape.max_key_len
        N = shape.num_predictions
        row.num_seqs = shape.num_segments  # indices 0..S-1 are real sequences; the last one takes the padding
        if row.exact_logprobs is not None:
            row.exact_logprobs = _pad(row.exact_logprobs, shape.num_predictions, 0.0)
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
    sequences: Sequence[TokenizedSequence], *, max_tokens: int, weights: Sequence[float] | None = None,
    share_prefixes: bool = False, min_shared_tokens: int = 16,
) -> list[MicroBatch]:
    """First-fit-decreasing packing into rows of at most `max_tokens` tokens.

    Args:
        sequences: the sequences to pack.
        max_tokens: token budget of one row (one forward/backward pass).
        weights: per-sequence weight of each trained token (same order as `sequences`).
        share_prefixes: hold the prompt of sequences whose tokens before their first trained
            token are identical (an RL group's) once per row (see the module docstring). A group
            that fits no row's room whole is split over the rows that have room, each piece
            holding its own copy of the prompt, so that rows stay full.
        min_shared_tokens: shorter prompts are not shared.
    """
    units = _prompt_groups(sequences, max_tokens, min_shared_tokens) if share_prefixes else \
        [(0, [i], len(s)) for i, s in enumerate(sequences)]
    rows: list[list[tuple[int, list[int]]]] = []  # per row: its (prefix, members) pieces
    room: list[int] = []
    for prefix, members, n in sorted(units, key=lambda u: u[2], reverse=True):
        r = next((r for r, free in enumerate(room) if n <= free), None)
        if r is None and prefix:  # a group that fits no row whole: fill the rows that have room with pieces of it
            suffix = {m: len(sequences[m]) - prefix for m in members}
            for k, free in enumerate(room):
                piece, size = [], prefix
                for m in members:
                    if size + suffix[m] <= free:
                        piece.append(m)
                        size += suffix[m]
                if piece:
                    rows[k].append((prefix, piece) if len(piece) > 1 else (0, piece))
                    room[k] -= size
                    taken = set(piece)
                    members = [m for m in members if m not in taken]
                    if not members:
                        break
            if not members:
                continue
            n = prefix + sum(suffix[m] for m in members)
            prefix = prefix if len(members) > 1 else 0
        if r is None:
            rows.append([])
            room.append(max_tokens)
            r = len(rows) - 1
        rows[r].append((prefix, members))
        room[r] = max(room[r] - n, 0)
    batches = []
    for row in rows:
        members = [m for _, piece in row for m in piece]
        local = {m: j for j, m in enumerate(members)}
        groups = [(prefix, [local[m] for m in piece]) for prefix, piece in row]
        batches.append(MicroBatch([sequences[m] for m in members],
                                  [weights[m] for m in members] if weights is not None else None, groups))
    return batches


def _prompt_groups(sequences: Sequence[TokenizedSequence], max_tokens: int, min_shared: int
                   ) -> list[tuple[int, list[int], int]]:
    """Packing units (prefix, members, tokens): sequences with the same prompt (the tokens before
    their first trained token, at least `min_shared` of them) as groups that hold it once, split so
    that a group fits `max_tokens`; every other sequence on its own."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    units = []
    for i, s in enumerate(sequences):
        first = s.loss_mask.index(True) if True in s.loss_mask else len(s)
        if min_shared <= first < len(s):
            by_prompt.setdefault(tuple(s.token_ids[:first]), []).append(i)
        else:
            units.append((0, [i], len(s)))
    for prompt, members in by_prompt.items():
        p = len(prompt)
        chunk, size = [], p
        for m in members:
            n = len(sequences[m]) - p
            if chunk and size + n > max_tokens:
                units.append((p, chunk, size) if len(chunk) > 1 else (0, chunk, len(sequences[chunk[0]])))
                chunk, size = [], p
            chunk.append(m)
            size += n
        units.append((p, chunk, size) if len(chunk) > 1 else (0, chunk, len(sequences[chunk[0]])))
    return units
