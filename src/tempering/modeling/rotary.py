"""Rotary position embeddings (RoFormer, Su et al. 2021, arXiv 2104.09864), HF's "rotate half" layout."""

from __future__ import annotations

import torch

__all__ = ["apply_rotary"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, D] by the cos/sin [N, D] of its positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
