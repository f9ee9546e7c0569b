"""A batch-invariant matrix product (Triton): a row's result does not depend on the other rows.

cuBLAS picks its kernel (tile shape, split-K, stream-K) from the problem's shape, so the same row
of x times the same W can come out with different float32 sums, and different bf16 roundings,
when it is multiplied alone, in a decode batch of 37 or in a prefill of 4,096 rows. Here every
product runs one kernel: each output tile is a [BLOCK_M, BLOCK_N] program that walks K from 0 in
BLOCK_K steps with the same tensor-core instruction sequence, so an element's sum is the same
sequence of operations whatever M is and wherever its row falls. The tile's M and N sizes are
picked by the product's size (SELECT, for speed); they change which outputs a program computes,
not how an output is summed.
The engine's batch-invariant mode (EngineConfig.batch_invariant) runs all of its products here;
"Defeating Nondeterminism in LLM Inference" (He et al., Thinking Machines, 2025) describes the
approach.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["grouped_matmul", "matmul"]

BLOCK_K = 64
# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates. They differ only in which outputs a
# program computes and how its loads are pipelined: every one walks K in BLOCK_K steps with
# Hopper's warpgroup MMA (BLOCK_M a multiple of 64, warps a multiple of 4), so an element's sum
# is the same sequence of operations in each (checked bitwise on the GPU by
# benchmarks/batch_invariant_matmul.py before a config is used).
CONFIGS = {
    "64x128": (64, 128, 4, 4),
    "64x64": (64, 64, 4, 4),
    "128x128": (128, 128, 8, 3),
    "128x256": (128, 256, 8, 3),
    "64x256": (64, 256, 4, 3),
    "64x32": (64, 32, 4, 6),
    "64x64s6": (64, 64, 4, 6),
    "128x64": (128, 64, 4, 4),
    "256x128": (256, 128, 8, 3),
}
DEFAULT_CONFIG = "64x128"
# The config of a product by its size: rows < LARGE_M (decode) or not, N < LARGE_N or not. Picked
# from benchmarks/batch_invariant_matmul.py on an H100 (2026-11-26; `suggested_select`: the least
# summed time over cuBLAS's per bucket), where every config was bitwise equal to the default at
# every M. At 256 rows the narrow products (q/k/v, o, down) take 1.14-1.34x cuBLAS's time with
# 64x64 tiles in 6 stages against 1.43-1.97x with 64x128; 128x128 serves prefill, training and
# decode's wide products (gate/up, the LM head).
LARGE_M, LARGE_N = 512, 4096
SELECT = {("small", "small"): "64x64s6", ("small", "large"): "128x128",
          ("large", "small"): "128x128", ("large", "large"): "128x128"}


def config_for(M: int, N: int) -> str:
    """The config a product of M rows and N columns runs with (SELECT)."""
    return SELECT["large" if M >= LARGE_M else "small", "large" if N >= LARGE_N else "small"]


@triton.jit
def _tile_product(X, W, rows, cols, ks, row_mask, col_mask, K, stride_x, stride_w,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """x[rows] @ w[cols]^T as a float32 [BM, BN] tile, K walked from 0 in BK steps: the one sum every
    output element of both kernels here takes."""
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + ks
        k_mask = k < K
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        w = tl.load(W + cols[:, None].to(tl.int64) * stride_w + k[None, :],
                    mask=col_mask[:, None] & k_mask[None, :], other=0.0)  # [BN, BK]
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(X, W, Bias, Y, M, N, K, stride_x, stride_w, stride_y,
                   HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_mask = rows < M
    col_mask = cols < N
    acc = _tile_product(X, W, rows, cols, ks, row_mask, col_mask, K, stride_x, stride_w, BM, BN, BK)
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None].to(tl.int64) * stride_y + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None, config: str | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias), float32 accumulation, rounded once to `out_dtype`; batch-invariant.

    Args:
        x: [M, K] (rows may be strided; the last dim contiguous), bfloat16/float16.
        weight: [N, K] in x's dtype (rows may be strided; the last dim contiguous).
        bias: [N] or None.
        out_dtype: the output's dtype (default x's): float32 keeps the sums unrounded.
        config: a key of CONFIGS (default `config_for(M, N)`); for measurements.

    Returns:
        [M, N]: for a given row of x, bitwise the same whatever M and the other rows are.
    """
    M, K = x.shape
    N = weight.shape[0]
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("matmul needs the last dim of x and weight contiguous")
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return y
    bm, bn, warps, stages = CONFIGS[config or config_for(M, N)]
    _matmul_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=BLOCK_K, num_warps=warps, num_stages=stages,
    )
    return y


GROUPED_BM, GROUPED_BN = 64, 64  # one config for every size: an element's sum is the dense kernel's walk over K


@triton.jit
def _grouped_kernel(X, W, Y, Offsets, TileEnds, TileExpert, N, K, stride_x, stride_we, stride_w, stride_y,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    tile = tl.program_id(0)
    e = tl.load(TileExpert + tile)
    if e < 0:  # past the batch's row tiles
        return
    end = tl.load(Offsets + e)
    start = tl.where(e > 0, tl.load(Offsets + tl.maximum(e - 1, 0)), 0)
    first_tile = tl.where(e > 0, tl.load(TileEnds + tl.maximum(e - 1, 0)), 0)
    rows = start + (tile - first_tile) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_mask = rows < end
    col_mask = cols < N
    acc = _tile_product(X, W + e.to(tl.int64) * stride_we, rows, cols, ks, row_mask, col_mask, K, stride_x, stride_w,
                        BM, BN, BK)
    tl.store(Y + rows[:, None].to(tl.int64) * stride_y + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each expert's rows of x times its own weight, batch-invariant: y[rows of e] = x[rows of e] @ weight[e]^T.

    `modeling.experts.grouped_linear`'s contract (rows sorted by expert) with `matmul`'s promise: a
    row's result does not depend on how many rows its expert or the batch has, since every output
    tile walks K from 0 in BLOCK_K steps with one fixed config. The grid is fixed by M and the
    expert count (cdiv(M, 64) + E row tiles, the unused ones return at once), so CUDA graphs
    capture it; no host sync.

    Args:
        x: [M, K] bfloat16/float16, rows sorted by expert (the last dim contiguous).
        weight: [E, N, K] (each expert's nn.Linear layout; the last dim contiguous).
        offsets: [E] int32 cumulative row counts (`ExpertBatch.offsets`).

    Returns:
        [M, N] in x's dtype.
    """
    M, K = x.shape
    E, N, _ = weight.shape
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("grouped_matmul needs the last dim of x and weight contiguous")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    counts = offsets.diff(prepend=offsets.new_zeros(1))
    tile_ends = ((counts + GROUPED_BM - 1) // GROUPED_BM).cumsum(0, dtype=torch.int32)  # [E]
    num_tiles = triton.cdiv(M, GROUPED_BM) + E  # at most one partial tile per expert beyond cdiv(M, BM)
    tile_expert = torch.searchsorted(tile_ends, torch.arange(num_tiles, device=x.device, dtype=torch.int32),
                                     right=True).to(torch.int32)
    tile_expert = torch.where(tile_expert < E, tile_expert, -1)
    _grouped_kernel[(num_tiles, triton.cdiv(N, GROUPED_BN))](
        x, weight, y, offsets, tile_ends, tile_expert, N, K, x.stride(0), weight.stride(0), weight.stride(1),
        y.stride(0), BM=GROUPED_BM, BN=GROUPED_BN, BK=BLOCK_K, num_warps=4, num_stages=4,
    )
    return y
