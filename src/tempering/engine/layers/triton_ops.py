"""Fused elementwise kernels for the GPU decoder (Triton); the CPU path uses their PyTorch twins.

Without fusion a decoder layer launches ~40 tiny kernels (the norm's cast, square, mean, rsqrt,
multiply..., rotary's slices and concatenations); at batch 256 they cost more than the GEMMs.
These kernels do each job in one launch and round exactly where Hugging Face's modules round:

- `add_rms_norm`: residual = x + residual (in the model dtype), then RMSNorm of it.
- `rms_norm`: RMSNorm over the last dim (also used per head for Qwen3's q/k norm).
- `rotary_`: rotates q and k in place by the cos/sin of their positions ("rotate half" layout).
- `rotary_and_store_`: rotary on q (in place) and k, and k and v written to their KV-cache slots,
  in one launch per layer instead of four (two rotations, two indexed copies).
- `silu_and_mul`: silu(gate) * up of a fused gate/up projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_rms_norm", "dot_precision", "gemma_rms_norm", "rms_norm", "rotary_", "rotary_and_store_", "silu_and_mul"]


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input_precision for operands of `dtype`. Float32 models follow PyTorch's own
    setting for float32 products, so the Triton kernels and cuBLAS round alike: exact ("ieee")
    under `torch.set_float32_matmul_precision("highest")` (PyTorch's default), TF32 tensor cores
    under "high"/"medium". Half precision uses the tensor cores' own."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


@triton.jit
def _rms_norm_kernel(X, R, W, Y, ROut, stride_x, stride_r, stride_y, stride_ro, H, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GAIN_F32: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0)).to(x.dtype)  # rounded like HF's add
        tl.store(ROut + row * stride_ro + cols, x, mask=mask)
    _store_rms_norm(x, W, Y + row * stride_y, cols, mask, H, eps, GAIN_F32)


@triton.jit
def _store_rms_norm(x, W, Y, cols, mask, H, eps, GAIN_F32: tl.constexpr):
    """Y[cols] = W * RMSNorm(x) for one row x [BLOCK] (float32 statistics, rounded as HF's module):
    Llama's rounds the normed row before the weight; with GAIN_F32 (Gemma's, W the float32 gain 1 + w)
    the product is rounded once."""
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, axis=0) / H
    w = tl.load(W + cols, mask=mask, other=0.0)
    if GAIN_F32:
        tl.store(Y + cols, (x32 * tl.rsqrt(var + eps) * w).to(x.dtype), mask=mask)
    else:
        normed = (x32 * tl.rsqrt(var + eps)).to(x.dtype)
        tl.store(Y + cols, (w * normed).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] (rows may be strided views, e.g. heads of a q/k slice)."""
    return _rms_norm(x, weight, eps, gain_f32=False)


