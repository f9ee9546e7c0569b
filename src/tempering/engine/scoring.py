"""Teacher-forced logprobs of given sequences, computed by the engine's own forward (Engine.score).

In batch-invariant mode (EngineConfig.batch_invariant) every token's forward is the same
operations whatever shares its batch, and a prefill query runs the decode kernel: scoring a
sampled sequence in one prefill recomputes, bit for bit, the logprob that each of its tokens
was sampled with. The trainer takes these values as the logprobs of its objective (their
gradient comes from its own differentiable forward), so the first update of a step is exactly
on-policy: importance ratio 1.0 for every token, not 1 ± rounding.

Each call allocates a private KV cache for its sequences (nothing is shared with the running
requests' cache) and runs the model in chunks of at most `max_tokens` tokens under the engine's
lock, between two engine steps.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .context import PrefillSpan, StepContext
from .lora import EngineAdapter, LoRASegment
from .sampler import token_logprobs

__all__ = ["score_sequences"]


@torch.inference_mode()
def score_sequences(model, sequences: list[list[int]], temperatures: list[list[float]],
                    adapter: EngineAdapter | None, *, block_size: int = 16, max_tokens: int = 8192,
                    bind: Callable[[list[LoRASegment], int], object] | None = None,
                    routed_experts: list[np.ndarray | None] | None = None) -> list[list[float]]:
    """log softmax(logits_{t-1} / T_t)[token_t] for t = 1..len-1 of every sequence.

    Args:
        model: the engine's decoder (forward over a paged KV cache, `logits`).
        sequences: token ids, each at least 2 long.
        temperatures: per sequence and token, the temperature of that token's logprob (entry 0 unused).
        adapter: the LoRA to apply to every row, or None (the base model).
        block_size: KV-cache block size of the private cache.
        max_tokens: tokens per forward (whole sequences; a longer one runs alone).
        bind: the model's `bind_lora`, called before each forward with an adapter.
        routed_experts: per sequence, [len, L_moe, k] expert ids to route its tokens to (a mixture
            of experts; -1 rows: its router's own) or None, as the trainer replays them.

    Returns:
        per sequence, len - 1 float32 logprobs.
    """
    out: list[list[float]] = [[] for _ in sequences]
    routing = routed_experts if routed_experts is not None else [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    batch: list[int] = []
    for i in order:
        if batch and sum(len(sequences[j]) for j in batch) + len(sequences[i]) > max_tokens:
            _score_batch(model, [sequences[j] for j in batch], [temperatures[j] for j in batch], adapter, block_size,
                         bind, [out[j] for j in batch], [routing[j] for j in batch])
            batch = []
        batch.append(i)
    if batch:
        _score_batch(model, [sequences[j] for j in batch], [temperatures[j] for j in batch], adapter, block_size, bind,
                     [out[j] for j in batch], [routing[j] for j in batch])
    return out


def _score_batch(model, seqs: list[list[int]], temps: list[list[float]], adapter: EngineAdapter | None,
                 block_size: int, bind, outs: list[list[float]], routing: list[np.ndarray | None]) -> None:
    device = model.device
    lengths = [len(s) for s in seqs]
    blocks = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks) + 1  # block 0: the scratch block padding points at
    kv_cache = torch.zeros(model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim,
                           dtype=model.dtype, device=device)
    tables, first = [], 1
    for b in blocks:
        tables.append(np.arange(first, first + b, dtype=np.int64))
        first += b
    width = max(blocks)
    ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    slots = np.concatenate([t[np.arange(n) // block_size] * block_size + np.arange(n) % block_size
                            for t, n in zip(tables, lengths)])
    padded = np.stack([np.pad(t, (0, width - len(t))) for t in tables])
    token_tables = np.repeat(padded, lengths, axis=0)  # [T, width]: each token's sequence's blocks
    spans, start = [], 0
    for t, n in zip(tables, lengths):
        spans.append(PrefillSpan(start, n, n, torch.from_numpy(t).to(device)))
        start += n
    ctx = StepContext(slot_mapping=torch.from_numpy(slots).to(device), num_decode=0, prefill=spans,
                      prefill_block_tables=torch.from_numpy(token_tables).to(device),
                      prefill_context_lens=torch.from_numpy(positions + 1).to(device))
    known = [r for r in routing if r is not None]
    if known:  # replayed routing, -1 (the router's own) for a sequence without it
        rows = [np.asarray(r, dtype=np.int64) if r is not None else np.full((n, *known[0].shape[1:]), -1, np.int64)
                for r, n in zip(routing, lengths)]
        ctx.routing_replay = torch.from_numpy(np.concatenate(rows)).to(device)
    if not getattr(model, "batch_invariant", False) or device.type != "cuda":  # the packed varlen path's metadata
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
        ctx.prefill_key_slots, ctx.cu_q, ctx.cu_k = ctx.slot_mapping, cu, cu
        ctx.max_q = ctx.max_k = max(lengths)
    T = len(ids)
    lora = [LoRASegment(0, T, adapter)] if adapter is not None else []
    if lora and bind is not None:
        bind(lora, T)
    hidden = model.forward(torch.from_numpy(ids).to(device), torch.from_numpy(positions).to(device), ctx, kv_cache,
                           lora)  # [T, H]
    # row r predicts token r + 1 of its sequence: every row but each sequence's last
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows = np.concatenate([np.arange(s, s + n - 1) for s, n in zip(starts, lengths)])
    targets = torch.from_numpy(np.concatenate([np.asarray(s[1:], dtype=np.int64) for s in seqs])).to(device)
    temperature = torch.tensor([t for ts in temps for t in ts[1:]], dtype=torch.float32, device=device)
    rows_t = torch.from_numpy(rows).to(device)
    values = []
    for c in range(0, len(rows), 1024):  # logits of 1,024 rows at a time
        logits = model.logits(hidden[rows_t[c:c + 1024]])  # [n, V] float32
        values.append(token_logprobs(logits, temperature[c:c + 1024], targets[c:c + 1024]))
    flat = torch.cat(values).tolist()
    k = 0
    for out, n in zip(outs, lengths):
        out.extend(flat[k:k + n - 1])
        k += n - 1
