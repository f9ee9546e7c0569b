"""Triton versions of the training ops in kernels.py (CUDA only; imported lazily).

The rotary embedding (RoFormer, arXiv 2104.09864) writes a new contiguous tensor, rounded as
Hugging Face's (and the engine's) rotation rounds, and its backward is the transposed rotation.

Each forward/backward pair is one launch per tensor. RMSNorm keeps 1/rms per row for its
backward; SwiGLU recomputes silu in its backward from the saved [T, 2I] input and writes both
halves of the input gradient in place (no zero-filled slice gradients); the logprob epilogue is
an online softmax (Milakov & Gimelshein 2018, arXiv 1805.02867) over the vocabulary in two
passes: statistics, then the gradient written over the logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["logprob_epilogue", "rms_norm", "rotary", "silu_and_mul"]


# ---- RMSNorm ---------------------------------------------------------------------------------------

@triton.jit
def _rms_fwd(X, W, Y, RSTD, stride_x, stride_y, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / H + eps)
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(Y + row * stride_y + cols, (w * (x32 * rstd).to(x.dtype)).to(x.dtype), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_bwd(DY, X, W, RSTD, DX, stride_dy, stride_x, stride_dx, H, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + row)
    n = x * rstd
    dn = dy * w
    dx = rstd * (dn - n * (tl.sum(dn * n, axis=0) / H))
    tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows, H = x2.shape
        y = torch.empty(rows, H, dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(H)
        _rms_fwd[(rows,)](x2, weight, y, rstd, x2.stride(0), y.stride(0), H, eps, BLOCK=block)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape, ctx.block = shape, block
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = torch.empty_like(x2)
        _rms_bwd[(x2.shape[0],)](dy2, x2, weight, rstd, dx, dy2.stride(0), x2.stride(0), dx.stride(0), x2.shape[1],
                                 BLOCK=ctx.block)
        return dx.view(ctx.shape), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] with a frozen weight [H]; differentiable in x only."""
    if weight.requires_grad:
        raise ValueError("the fused RMSNorm has no weight gradient; it is for frozen norms (LoRA training)")
    return _RMSNorm.apply(x, weight, eps)


# ---- rotary embedding ----------------------------------------------------------------------------

@triton.jit
def _rotary(X, Cos, Sin, Y, stride_xt, stride_xh, stride_yt, stride_yh, stride_c, num_heads,
            BACKWARD: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    hmask = heads[:, None] < num_heads
    x_base = X + t * stride_xt + heads[:, None] * stride_xh
    x1 = tl.load(x_base + d[None, :], mask=hmask, other=0.0).to(tl.float32)
    x2 = tl.load(x_base + HALF + d[None, :], mask=hmask, other=0.0).to(tl.float32)
    c1 = tl.load(Cos + t * stride_c + d)[None, :].to(tl.float32)
    c2 = tl.load(Cos + t * stride_c + HALF + d)[None, :].to(tl.float32)
    s1 = tl.load(Sin + t * stride_c + d)[None, :].to(tl.float32)
    s2 = tl.load(Sin + t * stride_c + HALF + d)[None, :].to(tl.float32)
    if BACKWARD:  # the transpose of the rotation below, in float32
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:  # x * cos + rotate_half(x) * sin, each product and the sum rounded as HF (and the engine) round
        dt = Y.dtype.element_ty
        y1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    y_base = Y + t * stride_yt + heads[:, None] * stride_yh
    tl.store(y_base + d[None, :], y1.to(Y.dtype.element_ty), mask=hmask)
    tl.store(y_base + HALF + d[None, :], y2.to(Y.dtype.element_ty), mask=hmask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    T, heads, D = x.shape
    y = torch.empty(T, heads, D, dtype=x.dtype, device=x.device)
    _rotary[(T,)](x, cos, sin, y, x.stride(0), x.stride(1), y.stride(0), y.stride(1), cos.stride(0), heads,
                  BACKWARD=backward, HALF=D // 2, BLOCK_H=triton.next_power_of_2(heads))
    return y


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        cos, sin = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        return _rotate(dy, cos, sin, backward=True), None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (any row/head strides) rotated by cos/sin [T, D] into a new contiguous tensor."""
    return _Rotary.apply(x, cos, sin)


# ---- SwiGLU --------------------------------------------------------------------------------------

@triton.jit
def _silu_mul_fwd(GU, A, stride_gu, stride_a, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0)
    up = tl.load(GU + row * stride_gu + I + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # silu, rounded like F.silu
    tl.store(A + row * stride_a + cols, (act * up).to(gate.dtype), mask=mask)


@triton.jit
def _silu_mul_bwd(DA, GU, DGU, stride_da, stride_gu, stride_dgu, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    da = tl.load(DA + row * stride_da + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GU + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + I + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    dg = da * u * s * (1.0 + g * (1.0 - s))
    du = da * g * s
    tl.store(DGU + row * stride_dgu + cols, dg.to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + row * stride_dgu + I + cols, du.to(DGU.dtype.element_ty), mask=mask)


_SWIGLU_BLOCK = 1024


class _SiluAndMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.stride(-1) != 1:
            gate_up = gate_up.contiguous()
        T, two_i = gate_up.shape
        I = two_i // 2
        act = torch.empty(T, I, dtype=gate_up.dtype, device=gate_up.device)
        _silu_mul_fwd[(T, triton.cdiv(I, _SWIGLU_BLOCK))](gate_up, act, gate_up.stride(0), act.stride(0), I,
                                                          BLOCK=_SWIGLU_BLOCK)
        ctx.save_for_backward(gate_up)
        return act

    @staticmethod
    def backward(ctx, da: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        da = da.contiguous()
        T, two_i = gate_up.shape
        I = two_i // 2
        dgu = torch.empty_like(gate_up)
        _silu_mul_bwd[(T, triton.cdiv(I, _SWIGLU_BLOCK))](da, gate_up, dgu, da.stride(0), gate_up.stride(0),
                                                          dgu.stride(0), I, BLOCK=_SWIGLU_BLOCK)
        return dgu


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] → [T, I], differentiable."""
    return _SiluAndMul.apply(gate_up)


# ---- logprob epilogue ------------------------------------------------------------------------------

@triton.jit
def _logprob_epilogue(L, TGT, INV_T, LP, ENT, stride_l, V, NEED_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = L + row * stride_l
    inv_t = tl.load(INV_T + row)
    target = tl.load(TGT + row)
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)  # Σ exp(z - m)
    t = tl.zeros((), tl.float32)  # Σ exp(z - m) z
    for start in range(0, V, BLOCK):
        cols = start + offs
        z = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        s = s * scale + tl.sum(e, axis=0)
        t = t * scale + tl.sum(tl.where(cols < V, e * z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    z_target = tl.load(base + target).to(tl.float32) * inv_t
    tl.store(LP + row, z_target - lse)
    tl.store(ENT + row, lse - t / s)
    if NEED_GRAD:
        for start in range(0, V, BLOCK):
            cols = start + offs
            mask = cols < V
            z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32) * inv_t
            grad = (tl.where(cols == target, 1.0, 0.0) - tl.exp(z - lse)) * inv_t
            tl.store(base + cols, grad.to(L.dtype.element_ty), mask=mask)


def logprob_epilogue(logits: torch.Tensor, targets: torch.Tensor, inv_temperature: torch.Tensor,
                     need_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """As kernels.logprob_epilogue_torch, but the gradient overwrites `logits` (in its dtype)."""
    n, V = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError("logits must be contiguous in the vocabulary dimension")
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    entropy = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _logprob_epilogue[(n,)](logits, targets, inv_temperature.float().contiguous(), logprobs, entropy,
                                logits.stride(0), V, NEED_GRAD=need_grad, BLOCK=4096, num_warps=8)
    return logprobs, entropy, logits if need_grad else None
