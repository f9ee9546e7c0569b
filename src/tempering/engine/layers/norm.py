"""RMSNorm exactly as Hugging Face's Llama/Qwen implementations compute it (PyTorch; CPU path)."""

from __future__ import annotations

import torch

__all__ = ["add_rms_norm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / sqrt(mean(x^2) + eps)`, computed in float32 (Zhang & Sennrich 2019, arXiv 1910.07467).

    Args:
        x: [..., H] activations.
        weight: [H] gain.

    Returns:
        [..., H] in x's dtype.
    """
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual): the residual add and the next layer's norm."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual
