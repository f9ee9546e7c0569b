"""LoRA at inference: the trainer's live adapter tensors, applied without merging.

`y = x W^T + s (x A^T) B^T` with s = alpha / r (Hu et al. 2021, arXiv 2106.09685). A and B are
the very tensors PEFT trains (found on the Hugging Face model's LoRA layers), so when the
optimizer updates them in place, the next engine step samples from the new policy: no copy, no
reload. Base weights are never merged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modeling.lora import AdapterWeights, collect_adapter

__all__ = ["AdapterWeights", "LoRASegment", "add_lora", "collect_adapter"]


@dataclass(slots=True)
class LoRASegment:
    """Rows [start, end) of the flat batch use `adapter` (None: the base weights)."""

    start: int
    end: int
    adapter: AdapterWeights | None


def add_lora(y: torch.Tensor, x: torch.Tensor, segments: list[LoRASegment], layer: int, group: str) -> torch.Tensor:
    """Add each segment's LoRA delta of `group` in `layer` to y [N, out] (in place), for input x [N, in]."""
    for seg in segments:
        if seg.adapter is None:
            continue
        entries = seg.adapter.layers[layer][group]
        if not entries:
            continue
        rows = slice(seg.start, seg.end)
        xs = x[rows]
        for e in entries:
            delta = (xs.to(e.A.dtype) @ e.A.T) @ e.B.T  # [n, out_e], in the adapter's dtype (as PEFT)
            y[rows, e.out] += (delta * e.scale).to(y.dtype)
    return y