def gemma_rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm of x [..., H] with `gain` [H] float32 (1 + w), rounded once after the gain
    (modeling/gemma.gemma_rms_norm's math), one program per row: a row's sums never depend on the
    batch (the batch-invariant engine's; PyTorch's fused kernel makes no such promise)."""
    return _rms_norm(x, gain, eps, gain_f32=True)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gain_f32: bool) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    H = shape[-1]
    _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, y, y, x2.stride(0), 0, y.stride(0), 0, H, eps,
                                     HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(H), GAIN_F32=gain_f32)
    return y.view(shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) for x, residual [N, H]."""
    N, H = x.shape
    y = torch.empty_like(x)
    new_residual = torch.empty_like(x)
    _rms_norm_kernel[(N,)](x, residual, weight, y, new_residual, x.stride(0), residual.stride(0), y.stride(0),
                           new_residual.stride(0), H, eps, HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(H),
                           GAIN_F32=False)
    return y, new_residual


@triton.jit
def _rotary_kernel(X, Cos, Sin, stride_xt, stride_xh, stride_c, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    hmask = heads < num_heads
    base = X + t * stride_xt + heads[:, None] * stride_xh
    cos1, cos2, sin1, sin2 = _cos_sin_halves(Cos, Sin, t, stride_c, d, HALF)
    o1, o2 = _rotate(base, cos1, cos2, sin1, sin2, d, hmask, HALF)
    _store_halves(base, o1, o2, d, hmask, HALF)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, D] in place by cos/sin [N, D] (a strided view of q or k is fine)."""
    N, heads, D = x.shape
    _rotary_kernel[(N,)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), heads,
                         HALF=D // 2, BLOCK_H=triton.next_power_of_2(heads))
    return x


@triton.jit
def _rotate(base, cos1, cos2, sin1, sin2, d, hmask, HALF: tl.constexpr):
    """The rotated halves of the heads at `base` ([heads, 1] pointers), rounded as HF rounds."""
    x1 = tl.load(base + d[None, :], mask=hmask[:, None], other=0.0)
    x2 = tl.load(base + HALF + d[None, :], mask=hmask[:, None], other=0.0)
    return _rotate_halves(x1, x2, cos1, cos2, sin1, sin2)


@triton.jit
def _cos_sin_halves(Cos, Sin, t, stride_c, d, HALF: tl.constexpr):
    """Row t of cos and sin, each as its two halves [1, HALF]."""
    row = t * stride_c + d
    return (tl.load(Cos + row)[None, :], tl.load(Cos + row + HALF)[None, :],
            tl.load(Sin + row)[None, :], tl.load(Sin + row + HALF)[None, :])


@triton.jit
def _store_halves(base, x1, x2, d, hmask, HALF: tl.constexpr):
    """x1 and x2 [heads, HALF] into the first and second halves of the heads at `base` ([heads, 1] pointers)."""
    tl.store(base + d[None, :], x1, mask=hmask[:, None])
    tl.store(base + HALF + d[None, :], x2, mask=hmask[:, None])


@triton.jit
def _rotate_halves(x1, x2, cos1, cos2, sin1, sin2):
    """HF's x * cos + rotate_half(x) * sin of the halves x1, x2, each product and the sum rounded to the model dtype."""
    o1 = ((x1 * cos1).to(x1.dtype) + (-x2 * sin1).to(x1.dtype)).to(x1.dtype)
    o2 = ((x2 * cos2).to(x1.dtype) + (x1 * sin2).to(x1.dtype)).to(x1.dtype)
    return o1, o2


@triton.jit
def _rotary_store_kernel(Q, K, V, Cos, Sin, KCache, VCache, Slots, stride_qt, stride_qh, stride_kt, stride_kh,
                         stride_vt, stride_vh, stride_c, stride_cs, stride_ch, num_heads, num_kv_heads,
                         HALF: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr):
    t = tl.program_id(0)
    d = tl.arange(0, HALF)
    cos1, cos2, sin1, sin2 = _cos_sin_halves(Cos, Sin, t, stride_c, d, HALF)
    qh = tl.arange(0, BLOCK_Q)
    qmask = qh < num_heads
    q = Q + t * stride_qt + qh[:, None] * stride_qh
    o1, o2 = _rotate(q, cos1, cos2, sin1, sin2, d, qmask, HALF)
    _store_halves(q, o1, o2, d, qmask, HALF)
    kh = tl.arange(0, BLOCK_KV)
    kmask = kh < num_kv_heads
    slot = tl.load(Slots + t).to(tl.int64)
    k1, k2 = _rotate(K + t * stride_kt + kh[:, None] * stride_kh, cos1, cos2, sin1, sin2, d, kmask, HALF)
    _store_halves(KCache + slot * stride_cs + kh[:, None] * stride_ch, k1, k2, d, kmask, HALF)
    v = V + t * stride_vt + kh[:, None] * stride_vh
    v1 = tl.load(v + d[None, :], mask=kmask[:, None], other=0.0)
    v2 = tl.load(v + HALF + d[None, :], mask=kmask[:, None], other=0.0)
    _store_halves(VCache + slot * stride_cs + kh[:, None] * stride_ch, v1, v2, d, kmask, HALF)


def rotary_and_store_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rotate q [N, Hq, D] in place and k [N, Hkv, D] by cos/sin [N, D]; write the rotated k and v
    [N, Hkv, D] to the caches [num_blocks, block_size, Hkv, D] at `slot_mapping` [N] int64.

    q, k and v may be strided views of one fused projection (unit stride in D); k itself is not
    changed (only the cache is read afterwards). Equals `rotary_` on q and k, then `store_kv`.
    """
    N, heads, D = q.shape
    kv_heads = k.shape[1]
    cache_k = k_cache.view(-1, kv_heads, D)
    _rotary_store_kernel[(N,)](q, k, v, cos, sin, cache_k, v_cache.view(-1, kv_heads, D), slot_mapping,
                               q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               cos.stride(0), cache_k.stride(0), cache_k.stride(1), heads, kv_heads,
                               HALF=D // 2, BLOCK_Q=triton.next_power_of_2(heads), BLOCK_KV=triton.next_power_of_2(kv_heads))


@triton.jit
def _silu_mul_kernel(X, Y, stride_x, stride_y, I, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + I + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)  # silu, rounded like F.silu
    tl.store(Y + row * stride_y + cols, (act * up).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [N, 2I] → [N, I]."""
    N, two_i = gate_up.shape
    I = two_i // 2
    y = torch.empty(N, I, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(N, triton.cdiv(I, BLOCK))](gate_up, y, gate_up.stride(0), y.stride(0), I, BLOCK=BLOCK)
    return y
