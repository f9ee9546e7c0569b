"""Rotary position embeddings (RoFormer, Su et al. 2021, arXiv 2104.09864), HF's "rotate half" layout.

The cos/sin table comes from the Hugging Face model's own rotary module, called once for every
position, so every rope variant it supports (Llama 3 scaling, linear, YaRN, ...) is matched
exactly. Variants whose table depends on the sequence length ("dynamic") are not supported.
"""

from __future__ import annotations

from typing import Any

import torch

from ...modeling.rotary import apply_rotary

__all__ = ["RotaryTable", "apply_rotary", "rope_is_static", "rotary_"]


def rope_is_static(config: Any) -> bool:
    """False for rope types whose frequencies change with the sequence length."""
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    return kind in ("default", "linear", "llama3", "yarn", None)


class RotaryTable:
    """cos/sin of every position up to `max_positions`.

    Args:
        rotary_emb: the HF model's rotary module (`model.model.rotary_emb`).
        max_positions: table length.
        dtype: the model's dtype (HF casts cos/sin to it).
    """

    def __init__(self, rotary_emb: Any, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        positions = torch.arange(max_positions, device=device)[None, :]
        dummy = torch.zeros(1, dtype=dtype, device=device)
        with torch.no_grad():
            cos, sin = rotary_emb(dummy, positions)
        self.cos = cos[0].to(dtype)  # [P, D]
        self.sin = sin[0].to(dtype)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` [N] → each [N, D]."""
        return self.cos[positions], self.sin[positions]


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` written back into x (a view of q or k) in place."""
    return x.copy_(apply_rotary(x, cos, sin))
