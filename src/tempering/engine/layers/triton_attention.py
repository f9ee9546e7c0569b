"""GPU attention kernels: paged decode in Triton, packed prefill with PyTorch's varlen_attn.

Decode (one query per sequence) reads K/V straight from the paged cache, with no gather: a
split-K kernel whose grid is (rows, kv_heads, splits) processes every query head of one KV
head together (one `tl.dot` per tile of 64 keys, gathered from several pages through the block
table), walks its share of the sequence with an online softmax in base 2, and writes a partial
output and log-sum-exp; a second kernel merges the splits. Rows with context length 0 (padding of a CUDA-graph bucket) exit at
once. The grid depends only on the batch bucket, so the kernel can be captured in a CUDA graph.

Cascade attention (a shared prefix, `shared_prefix`): when every decode row's first P keys are the
same cache blocks (an agent's system prompt and tool schemas, shared through the prefix cache), a
third kernel reads those keys once per tile of rows instead of once per row: a program holds
ROWS rows x the query heads of one KV head (64 query rows for the matrix unit) and walks its split
of the prefix; the split kernel then starts each row at key P, and the merge weighs the prefix's
partial outputs with the rows' own. The attention is the same; only the order of the sums differs.
After FlashInfer's cascade attention and Hydragen (Juravsky et al., 2024); the code is ours.
Design after lightllm/SGLang's grouped decode kernels and vLLM's block-table addressing (see
reference/ENGINE_NOTES.md, section 2); the code is ours.

Batch-invariant mode (EngineConfig.batch_invariant) runs decode rows and prefill queries through
one kernel, `invariant_attention`: a program holds a block of up to `queries_per_block` queries
of one sequence (with every query head of one KV head each: 64 rows for the matrix unit), walks
their keys in 64-key tiles from the first in one pass, and masks each query to its own keys. A
query's arithmetic is the same whichever block and row hold it: the same block shape and
instructions (decode and prefill differ only in how a program finds its queries), the same tiles
in the same order, and tiles past a query's keys leave its state unchanged. So a prefill query
equals, bit for bit, the same query decoded, while a block shares each key tile among its
queries (the per-query decode kernel reloads every tile for every query).

Prefill chunks gather their keys (cached prefix + new tokens) into one packed buffer and call
`torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 inside PyTorch >= 2.10), causal with
queries aligned to the end of their keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import dot_precision

__all__ = ["HAS_VARLEN", "invariant_attention", "paged_decode_attention", "prefix_splits", "queries_per_block",
           "varlen_prefill_attention"]

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
    programs = max(1, batch_size * num_kv_heads)  # a prefill-only step has no decode rows
    return max(1, min(16, triton.next_power_of_2(max(1, 1024 // programs))))


@triton.jit
def _decode_split_kernel(
    Q, K, V, BlockTables, ContextLens, PrefixLen, OutPartial, LsePartial,
    scale, window,
    stride_qb, stride_qh,
    stride_kb, stride_kp, stride_kh,
    stride_vb, stride_vp, stride_vh,
    stride_bt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr, HAS_PREFIX: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(ContextLens + b)
    first_key = tl.maximum(context_len - window, 0)  # a sliding window's oldest key (0: every key)
    if HAS_PREFIX:  # the shared prefix's keys are the prefix kernel's
        first_key = tl.maximum(first_key, tl.minimum(tl.load(PrefixLen), context_len))
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
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_N], in log2 units
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + block[:, None] * stride_vb + row[:, None] * stride_vp + kv_head * stride_vh + d[None, :],
                    mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    # natural-log LSE for the merge: (m + log2 l) · ln 2
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(OutPartial + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out, mask=head_mask[:, None])
    tl.store(LsePartial + b * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


PREFIX_ROWS = 64  # query rows of a shared-prefix program: decode rows x padded query heads of one KV head


@triton.jit
def _shared_prefix_kernel(
    Q, K, V, BlockTables, ContextLens, PrefixLen, OutPartial, LsePartial,
    scale, num_rows,
    stride_qb, stride_qh,
    stride_kb, stride_kp, stride_kh,
    stride_vb, stride_vp, stride_vh,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
):
    tile_of_rows = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    prefix_len = tl.load(PrefixLen)
    num_tiles = tl.cdiv(prefix_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

    r = tl.arange(0, ROWS * GROUP_PAD)
    b = tile_of_rows * ROWS + r // GROUP_PAD
    g = r % GROUP_PAD
    in_batch = b < num_rows
    context_len = tl.load(ContextLens + b, mask=in_batch, other=0)
    row_ok = in_batch & (g < GROUP) & (context_len > 0)  # padding rows (no keys) take no part
    keys = tl.minimum(context_len, prefix_len)  # [rows]: the prefix's keys each row sees (all, by construction)
    heads = kv_head * GROUP + g
    d = tl.arange(0, D)
    q = tl.load(Q + b[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    qk_scale = scale * 1.4426950408889634  # log2(e) folded in: exp2 below

    m_i = tl.full([ROWS * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS * GROUP_PAD], tl.float32)
    acc = tl.zeros([ROWS * GROUP_PAD, D], tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    for tile in tl.range(tile_start, tile_end, num_stages=STAGES):
        tokens = tile * BLOCK_N + offsets
        loaded = tokens < prefix_len
        block = tl.load(BlockTables + tokens // PAGE, mask=loaded, other=0).to(tl.int64)  # row 0's table: shared
        row = tokens % PAGE
        k = tl.load(K + block[:, None] * stride_kb + row[:, None] * stride_kp + kv_head * stride_kh + d[None, :],
                    mask=loaded[:, None], other=0.0)  # [BLOCK_N, D], once for every row of the program
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [rows, BLOCK_N], log2 units
        scores = tl.where(tokens[None, :] < keys[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row without keys stays empty
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + block[:, None] * stride_vb + row[:, None] * stride_vp + kv_head * stride_vh + d[None, :],
                    mask=loaded[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(OutPartial + b[:, None] * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :], out,
             mask=(in_batch & (g < GROUP))[:, None])
    tl.store(LsePartial + b * stride_lb + heads * stride_lh + split, lse, mask=in_batch & (g < GROUP))


def prefix_splits(batch_size: int, num_heads: int, num_kv_heads: int) -> int:
    """Splits of the shared prefix's keys: enough programs to fill the GPU when few tiles of rows
    share it. Depends only on the batch bucket (a CUDA graph fixes the grid)."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    programs = triton.cdiv(batch_size, max(1, PREFIX_ROWS // group_pad)) * num_kv_heads
    return max(1, min(32, triton.next_power_of_2(max(1, 512 // programs))))


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, *, window: int | None = None, num_splits: int | None = None,
    block_n: int = 64, num_warps: int = 4, num_stages: int = 2, shared_prefix: torch.Tensor | None = None,
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
        shared_prefix: [1] int, on q's device: P, the number of leading keys (whole pages) that
            every row with keys reads from the same cache blocks, `block_tables[0]`'s first
            P / PAGE (cascade attention: read once per tile of rows; 0: none). Not with `window`.

    Returns:
        [B, Hq, D] in q's dtype.

    Raises:
        ValueError: `shared_prefix` with a sliding `window`.
    """
    B, Hq, D = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = Hq // num_kv_heads
    S = num_splits if num_splits is not None else _num_splits(B, num_kv_heads)
    block_n = max(block_n, page)
    SP = 0
    if shared_prefix is not None:
        if window is not None:
            raise ValueError("a shared prefix (cascade attention) cannot be used with a sliding window")
        SP = prefix_splits(B, Hq, num_kv_heads)
    out_partial = torch.empty(B, Hq, SP + S, D, dtype=torch.float32, device=q.device)
    lse_partial = torch.empty(B, Hq, SP + S, dtype=torch.float32, device=q.device)
    group_pad = max(16, triton.next_power_of_2(group))
    if SP:
        prefix_pad = triton.next_power_of_2(group)  # no matrix-unit minimum: the rows fill the tile
        rows = max(1, PREFIX_ROWS // prefix_pad)
        _shared_prefix_kernel[(triton.cdiv(B, rows), num_kv_heads, SP)](
            q, k_cache, v_cache, block_tables, context_lens, shared_prefix, out_partial, lse_partial,
            scale, B,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out_partial.stride(0), out_partial.stride(1), out_partial.stride(2),
            lse_partial.stride(0), lse_partial.stride(1),
            GROUP=group, GROUP_PAD=prefix_pad, ROWS=rows, D=D, PAGE=page, NUM_SPLITS=SP,
            BLOCK_N=block_n, STAGES=num_stages, PRECISION=dot_precision(q.dtype), num_warps=num_warps,
        )
    rows_out, rows_lse = out_partial[:, :, SP:], lse_partial[:, :, SP:]  # the rows' own keys: the splits after
    _decode_split_kernel[(B, num_kv_heads, S)](
        q, k_cache, v_cache, block_tables, context_lens, shared_prefix if SP else context_lens, rows_out, rows_lse,
        scale, window if window is not None else 1 << 30,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        rows_out.stride(0), rows_out.stride(1), rows_out.stride(2),
        rows_lse.stride(0), rows_lse.stride(1),
        GROUP=group, GROUP_PAD=group_pad, D=D, PAGE=page, NUM_SPLITS=S,
        BLOCK_N=block_n, STAGES=num_stages, PRECISION=dot_precision(q.dtype), HAS_PREFIX=bool(SP),
        num_warps=num_warps,
    )
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    _merge_splits_kernel[(B, Hq)](  # the splits, weighted by their log-sum-exp
        out_partial, lse_partial, out,
        out_partial.stride(0), out_partial.stride(1), out_partial.stride(2),
        lse_partial.stride(0), lse_partial.stride(1), out.stride(0), out.stride(1),
        D=D, S=SP + S, S_PAD=triton.next_power_of_2(SP + S),
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
                         stride_yb, stride_yh, D: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    lse = tl.load(LsePartial + b * stride_lb + h * stride_lh + s, mask=s < S, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)  # [S_PAD]; 0 for empty splits
    o = tl.load(OutPartial + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
                mask=(s < S)[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(Out + b * stride_yb + h * stride_yh + d, out.to(Out.dtype.element_ty))


INVARIANT_ROWS = 64  # rows of a batch-invariant attention block: queries x padded query heads of one KV head


def queries_per_block(num_heads: int, num_kv_heads: int) -> int:
    """Queries of one sequence that share a batch-invariant attention block (`invariant_attention`).

    The block's rows are these queries times the query heads of one KV head (padded to a power of
    two), INVARIANT_ROWS in all (at least one query).
    """
    group = triton.next_power_of_2(num_heads // num_kv_heads)
    return max(1, INVARIANT_ROWS // group)


@triton.jit
def _invariant_kernel(
    Q, K, V, Out, BlockTables, ContextLens, QueryBlocks,
    scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kp, stride_kh,
    stride_vb, stride_vp, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, QUERIES: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, DECODE: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    if DECODE:  # one decode row per program
        first = pid
        count = 1
    else:  # QueryBlocks[pid] = (first query, number of queries), consecutive queries of one sequence
        first = tl.load(QueryBlocks + 2 * pid)
        count = tl.load(QueryBlocks + 2 * pid + 1)
    r = tl.arange(0, QUERIES * GROUP_PAD)
    query = r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (query < count) & (g < GROUP)
    token = first + query
    heads = kv_head * GROUP + g
    d = tl.arange(0, D)
    q = tl.load(Q + token[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                other=0.0)
    context = tl.load(ContextLens + token, mask=row_ok, other=0)  # [rows]: each query's keys
    num_keys = tl.max(context, 0)
    first_key = tl.maximum(context - window, 0)  # [rows]: a sliding window's oldest key (0: every key)
    # tiles stay aligned to the sequence's first key: the block starts at its earliest query's tile, and
    # a tile wholly before a query's window leaves its state as it started (m = -inf, l = 0, acc = 0)
    first_tile = tl.min(tl.where(row_ok, first_key, 1 << 30), 0) // BLOCK_N
    qk_scale = scale * 1.4426950408889634  # log2(e) folded in: exp2 below

    m_i = tl.full([QUERIES * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([QUERIES * GROUP_PAD], tl.float32)
    acc = tl.zeros([QUERIES * GROUP_PAD, D], tl.float32)
    offsets = tl.arange(0, BLOCK_N)
    table = BlockTables + first * stride_bt  # the queries' shared sequence
    for tile in range(first_tile, tl.cdiv(num_keys, BLOCK_N)):
        tokens = tile * BLOCK_N + offsets
        loaded = tokens < num_keys
        block = tl.load(table + tokens // PAGE, mask=loaded, other=0).to(tl.int64)
        row = tokens % PAGE
        k = tl.load(K + block[:, None] * stride_kb + row[:, None] * stride_kp + kv_head * stride_kh + d[None, :],
                    mask=loaded[:, None], other=0.0)  # [BLOCK_N, D]
        scores = tl.dot(q, tl.trans(k)) * qk_scale  # [rows, BLOCK_N], in log2 units
        seen = (tokens[None, :] < context[:, None]) & (tokens[None, :] >= first_key[:, None])
        scores = tl.where(seen, scores, float("-inf"))
        # a tile wholly past a query's keys: m_new = m_i, alpha = 1, p = 0: its state is unchanged, bit for bit
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row (no keys at all) stays 0
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + block[:, None] * stride_vb + row[:, None] * stride_vp + kv_head * stride_vh + d[None, :],
                    mask=loaded[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + token[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None])


def invariant_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, query_blocks: torch.Tensor | None = None, *,
    window: int | None = None,
) -> torch.Tensor:
    """Batch-invariant attention: each query over its own keys, in one pass of 64-key tiles.

    A query's result depends only on its keys: decoded (`query_blocks=None`, one row per
    program) or prefilled in a block of `queries_per_block` queries of its sequence, it is the
    same bit for bit. Tiles are counted from the sequence's first key; with a sliding window a
    query starts at the tile holding its oldest key, and in a prefill block the tiles before
    that (read for the block's earlier queries) leave its running sums exactly as they began.

    Args:
        q: [T, Hq, D] bf16/fp16 queries.
        k_cache, v_cache: [num_blocks, PAGE, Hkv, D].
        block_tables: [T, max_blocks] int, each query's sequence's cache blocks (padding: 0).
        context_lens: [T] int, each query's key count (its position + 1; 0 for a padding row,
            whose output is 0).
        scale: softmax scale.
        query_blocks: [num_blocks, 2] int32 (first query, count) of the blocks of consecutive
            queries of one sequence, at most `queries_per_block(Hq, Hkv)` each (None: decode).
        window: a sliding window: the query at position p sees keys p - window < j <= p (None: all).

    Returns:
        [T, Hq, D] in q's dtype.
    """
    T, Hq, D = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = Hq // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    queries = queries_per_block(Hq, num_kv_heads)
    out = torch.empty_like(q)
    decode = query_blocks is None
    grid = (T if decode else query_blocks.shape[0], num_kv_heads)
    _invariant_kernel[grid](
        q, k_cache, v_cache, out, block_tables, context_lens, q if decode else query_blocks,
        scale, window if window is not None else 1 << 30,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, QUERIES=queries, D=D, PAGE=page, BLOCK_N=max(64, page), DECODE=decode,
        num_warps=4,
    )
    return out
