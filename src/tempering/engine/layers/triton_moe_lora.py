"""The live adapter's LoRA on a mixture of experts' experts, at decode speed (CUDA).

For the (token, expert) rows of a batch sorted by expert (`modeling.experts.sort_by_expert`),
each expert e adds its own rank-r delta to its block of rows of a projection's output:

    y[rows of e] += (x[rows of e] A_e^T) (s B_e)^T

`modeling.experts._add_delta_` computes this with two grouped GEMMs (the trainer's path, and the
engine's on the CPU). Their tiles are sized for the base weights, so at decode, with ~16 rows per
expert and a rank of 8-16, the four products of a layer took ~185 µs on an H100 for ~20 MB of
LoRA weights (8.6 ms of a 38 ms Qwen3-30B-A3B step). Here one program per expert and split of
the input dim computes its rows' partial t = x A_e^T (the shrink), then one program per expert
and column tile sums the partials, rounds t and adds t (s B_e)^T to y in place (the expand):
each expert's A and B are read once, the grid is fixed for a batch size (CUDA graphs capture
it), and there are no atomics.

The roundings are `_add_delta_`'s: float32 sums, t rounded to the activations' dtype, the delta
rounded to it, then y + delta rounded once; only the order of the float32 sums differs.
Reference: Punica's segmented gather (SGMV, arXiv 2310.18547), one segment per expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import dot_precision

__all__ = ["moe_lora_add_"]


@triton.jit
def _segment(Offsets, e):
    """Expert e's rows [start, end) of the sorted batch."""
    start = tl.load(Offsets + tl.maximum(e - 1, 0))
    start = tl.where(e > 0, start, 0)
    return start, tl.load(Offsets + e)


@triton.jit
def _shrink_kernel(X, A, T, Offsets, K, M, stride_x, k_per_split, RANK: tl.constexpr, R_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """T[split, rows of e] = X[rows of e, ks] @ A[e, :, ks]^T over one split of K, float32 (one
    program per expert and split: enough programs for a decode batch, no atomics)."""
    e = tl.program_id(0)
    split = tl.program_id(1)
    start, end = _segment(Offsets, e)
    r = tl.arange(0, R_PAD)
    r_mask = r < RANK
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        acc = tl.zeros([BLOCK_M, R_PAD], tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < k_end
            x = tl.load(X + rows[:, None] * stride_x + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(A + e * RANK * K + r[:, None] * K + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(a.to(x.dtype)), acc, input_precision=PRECISION)
        tl.store(T + split * M * RANK + rows[:, None] * RANK + r[None, :], acc, mask=row_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(T, B, Y, Offsets, Keep, N, M, stride_y, RANK: tl.constexpr, R_PAD: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, HAS_KEEP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Y[rows of e, cols] += round(round(Σ_split T[split, rows of e]) @ B[e, cols]^T) (one program per
    expert and column tile)."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    r = tl.arange(0, R_PAD)
    r_mask = r < RANK
    start, end = _segment(Offsets, e)
    b = tl.load(B + e * N * RANK + cols[:, None] * RANK + r[None, :], mask=col_mask[:, None] & r_mask[None, :],
                other=0.0)  # [BLOCK_N, R_PAD]
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        t_mask = row_mask[:, None] & r_mask[None, :]
        t = tl.zeros([BLOCK_M, R_PAD], tl.float32)
        for split in range(NUM_SPLITS):
            t += tl.load(T + split * M * RANK + rows[:, None] * RANK + r[None, :], mask=t_mask, other=0.0)
        t = t.to(b.dtype)  # x A^T rounded to the activations' dtype, as the grouped GEMM's output
        delta = tl.dot(t, tl.trans(b), input_precision=PRECISION).to(Y.dtype.element_ty)
        if HAS_KEEP:  # rows of tokens another adapter serves: 0 (exact)
            keep = tl.load(Keep + rows, mask=row_mask, other=0.0)
            delta = delta * keep[:, None]
        mask = row_mask[:, None] & col_mask[None, :]
        y_ptr = Y + rows[:, None] * stride_y + cols[None, :]
        y = tl.load(y_ptr, mask=mask, other=0.0)
        tl.store(y_ptr, (y.to(tl.float32) + delta.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def moe_lora_add_(y: torch.Tensor, x: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor], batch,
                  rows: torch.Tensor | None, impl: str = "auto") -> torch.Tensor:
    """y += each expert's LoRA delta of x, in place; `modeling.experts._add_delta_`'s contract.

    Args:
        y: [M, N] the projection's output, rows sorted by expert (contiguous rows).
        x: [M, K] its input, same rows (the last dim contiguous).
        lora: (A [E, r, K], s·B [E, N, r]), contiguous (`ExpertLoRA.stacked`).
        batch: the `ExpertBatch` (its `offsets` [E] int32 and `token` [M]).
        rows: [tokens] bool, the tokens this adapter serves; None: all.
        impl: unused (the grouped-GEMM path's argument).

    Returns:
        y.
    """
    A, B = lora
    E, rank, K = A.shape
    M, N = y.shape
    block_k = 128
    splits = max(1, min(8, triton.cdiv(K, 2 * block_k)))  # ~2 loop iterations per program
    k_per_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k
    splits = triton.cdiv(K, k_per_split)
    t = torch.empty(splits, M, rank, dtype=torch.float32, device=x.device)  # partial sums over splits of K
    r_pad = max(16, triton.next_power_of_2(rank))
    precision = dot_precision(x.dtype)
    _shrink_kernel[(E, splits)](x, A, t, batch.offsets, K, M, x.stride(0), k_per_split, RANK=rank, R_PAD=r_pad,
                                BLOCK_M=16, BLOCK_K=block_k, PRECISION=precision)
    keep = rows[batch.token].to(y.dtype) if rows is not None else y
    block_n = 128
    _expand_kernel[(E, triton.cdiv(N, block_n))](t, B, y, batch.offsets, keep, N, M, y.stride(0), RANK=rank,
                                                  R_PAD=r_pad, NUM_SPLITS=splits, HAS_KEEP=rows is not None, BLOCK_M=16,
                                                  BLOCK_N=block_n, PRECISION=precision)
    return y
