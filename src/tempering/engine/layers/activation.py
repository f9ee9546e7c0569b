"""SwiGLU's gate (Shazeer 2020, arXiv 2002.05202), PyTorch (CPU path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["silu_and_mul"]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a fused gate/up projection [N, 2I] → [N, I]."""
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :half]) * gate_up[:, half:]
