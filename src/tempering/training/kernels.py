"""Fused elementwise ops of the training forward, with their backward passes (Triton on CUDA).

Written as autograd Functions so that one launch does what PyTorch does in five to ten (casts,
squares, means, slices, the zero-filled gradient of a slice...). The base weights are frozen
(LoRA), so no weight gradient is ever computed here. `ops_for(device)` picks the Triton versions
on CUDA and the PyTorch twins (plain autograd, the same math) elsewhere; tests compare the two.

- `rms_norm(x, w, eps)`: w * (x / sqrt(mean(x²) + eps)) over the last dim (Zhang & Sennrich 2019).
- `silu_and_mul(gate_up)`: silu(gate) * up of a fused [T, 2I] projection (SwiGLU, Shazeer 2020).
- `rotary(x, cos, sin)`: x [T, heads, D] rotated by its positions' cos/sin [T, D] ("rotate half").
- `logprob_epilogue(logits, targets, inv_temperature)`: per row, the target's log-softmax,
  the entropy, and d logprob / d logits written over the logits (used by logprobs.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from ..modeling.rotary import apply_rotary

__all__ = ["TORCH_OPS", "ops_for"]


# ---- PyTorch twins (CPU, and reference for the tests) --------------------------------------------

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalized in float32, rounded to x's dtype, times the weight. [..., H] → [..., H]."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] → [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def logprob_epilogue_torch(logits: torch.Tensor, targets: torch.Tensor, inv_temperature: torch.Tensor,
                           need_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Logprobs and entropies of z = logits * inv_temperature, and d logprob / d logits.

    Args:
        logits: [n, V] (any float dtype).
        targets: [n] int64.
        inv_temperature: [n] float32.
        need_grad: whether to return the gradient.

    Returns:
        (logprob [n] float32, entropy [n] float32 in nats, gradient [n, V] float32 or None), where
        the gradient of row i is (onehot(target_i) - softmax(z_i)) * inv_temperature_i.
    """
    z = logits.float() * inv_temperature[:, None]
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    del z
    chosen = logp.gather(1, targets[:, None]).squeeze(1)
    p = logp.exp()
    entropy = -(p * logp).sum(-1)
    del logp
    if not need_grad:
        return chosen, entropy, None
    grad = p.neg_()
    grad.scatter_add_(1, targets[:, None], torch.ones_like(chosen)[:, None])
    return chosen, entropy, grad.mul_(inv_temperature[:, None])


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's own RMSNorm (one fused kernel each way on CUDA); rounds once, after the weight."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


TORCH_OPS = SimpleNamespace(rms_norm=rms_norm_torch, silu_and_mul=silu_and_mul_torch, rotary=apply_rotary,
                            logprob_epilogue=logprob_epilogue_torch)

# Which implementation each op uses on CUDA (benchmarks may change it). PyTorch's rotary is five
# elementwise passes over strided q/k; the Triton one reads and writes each once. RMSNorm is the
# Triton one, which rounds as HF's module (and the engine's kernel) rounds: torch's own
# ("native", one kernel each way) rounds once, after the weight, and so computes a slightly
# different function from the one the engine samples from.
CUDA_KERNELS = {"rms_norm": "triton", "silu_and_mul": "triton", "rotary": "triton", "logprob_epilogue": "triton"}


def ops_for(device: torch.device) -> SimpleNamespace:
    """rms_norm, silu_and_mul, rotary and logprob_epilogue for tensors on `device`."""
    if device.type != "cuda":
        return TORCH_OPS
    try:
        from . import triton_kernels
    except ImportError:  # no Triton: the PyTorch versions run on CUDA too
        triton_kernels = None
    ops = {}
    for name, choice in CUDA_KERNELS.items():
        if choice == "triton" and triton_kernels is not None:
            ops[name] = getattr(triton_kernels, name)
        elif choice == "native" and name == "rms_norm":
            ops[name] = rms_norm_native
        else:
            ops[name] = getattr(TORCH_OPS, name)
    return SimpleNamespace(**ops)
