"""Attention over the paged KV cache, in plain PyTorch (the CPU path and the reference).

The cache of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V.
A token's K/V lives at slot `block_id * block_size + offset`.

Decode rows (one query each) are batched: their blocks are gathered into a padded
`[B, max_blocks * block_size]` key range and one SDPA call with a length mask attends over it.
Prefill chunks attend one sequence at a time, causally, over the cached prefix and themselves
(queries are aligned to the end of the keys: lower-right causal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..context import StepContext

__all__ = ["paged_attention", "store_kv"]


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [N, kv_heads, D] into the caches at `slot_mapping` [N]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The cache rows of `block_table` [..., nb] → [..., nb * block_size, kv_heads, D]."""
    blocks = cache[block_table]  # [..., nb, bs, kvh, D]
    return blocks.flatten(-4, -3)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext, scale: float) -> torch.Tensor:
    """Softmax attention of the batch's queries over the cache.

    Args:
        q: [N, num_heads, D] queries of the flat batch.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, D], already holding this step's K/V.
        ctx: where each row's keys are.
        scale: softmax scale (1/sqrt(D) for these models).

    Returns:
        [N, num_heads, D].
    """
    out = torch.empty_like(q)
    B = ctx.num_decode
    if B:
        keys = _gather(k_cache, ctx.decode_block_tables).transpose(1, 2)  # [B, kvh, T, D]
        values = _gather(v_cache, ctx.decode_block_tables).transpose(1, 2)
        T = keys.shape[2]
        mask = torch.arange(T, device=q.device)[None, :] < ctx.decode_context_lens[:, None]  # [B, T]
        o = F.scaled_dot_product_attention(
            q[:B, :, None, :], keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )  # [B, H, 1, D]
        out[:B] = o[:, :, 0, :]
    for span in ctx.prefill:
        queries = q[span.start:span.start + span.num_new].transpose(0, 1)[None]  # [1, H, Lq, D]
        num_blocks = -(-span.context_len // k_cache.shape[1])
        keys = _gather(k_cache, span.block_table[:num_blocks])[: span.context_len].transpose(0, 1)[None]  # [1, kvh, Lk, D]
        values = _gather(v_cache, span.block_table[:num_blocks])[: span.context_len].transpose(0, 1)[None]
        if span.num_new == span.context_len:
            o = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:  # queries are the last num_new positions: lower-right causal
            offset = span.context_len - span.num_new
            rows = torch.arange(span.num_new, device=q.device)[:, None] + offset
            mask = torch.arange(span.context_len, device=q.device)[None, :] <= rows
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[span.start:span.start + span.num_new] = o[0].transpose(0, 1)
    return out
