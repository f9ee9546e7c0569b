"""GPU attention kernels: paged decode in Triton, packed prefill with PyTorch's varlen_attn.

Decode (one query per sequence) reads K/V straight from the paged cache, with no gather: a
split-K kernel whose grid is (rows, kv_heads, splits) processes every query head of one KV
head together (one `tl.dot` per tile of 64 keys, gathered from several pages through the block
table), walks its share of the sequence with an online softmax in base 2, and writes a partial
output and log-sum-exp; a second kernel merges the splits. Rows with context length 0 (padding of a CUDA-graph bucket) exit at
once. The grid depends only on the batch bucket, so the kernel can be captured in a CUDA graph.
Design after lightllm/SGLang's grouped decode kernels and vLLM's block-table addressing (see
reference/ENGINE_NOTES.md, section 2); the code is ours.

Prefill chunks gather their keys (cached prefix + new tokens) into one packed buffer and call
`torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 inside PyTorch >= 2.10), causal with
queries aligned to the end of their keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["HAS_VARLEN", "paged_decode_attention", "varlen_prefill_attention"]

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10: prefill falls back to one SDPA call per chunk
    varlen_attn = None

HAS_VARLEN = varlen_attn is not None


def num_splits(batch_size: int, num_kv_heads: int) -> int:
    """Splits of each row's keys: enough programs to fill the GPU at small batches, few at large ones.

    The count depends only on the batch bucket (a CUDA graph fixes the grid); a split with no
    keys exits at once.
    """
    programs = batch_size * num_kv_heads
    return max(1, min(16, triton.next_power_of_2(max(1, 1024 // programs))))


@triton.jit
def _decode_split_kernel(
    Q, K, V, BlockTables, ContextLens, OutPartial, LsePartial,
    scale, window,
    stride_qb, stride_qh,
    stride_kb, stride_kp, stride_kh,
    stride_vb, stride_vp, stride_vh,
    stride_bt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(ContextLens + b)
    first_key = tl.maximum(context_len - window, 0)  # a sliding window's oldest key (0: every key)
    first_tile = first_key // BLOCK_N
    num_tiles = tl.cdiv(context_len, BLOCK_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_start = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, first_tile + num_tiles)

    g = tl.arange(0, GROUP_PAD)
    head_mask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=head_mask[:, None], other=0.0)
    qk_scale = scale * 1.4426950408889634  # log2(e) folded in: exp2 below

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    table = BlockTables + b * stride_bt
    for tile in tl.range(tile_start, tile_end, num_stages=STAGES):
        tokens = tile * BLOCK_N + offsets  # BLOCK_N tokens over BLOCK_N // PAGE pages
        valid = (tokens < context_len) & (tokens >= first_key)
        block = tl.load(table + tokens // PAGE, mask=valid, other=0).to(tl.int64)
        row = tokens % PAGE
        k = tl.load(K + block[:, None] * stride_kb + row[:, None] * stride_kp + kv_head * stride_kh + d[None, :],
                    mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        scores = tl.dot(q, tl.trans(k)) * qk_scale  # [GROUP_PAD, BLOCK_N], in log2 units
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + block[:, None] * stride_vb + row[:, None] * stride_vp + kv_head * stride_vh + d[None, :],
                    mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    # natural-log LSE for the merge: (m + log2 l) · ln 2
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(OutPartial + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out, mask=head_mask[:, None])
    tl.store(LsePartial + b * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, *, window: int | None = None, num_splits: int | None = None,
    block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
) -> torch.Tensor:
    """One query per row against its paged keys.

    Each program walks BLOCK_N = 64 keys at a time (several pages, found through the block
    table) so that its loads are large enough to keep the memory system busy; the split count
    grows as the batch shrinks.

    Args:
        q: [B, Hq, D] (contiguous in D).
        k_cache, v_cache: [num_blocks, PAGE, Hkv, D].
        block_tables: [B, max_blocks] int (rows may be wider than needed).
        context_lens: [B] int; 0 for padding rows (their output is 0).
        scale: softmax scale.
        window: a sliding window: each row reads only its last `window` keys (None: all).
        num_splits, block_n, num_warps, num_stages: the kernel's tiling (defaults: the split
            count of `num_splits(B, Hkv)`, 64 keys per tile, 4 warps, 2 pipeline stages).

    Returns:
        [B, Hq, D] in q's dtype.
    """
    B, Hq, D = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = Hq // num_kv_heads
    S = num_splits if num_splits is not None else _num_splits(B, num_kv_heads)
    block_n = max(block_n, page)
    out_partial = torch.empty(B, Hq, S, D, dtype=torch.float32, device=q.device)
    lse_partial = torch.empty(B, Hq, S, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(B, num_kv_heads, S)](
        q, k_cache, v_cache, block_tables, context_lens, out_partial, lse_partial,
        scale, window if window is not None else 1 << 30,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out_partial.stride(0), out_partial.stride(1), out_partial.stride(2),
        lse_partial.stride(0), lse_partial.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=D, PAGE=page, NUM_SPLITS=S,
        BLOCK_N=block_n, STAGES=num_stages, num_warps=num_warps,
    )
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    _merge_splits_kernel[(B, Hq)](  # the splits, weighted by their log-sum-exp
        out_partial, lse_partial, out,
        out_partial.stride(0), out_partial.stride(1), out_partial.stride(2),
        lse_partial.stride(0), lse_partial.stride(1), out.stride(0), out.stride(1),
        D=D, S=S,
    )
    return out


_num_splits = num_splits  # the default, under a name the keyword argument does not shadow


def varlen_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    max_q: int, max_k: int, scale: float, *, window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed query chunks over their packed keys (queries end-aligned).

    Args:
        q: [Nq, Hq, D]; k, v: [Nk, Hkv, D]; cu_q, cu_k: [S + 1] int32 cumulative lengths.
        window: a sliding window: query i sees keys j with i - window < j <= i (None: all).

    Returns:
        [Nq, Hq, D].
    """
    left = window - 1 if window is not None and window < max_k else -1
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(left, 0))


@triton.jit
def _merge_splits_kernel(OutPartial, LsePartial, Out, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                         stride_yb, stride_yh, D: tl.constexpr, S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S)
    d = tl.arange(0, D)
    lse = tl.load(LsePartial + b * stride_lb + h * stride_lh + s)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)  # [S]; 0 for empty splits
    o = tl.load(OutPartial + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :])
    out = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(Out + b * stride_yb + h * stride_yh + d, out.to(Out.dtype.element_ty))
