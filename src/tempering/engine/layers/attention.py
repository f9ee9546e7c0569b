"""Attention over the paged KV cache.

The cache of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V.
A token's K/V lives at slot `block_id * block_size + offset`. The flat batch holds decode rows
(one query each) first, then prefill chunks.

- CPU (and the reference): decode rows gather their blocks into a padded
  `[B, max_blocks * block_size]` key range and share one SDPA call with a length mask; each
  prefill chunk attends over its cached prefix and itself with one SDPA call, causally with the
  queries aligned to the end of the keys (lower-right).
- GPU: decode rows use the Triton paged kernel (no gather); prefill chunks use one packed
  `varlen_attn` call (see triton_attention.py).
- GPU, batch-invariant mode: decode rows and prefill queries run one kernel
  (`invariant_attention`), so that a query prefilled or scored equals it decoded, bit for bit.

A sliding window (Mistral, Gemma 3's local layers) limits each query to its last `window` keys,
as transformers' sliding-window mask: the query at position i sees the keys j with
i - window < j <= i. The cache still holds every key (all layers share one block table).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..context import StepContext

__all__ = ["paged_attention", "store_kv"]

try:  # the GPU kernels need Triton, which CPU builds of torch do not bring
    from .triton_attention import (
        invariant_attention, num_splits, paged_decode_attention, queries_per_block, varlen_prefill_attention,
    )
except ImportError:  # pragma: no cover - depends on the installation
    invariant_attention = num_splits = paged_decode_attention = queries_per_block = varlen_prefill_attention = None


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [N, kv_heads, D] into the caches at `slot_mapping` [N]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The cache rows of `block_table` [..., nb] → [..., nb * block_size, kv_heads, D]."""
    return cache[block_table].flatten(-4, -3)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext, scale: float,
                    window: int | None = None, *, batch_invariant: bool = False,
                    split_kv_heads: int | None = None) -> torch.Tensor:
    """Softmax attention of the batch's queries over the cache.

    Args:
        q: [N, num_heads, D] queries of the flat batch.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, D], already holding this step's K/V.
        ctx: where each row's keys are.
        scale: softmax scale (1/sqrt(D) for the Llama family).
        window: sliding attention window in tokens (see the module docstring); None: every key.
        batch_invariant: (CUDA) every query, decode or prefill, in one pass over its keys in 64-key
            tiles from the first, by one kernel: its result depends on nothing but its own keys
            (needs ctx.prefill_block_tables / prefill_context_lens for prefill rows).
        split_kv_heads: the KV-head count that sets the GPU decode kernel's split of each row's keys
            (default: this cache's). Under tensor parallelism the model's whole count, so that each
            head's sums run in the order one GPU would run them.

    Returns:
        [N, num_heads, D].
    """
    gpu = q.is_cuda and paged_decode_attention is not None
    if gpu and batch_invariant:
        return _invariant(q, k_cache, v_cache, ctx, scale, window)
    B = ctx.num_decode
    splits = num_splits(B, split_kv_heads) if gpu and split_kv_heads is not None else None
    shared = ctx.decode_shared_prefix if window is None else None  # cascade attention (not for sliding layers)
    if gpu and not ctx.prefill:  # the CUDA-graph path: no host work, no extra copy
        return paged_decode_attention(q, k_cache, v_cache, ctx.decode_block_tables, ctx.decode_context_lens, scale,
                                      window=window, num_splits=splits, shared_prefix=shared)
    out = torch.empty_like(q)
    if B and gpu:
        out[:B] = paged_decode_attention(q[:B], k_cache, v_cache, ctx.decode_block_tables, ctx.decode_context_lens,
                                         scale, window=window, num_splits=splits, shared_prefix=shared)
    elif B:
        out[:B] = _decode_sdpa(q[:B], k_cache, v_cache, ctx, scale, window)
    if ctx.prefill:
        if gpu and ctx.prefill_key_slots is not None:
            num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
            keys = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, ctx.prefill_key_slots)
            values = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, ctx.prefill_key_slots)
            out[B:] = varlen_prefill_attention(q[B:], keys, values, ctx.cu_q, ctx.cu_k, ctx.max_q, ctx.max_k, scale,
                                               window=window)
        else:
            _prefill_sdpa(q, k_cache, v_cache, ctx, scale, out, window)
    return out


def _invariant(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext,
               scale: float, window: int | None) -> torch.Tensor:
    B = ctx.num_decode
    if not ctx.prefill:  # the CUDA-graph path
        return invariant_attention(q, k_cache, v_cache, ctx.decode_block_tables, ctx.decode_context_lens, scale,
                                   window=window)
    out = torch.empty_like(q)
    if B:
        out[:B] = invariant_attention(q[:B], k_cache, v_cache, ctx.decode_block_tables, ctx.decode_context_lens, scale,
                                      window=window)
    if ctx.prefill_query_blocks is None:  # once per step, for every layer
        per_block = queries_per_block(q.shape[1], k_cache.shape[2])
        firsts, counts = [], []
        for span in ctx.prefill:
            starts = np.arange(0, span.num_new, per_block)
            firsts.append(span.start - B + starts)
            counts.append(np.minimum(per_block, span.num_new - starts))
        blocks = np.stack([np.concatenate(firsts), np.concatenate(counts)], axis=1).astype(np.int32)
        ctx.prefill_query_blocks = torch.from_numpy(blocks).to(q.device)
    out[B:] = invariant_attention(q[B:], k_cache, v_cache, ctx.prefill_block_tables, ctx.prefill_context_lens, scale,
                                  ctx.prefill_query_blocks, window=window)
    return out


def _decode_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext, scale: float,
                 window: int | None = None) -> torch.Tensor:
    keys = _gather(k_cache, ctx.decode_block_tables).transpose(1, 2)  # [B, kvh, T, D]
    values = _gather(v_cache, ctx.decode_block_tables).transpose(1, 2)
    T = keys.shape[2]
    lens = ctx.decode_context_lens[:, None]  # [B, 1]; the query sits at position len - 1
    t = torch.arange(T, device=q.device)[None, :]
    mask = t < lens if window is None else (t < lens) & (t >= lens - window)  # [B, T]
    o = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )  # [B, H, 1, D]
    return o[:, :, 0, :]


def _prefill_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext, scale: float,
                  out: torch.Tensor, window: int | None = None) -> None:
    block_size = k_cache.shape[1]
    for span in ctx.prefill:
        queries = q[span.start:span.start + span.num_new].transpose(0, 1)[None]  # [1, H, Lq, D]
        num_blocks = -(-span.context_len // block_size)
        table = span.block_table[:num_blocks]
        keys = _gather(k_cache, table)[: span.context_len].transpose(0, 1)[None]  # [1, kvh, Lk, D]
        values = _gather(v_cache, table)[: span.context_len].transpose(0, 1)[None]
        slides = window is not None and window < span.context_len
        if span.num_new == span.context_len and not slides:
            o = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:  # queries are the last num_new positions: lower-right causal
            offset = span.context_len - span.num_new
            rows = torch.arange(span.num_new, device=q.device)[:, None] + offset
            cols = torch.arange(span.context_len, device=q.device)[None, :]
            mask = (cols <= rows) & (cols > rows - window) if slides else cols <= rows
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[span.start:span.start + span.num_new] = o[0].transpose(0, 1)
