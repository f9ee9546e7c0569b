"""LoRA at decode speed: the adapter's delta in two small Triton kernels per fused projection.

`y = x W^T + Σ_s s_s (x A_s^T) B_s^T` over the slices s of a fused projection (q/k/v, gate/up),
Hu et al. 2021 (arXiv 2106.09685). Shrink then expand, as Punica's SGMV/BGMV (arXiv 2310.18547)
and vLLM's LoRA ops do, but for one adapter and with the slices of a fused projection in one
launch each:

- `lora_shrink`: t[N, S·r] = x @ [A_0; A_1; A_2]^T, reading x once for all slices, as
  deterministic partial sums over splits of the input dim (enough programs for a decode batch).
- `lora_expand_`: y[:, cols_s] += s_s · t[:, s·r:(s+1)·r] @ B_s^T for every slice, in place.
- `silu_and_mul_lora`: the gate/up expand fused into the SwiGLU kernel, so the [N, 2I] gate/up
  output is never read and written an extra time.

A and B are read where the trainer keeps them (its fp32 parameters, updated in place by the
optimizer), so a training step is served at the next engine step with no copy. They are rounded
to the activations' dtype inside the kernel, as the trainer's autocast does (t is rounded to
that dtype after scaling, like the trainer's `s · x A^T`). Every launch has a fixed grid for a
given batch size, so the kernels are captured in the engine's CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import _cos_sin_halves, _rotate_halves, _store_halves, _store_rms_norm, dot_precision

__all__ = ["add_rms_norm_lora", "lora_expand_", "lora_shrink", "rotary_and_store_lora_", "silu_and_mul_lora"]

MAX_SLICES = 3


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit(do_not_specialize=["N"])  # the row count varies step to step: one compile
def _shrink_kernel(
    X, A0, A1, A2, T, N, K, stride_x, stride_ts, stride_t, k_per_split,
    RANK: tl.constexpr, NUM_SLICES: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """Partial sums over one split of K: T[split, rows, s·r:(s+1)·r] = x[rows, ks] @ A_s[:, ks]^T."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row_mask = rows < N
    r = tl.arange(0, R_PAD)
    r_mask = r < RANK
    acc0 = tl.zeros([BLOCK_N, R_PAD], tl.float32)
    acc1 = tl.zeros([BLOCK_N, R_PAD], tl.float32)
    acc2 = tl.zeros([BLOCK_N, R_PAD], tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(X + rows[:, None] * stride_x + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a_mask = r_mask[:, None] & k_mask[None, :]
        a_off = r[:, None] * K + k[None, :]
        a = tl.load(A0 + a_off, mask=a_mask, other=0.0).to(x.dtype)  # [R_PAD, BLOCK_K]
        acc0 = tl.dot(x, tl.trans(a), acc0, input_precision=PRECISION)
        if NUM_SLICES > 1:
            a = tl.load(A1 + a_off, mask=a_mask, other=0.0).to(x.dtype)
            acc1 = tl.dot(x, tl.trans(a), acc1, input_precision=PRECISION)
        if NUM_SLICES > 2:
            a = tl.load(A2 + a_off, mask=a_mask, other=0.0).to(x.dtype)
            acc2 = tl.dot(x, tl.trans(a), acc2, input_precision=PRECISION)
    out_mask = row_mask[:, None] & r_mask[None, :]
    base = T + split * stride_ts + rows[:, None] * stride_t + r[None, :]
    tl.store(base, acc0, mask=out_mask)
    if NUM_SLICES > 1:
        tl.store(base + RANK, acc1, mask=out_mask)
    if NUM_SLICES > 2:
        tl.store(base + 2 * RANK, acc2, mask=out_mask)


MAX_SPLITS = 16  # the expand sums the partials with unrolled loads


def _t_strides(t: torch.Tensor) -> tuple[int, int]:
    """(split stride, row stride) of x A^T given as partial sums [splits, N, R] or final [N, R]."""
    return (t.stride(0), t.stride(1)) if t.dim() == 3 else (0, t.stride(0))


def _num_splits(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() == 3 else 1


def lora_shrink(x: torch.Tensor, A: list[torch.Tensor], *, fixed_tiles: bool = False) -> torch.Tensor:
    """t = x @ [A_0; ...; A_{S-1}]^T, as partial sums over splits of the input dim (summed by the expand).

    Splitting K keeps enough programs busy for a decode batch (a few rows, K up to the MLP
    width) and keeps the sum deterministic (no atomics).

    Args:
        x: [N, K] activations (rows may be strided; the last dim contiguous).
        A: 1-3 LoRA A matrices [r, K], contiguous, of one rank (any float dtype; rounded to x's).
        fixed_tiles: one row tiling for every N (batch-invariant mode: a row's sums never depend on N).

    Returns:
        t: [splits, N, S·r] float32; t.sum(0) is the product.
    """
    N, K = x.shape
    rank, S = A[0].shape[0], len(A)
    BLOCK_K = 64
    splits = min(triton.cdiv(K, 4 * BLOCK_K), MAX_SPLITS)  # ~4 loop iterations each, at most MAX_SPLITS
    k_per_split = triton.cdiv(triton.cdiv(K, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(K, k_per_split)
    t = torch.empty(splits, N, S * rank, dtype=torch.float32, device=x.device)
    a = A + [A[0]] * (MAX_SLICES - S)
    BLOCK_N = 32 if fixed_tiles or N > 64 else 16
    _shrink_kernel[(triton.cdiv(N, BLOCK_N), splits)](
        x, a[0], a[1], a[2], t, N, K, x.stride(0), t.stride(0), t.stride(1), k_per_split,
        RANK=rank, NUM_SLICES=S, R_PAD=max(16, triton.next_power_of_2(rank)),
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=dot_precision(x.dtype),
    )
    return t


@triton.jit
def _slice_delta(acc, T, B, rows, row_mask, cols, stride_ts, stride_t, NUM_SPLITS: tl.constexpr, t_col, start, end, scale,
                 RANK: tl.constexpr, R_PAD: tl.constexpr, PRECISION: tl.constexpr, like):
    """acc += scale · t[rows, t_col:t_col+RANK] @ B[cols - start]^T for the columns in [start, end) (t summed over splits)."""
    r = tl.arange(0, R_PAD)
    r_mask = r < RANK
    in_slice = (cols >= start) & (cols < end)
    b = tl.load(B + (cols - start)[:, None] * RANK + r[None, :], mask=in_slice[:, None] & r_mask[None, :], other=0.0)
    t_ptr = T + rows[:, None] * stride_t + t_col + r[None, :]
    t_mask = row_mask[:, None] & r_mask[None, :]
    t = tl.load(t_ptr, mask=t_mask, other=0.0)
    for split in tl.static_range(1, NUM_SPLITS):  # the shrink's partial sums over K, loads issued together
        t += tl.load(t_ptr + split * stride_ts, mask=t_mask, other=0.0)
    t = (t * scale).to(like.dtype)  # the trainer rounds s · x A^T to the model dtype
    return tl.dot(t, tl.trans(b.to(like.dtype)), acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["N"])  # the row count varies step to step: one compile
def _expand_kernel(
    Y, Out, T, B0, B1, B2, N, M, stride_y, stride_o, stride_ts, stride_t,
    start0, end0, start1, end1, start2, end2, scale0, scale1, scale2,
    RANK: tl.constexpr, NUM_SLICES: tl.constexpr, R_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr, COPY: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    col_mask = cols < M
    tile_start = tl.program_id(1) * BLOCK_M
    tile_end = tile_start + BLOCK_M
    # a tile that touches no slice (a projection without LoRA) is left alone
    touches = (tile_start < end0) & (tile_end > start0)
    if NUM_SLICES > 1:
        touches |= (tile_start < end1) & (tile_end > start1)
    if NUM_SLICES > 2:
        touches |= (tile_start < end2) & (tile_end > start2)
    mask = row_mask[:, None] & col_mask[None, :]
    ptr = Y + rows[:, None] * stride_y + cols[None, :]
    out_ptr = Out + rows[:, None] * stride_o + cols[None, :]
    like = tl.zeros([1], ROUND_DTYPE)  # the model dtype, where t is rounded
    if touches:
        y = tl.load(ptr, mask=mask, other=0.0)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        # only the slices this tile touches (q/k/v: one, as their widths are multiples of BLOCK_M)
        if (tile_start < end0) & (tile_end > start0):
            acc = _slice_delta(acc, T, B0, rows, row_mask, cols, stride_ts, stride_t, NUM_SPLITS, 0, start0, end0, scale0,
                               RANK, R_PAD, PRECISION, like)
        if NUM_SLICES > 1:
            if (tile_start < end1) & (tile_end > start1):
                acc = _slice_delta(acc, T, B1, rows, row_mask, cols, stride_ts, stride_t, NUM_SPLITS, RANK, start1, end1,
                                   scale1, RANK, R_PAD, PRECISION, like)
        if NUM_SLICES > 2:
            if (tile_start < end2) & (tile_end > start2):
                acc = _slice_delta(acc, T, B2, rows, row_mask, cols, stride_ts, stride_t, NUM_SPLITS, 2 * RANK, start2,
                                   end2, scale2, RANK, R_PAD, PRECISION, like)
        tl.store(out_ptr, (y.to(tl.float32) + acc).to(Out.dtype.element_ty), mask=mask)  # rounded once
    elif COPY:  # a column tile without LoRA: y rounded into the output
        tl.store(out_ptr, tl.load(ptr, mask=mask, other=0.0).to(Out.dtype.element_ty), mask=mask)


def lora_expand_(y: torch.Tensor, t: torch.Tensor, B: list[torch.Tensor], columns: list[slice],
                 scales: list[float], out: torch.Tensor | None = None, *, fixed_tiles: bool = False,
                 round_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[:, columns[s]] = round(y + round(scales[s] · t[:, s·r:(s+1)·r]) @ B[s]^T) for each slice s.

    Args:
        y: [N, M] output of the base projection (float32, unrounded, or the model dtype; rows may
            be strided).
        out: [N, M] in the model dtype, where the sum is rounded to (y itself, in place, when
            None); columns no slice covers are copied from y, rounded. A float32 `out` keeps the
            sum unrounded (a tensor-parallel partial output, rounded after its all-reduce).
        fixed_tiles: one tiling for every N (batch-invariant mode).
        round_dtype: the model dtype, where s · x A^T is rounded (default: out's dtype).
        t: x A^T: [splits, N, S·r] float32 partial sums from `lora_shrink`, or [N, S·r] in any
            float dtype (the spare rows of the base GEMM; rows may be strided).
        B: 1-3 LoRA B matrices [cols_s, r], contiguous.
        columns: each slice's output columns in y (start and stop set).
        scales: alpha / r of each slice.

    Returns:
        out.
    """
    N, M = y.shape
    out = y if out is None else out
    round_dtype = round_dtype or out.dtype
    S, rank = len(B), B[0].shape[1]
    bounds = [(c.start, c.stop) for c in columns] + [(0, 0)] * (MAX_SLICES - S)
    b = B + [B[0]] * (MAX_SLICES - S)
    sc = list(scales) + [0.0] * (MAX_SLICES - S)
    BLOCK_N, BLOCK_M, num_warps = _expand_tiles(N if not fixed_tiles else 256)
    _expand_kernel[(triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M))](
        y, out, t, b[0], b[1], b[2], N, M, y.stride(0), out.stride(0), *_t_strides(t),
        bounds[0][0], bounds[0][1], bounds[1][0], bounds[1][1], bounds[2][0], bounds[2][1],
        float(sc[0]), float(sc[1]), float(sc[2]),
        RANK=rank, NUM_SLICES=S, R_PAD=max(16, triton.next_power_of_2(rank)), NUM_SPLITS=_num_splits(t),
        BLOCK_N=BLOCK_N, BLOCK_M=BLOCK_M, PRECISION=dot_precision(round_dtype), COPY=out is not y,
        ROUND_DTYPE=_TL_DTYPES[round_dtype], num_warps=num_warps,
    )
    return out


def _expand_tiles(N: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_M, num_warps) of the expand for N rows."""
    if N > 512:  # prefill: wider tiles (q/k/v at 8192 rows: 34 instead of 47 us; H100, 1.5B shapes)
        return 16, 128, 8
    return (16 if N <= 128 else 32), 64, 8  # tuned on an H100 (N = 64 and 256, q/k/v and o shapes of a 1.5B model)


def _silu_tiles(N: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_I, num_warps) of the SwiGLU with the gate/up delta for N rows."""
    return (16 if N <= 64 else 32), 64, 4  # tuned on an H100 (N = 64 and 256, 1.5B gate/up shape)


@triton.jit(do_not_specialize=["N"])  # the row count varies step to step: one compile
def _silu_mul_lora_kernel(
    X, Yout, T, BG, BU, N, I, stride_x, stride_y, stride_ts, stride_t, t_col_g, t_col_u, scale_g, scale_u,
    HAS_G: tl.constexpr, HAS_U: tl.constexpr, RANK: tl.constexpr, R_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    row_mask = rows < N
    mask = row_mask[:, None] & (cols < I)[None, :]
    base = X + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0)
    up = tl.load(base + I, mask=mask, other=0.0)
    like = tl.zeros([1], Yout.dtype.element_ty)  # the model dtype
    if HAS_G:  # the base output (float32, unrounded) plus the delta, rounded once to the model dtype
        acc = _slice_delta(tl.zeros([BLOCK_N, BLOCK_I], tl.float32), T, BG, rows, row_mask, cols,
                           stride_ts, stride_t, NUM_SPLITS, t_col_g, 0, I, scale_g, RANK, R_PAD, PRECISION, like)
        gate = gate.to(tl.float32) + acc
    if HAS_U:
        acc = _slice_delta(tl.zeros([BLOCK_N, BLOCK_I], tl.float32), T, BU, rows, row_mask, cols,
                           stride_ts, stride_t, NUM_SPLITS, t_col_u, 0, I, scale_u, RANK, R_PAD, PRECISION, like)
        up = up.to(tl.float32) + acc
    gate = gate.to(like.dtype)
    up = up.to(like.dtype)
    g32 = gate.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(like.dtype)  # silu, rounded like F.silu
    tl.store(Yout + rows[:, None] * stride_y + cols[None, :], (act * up).to(like.dtype), mask=mask)


def silu_and_mul_lora(gate_up: torch.Tensor, t: torch.Tensor, B_gate: torch.Tensor | None, B_up: torch.Tensor | None,
                      scale_gate: float, scale_up: float, dtype: torch.dtype | None = None, *,
                      fixed_tiles: bool = False) -> torch.Tensor:
    """silu(gate + Δgate) * (up + Δup) for gate_up [N, 2I] → [N, I], Δ from t (as in `lora_expand_`; gate's slice first).

    gate_up: float32 (the GEMM's unrounded output) or the model dtype; gate + Δgate and
    up + Δup are rounded once to `dtype` (default: gate_up's), the output's dtype.
    B_gate, B_up: [I, r] or None for a projection without LoRA (at least one is given).
    """
    N, two_i = gate_up.shape
    I = two_i // 2
    some = B_gate if B_gate is not None else B_up
    rank = some.shape[1]
    y = torch.empty(N, I, dtype=dtype or gate_up.dtype, device=gate_up.device)
    BLOCK_N, BLOCK_I, num_warps = _silu_tiles(N if not fixed_tiles else 256)  # fixed: batch-invariant mode
    _silu_mul_lora_kernel[(triton.cdiv(N, BLOCK_N), triton.cdiv(I, BLOCK_I))](
        gate_up, y, t, B_gate if B_gate is not None else some, B_up if B_up is not None else some,
        N, I, gate_up.stride(0), y.stride(0), *_t_strides(t),
        0, rank if B_gate is not None else 0, float(scale_gate), float(scale_up),
        HAS_G=B_gate is not None, HAS_U=B_up is not None, RANK=rank, R_PAD=max(16, triton.next_power_of_2(rank)),
        NUM_SPLITS=_num_splits(t),
        BLOCK_N=BLOCK_N, BLOCK_I=BLOCK_I, PRECISION=dot_precision(y.dtype), num_warps=num_warps,
    )
    return y


@triton.jit
def _add_rms_norm_lora_kernel(Y, T, BT, R, W, Out, ROut, H, stride_y, stride_t, stride_r, stride_o, stride_ro, scale, eps,
                              RANK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    y = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0)
    dt = Out.dtype.element_ty  # the model dtype
    delta = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(RANK):  # s · x A^T rounded to the model dtype, as in _slice_delta
        tk = (tl.load(T + row * stride_t + k).to(tl.float32) * scale).to(dt).to(tl.float32)
        delta += tk * tl.load(BT + k * H + cols, mask=mask, other=0.0).to(tl.float32)
    x = (y.to(tl.float32) + delta).to(dt)  # the projection's output, rounded once, as lora_expand_ stores it
    x = (x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)).to(dt)  # rounded like HF's add
    tl.store(ROut + row * stride_ro + cols, x, mask=mask)
    _store_rms_norm(x, W, Out + row * stride_o, cols, mask, H, eps, False)


def add_rms_norm_lora(y: torch.Tensor, t: torch.Tensor, BT: torch.Tensor, scale: float, residual: torch.Tensor,
                      weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`lora_expand_` of one slice over all columns, then `triton_ops.add_rms_norm`, in one launch.

    Per row: x = y + scale · t @ BT, residual' = x + residual, out = RMSNorm(residual'). One
    program per row; BT is the adapter's B^T in the model dtype (a shadow the spare rows keep),
    so a row reads r · H contiguous values of it (fp32 B [H, r] read per row costs more than the
    launch this saves: measured on an H100, see benchmarks/RESULTS.md).

    Args:
        y: [N, H] the projection's base output, float32 (unrounded) or the model dtype (rows may
            be strided); not changed.
        t: [N, r] x A^T, float32 or the model dtype (the spare rows of the same GEMM; rows may be strided).
        BT: [r, H] contiguous, model dtype.
        residual: [N, H]; weight: [H] the norm's gain.
        out: where to write RMSNorm(x + residual) ([N, H] in residual's dtype, rows may be
            strided), or None (a new tensor).

    Returns:
        (RMSNorm(x + residual), x + residual), each [N, H].
    """
    N, H = y.shape
    out = torch.empty(N, H, dtype=residual.dtype, device=y.device) if out is None else out
    new_residual = torch.empty_like(out)
    _add_rms_norm_lora_kernel[(N,)](
        y, t, BT, residual, weight, out, new_residual, H, y.stride(0), t.stride(0), residual.stride(0), out.stride(0),
        new_residual.stride(0), float(scale), eps, RANK=BT.shape[0], BLOCK=triton.next_power_of_2(H), num_warps=8,
    )
    return out, new_residual


@triton.jit
def _heads_delta(Tp, BT, width, cols, mask, scale, like, RANK: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Σ_k round(scale · t_k) · BT[k, cols] in float32 for a [BLOCK_H, HALF] block of head columns."""
    delta = tl.zeros([BLOCK_H, HALF], tl.float32)
    for k in tl.static_range(RANK):
        tk = (tl.load(Tp + k).to(tl.float32) * scale).to(like.dtype).to(tl.float32)
        delta += tk * tl.load(BT + k * width + cols, mask=mask, other=0.0).to(tl.float32)
    return delta


@triton.jit
def _load_heads(X, Tp, BT, width, scale, heads, d, hmask, like, HAS: tl.constexpr, RANK: tl.constexpr,
                BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """Both halves of a token's heads at X ([heads, 1] pointers), with the LoRA delta added when HAS,
    rounded once to `like`'s dtype (the model's)."""
    m = hmask[:, None]
    x1 = tl.load(X + d[None, :], mask=m, other=0.0)
    x2 = tl.load(X + HALF + d[None, :], mask=m, other=0.0)
    if HAS:
        cols = heads[:, None] * (2 * HALF) + d[None, :]
        x1 = x1.to(tl.float32) + _heads_delta(Tp, BT, width, cols, m, scale, like, RANK, BLOCK_H, HALF)
        x2 = x2.to(tl.float32) + _heads_delta(Tp, BT, width, cols + HALF, m, scale, like, RANK, BLOCK_H, HALF)
    return x1.to(like.dtype), x2.to(like.dtype)


@triton.jit
def _rotary_store_lora_kernel(
    Q, QOut, K, V, Cos, Sin, KCache, VCache, Slots, T, BTq, BTk, BTv,
    stride_qt, stride_qh, stride_qot, stride_qoh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c, stride_cs,
    stride_ch, stride_t,
    num_heads, num_kv_heads, t_col_q, t_col_k, t_col_v, scale_q, scale_k, scale_v,
    HAS_Q: tl.constexpr, HAS_K: tl.constexpr, HAS_V: tl.constexpr, RANK: tl.constexpr,
    HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr,
):
    t = tl.program_id(0)
    d = tl.arange(0, HALF)
    cos1, cos2, sin1, sin2 = _cos_sin_halves(Cos, Sin, t, stride_c, d, HALF)
    t_row = T + t * stride_t
    like = tl.zeros([1], QOut.dtype.element_ty)  # the model dtype
    qh = tl.arange(0, BLOCK_Q)
    qmask = qh < num_heads
    q = Q + t * stride_qt + qh[:, None] * stride_qh
    x1, x2 = _load_heads(q, t_row + t_col_q, BTq, num_heads * 2 * HALF, scale_q, qh, d, qmask, like, HAS_Q, RANK,
                         BLOCK_Q, HALF)
    o1, o2 = _rotate_halves(x1, x2, cos1, cos2, sin1, sin2)
    _store_halves(QOut + t * stride_qot + qh[:, None] * stride_qoh, o1, o2, d, qmask, HALF)
    kh = tl.arange(0, BLOCK_KV)
    kmask = kh < num_kv_heads
    kv_width = num_kv_heads * 2 * HALF
    slot = tl.load(Slots + t).to(tl.int64)
    x1, x2 = _load_heads(K + t * stride_kt + kh[:, None] * stride_kh, t_row + t_col_k, BTk, kv_width, scale_k, kh, d,
                         kmask, like, HAS_K, RANK, BLOCK_KV, HALF)
    k1, k2 = _rotate_halves(x1, x2, cos1, cos2, sin1, sin2)
    _store_halves(KCache + slot * stride_cs + kh[:, None] * stride_ch, k1, k2, d, kmask, HALF)
    v1, v2 = _load_heads(V + t * stride_vt + kh[:, None] * stride_vh, t_row + t_col_v, BTv, kv_width, scale_v, kh, d,
                         kmask, like, HAS_V, RANK, BLOCK_KV, HALF)
    _store_halves(VCache + slot * stride_cs + kh[:, None] * stride_ch, v1, v2, d, kmask, HALF)


def rotary_and_store_lora_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, t: torch.Tensor,
                           slices: list[tuple[int, torch.Tensor, float] | None], q_out: torch.Tensor) -> torch.Tensor:
    """`triton_ops.rotary_and_store_` with the q/k/v LoRA delta added first (the q/k/v expand, fused).

    q, k and v are the q/k/v GEMM's float32 output (unrounded: each gets its delta, then one
    rounding to the model dtype, modeling/precision.py) or model-dtype views. q's rotation goes to
    `q_out`; k and v go to the cache (q, k and v themselves are not changed).

    Args:
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping: as `triton_ops.rotary_and_store_`.
        t: [N, S·r] x A^T, float32 or the model dtype (the q/k/v GEMM's spare rows; rows may be strided).
        slices: for q, k and v, (first column of its x A^T in t, its B^T [r, width] in the model
            dtype, contiguous, its scale alpha / r), or None where that projection has no LoRA.
        q_out: [N, Hq, D] in the model dtype (unit stride in D).

    Returns:
        q_out.
    """
    N, heads, D = q.shape
    kv_heads = k.shape[1]
    cache_k = k_cache.view(-1, kv_heads, D)
    some = next(s for s in slices if s is not None)
    cols, bts, scales = zip(*[(s[0], s[1], s[2]) if s is not None else (0, some[1], 0.0) for s in slices])
    _rotary_store_lora_kernel[(N,)](
        q, q_out, k, v, cos, sin, cache_k, v_cache.view(-1, kv_heads, D), slot_mapping, t, *bts,
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), cache_k.stride(0), cache_k.stride(1), t.stride(0), heads, kv_heads, *cols,
        *[float(s) for s in scales],
        HAS_Q=slices[0] is not None, HAS_K=slices[1] is not None, HAS_V=slices[2] is not None, RANK=some[1].shape[0],
        HALF=D // 2, BLOCK_Q=triton.next_power_of_2(heads), BLOCK_KV=triton.next_power_of_2(kv_heads),
    )
    return q_out
