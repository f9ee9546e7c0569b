"""LoRA at inference: the trainer's live adapter tensors, applied without merging.

`y = x W^T + s (x A^T) B^T` with s = alpha / r (Hu et al. 2021, arXiv 2106.09685). A and B are
the very tensors PEFT trains (found on the Hugging Face model's LoRA layers), so when the
optimizer updates them in place, the next engine step samples from the new policy: no copy, no
reload. Base weights are never merged.

On CUDA each fused projection (q/k/v, o, gate/up, down) costs two small Triton kernels, a shrink
and an expand over all its slices (`layers/triton_lora.py`); gate/up's expand is fused into the
SwiGLU kernel. Elsewhere (CPU) the same math runs as PyTorch matmuls in the adapter's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modeling.lora import AdapterWeights, collect_adapter

__all__ = ["AdapterWeights", "EngineAdapter", "LoRAGroup", "LoRASegment", "add_lora", "collect_adapter",
           "lora_silu_and_mul"]

try:  # the CUDA kernels need Triton, which CPU builds of torch do not bring
    from .layers import triton_lora
except ImportError:  # pragma: no cover - depends on the installation
    triton_lora = None

GROUPS = ("qkv", "o", "gate_up", "down")


@dataclass(slots=True)
class LoRAGroup:
    """The LoRA slices of one fused projection of one layer, ready for the kernels.

    Attributes:
        A: per slice [r, in] (the trainer's tensors, by reference).
        B: per slice [out_s, r].
        columns: per slice, its output columns in the fused projection.
        scales: per slice, alpha / r.
        use_kernels: every slice has the same rank, contiguous tensors, at most 3 slices.
    """

    A: list[torch.Tensor]
    B: list[torch.Tensor]
    columns: list[slice]
    scales: list[float]
    use_kernels: bool


class EngineAdapter:
    """One adapter as the engine applies it: its tensors grouped per layer and fused projection.

    Args:
        weights: references to the adapter's PEFT tensors (`collect_adapter`).
        out_features: {"o": hidden size, "down": hidden size} for the projections whose output
            is not fused.
    """

    def __init__(self, weights: AdapterWeights, out_features: dict[str, int]) -> None:
        self.weights = weights
        self.name = weights.name
        self.layers: list[dict[str, LoRAGroup | None]] = []
        for layer in weights.layers:
            groups: dict[str, LoRAGroup | None] = {}
            for group in GROUPS:
                entries = layer[group]
                if not entries:
                    groups[group] = None
                    continue
                columns = [e.out if e.out.stop is not None else slice(0, out_features[group]) for e in entries]
                ranks = {e.A.shape[0] for e in entries}
                use_kernels = (
                    len(entries) <= 3 and len(ranks) == 1
                    and all(e.A.is_contiguous() and e.B.is_contiguous() for e in entries)
                )
                groups[group] = LoRAGroup([e.A for e in entries], [e.B for e in entries], columns,
                                          [e.scale for e in entries], use_kernels)
            self.layers.append(groups)


@dataclass(slots=True)
class LoRASegment:
    """Rows [start, end) of the flat batch use `adapter` (None: the base weights)."""

    start: int
    end: int
    adapter: EngineAdapter | None


def _kernels_for(y: torch.Tensor) -> bool:
    return y.is_cuda and triton_lora is not None


def add_lora(y: torch.Tensor, x: torch.Tensor, segments: list[LoRASegment], layer: int, group: str) -> torch.Tensor:
    """Add each segment's LoRA delta of `group` in `layer` to y [N, out] (in place), for input x [N, in]."""
    kernels = _kernels_for(y)
    for seg in segments:
        if seg.adapter is None or (g := seg.adapter.layers[layer][group]) is None:
            continue
        rows = slice(seg.start, seg.end)
        if kernels and g.use_kernels:
            t = triton_lora.lora_shrink(x[rows], g.A)
            triton_lora.lora_expand_(y[rows], t, g.B, g.columns, g.scales)
            continue
        xs = x[rows]
        for A, B, cols, scale in zip(g.A, g.B, g.columns, g.scales):
            delta = (xs.to(A.dtype) @ A.T) @ B.T  # [n, out_s], in the adapter's dtype (as PEFT)
            y[rows, cols] += (delta * scale).to(y.dtype)
    return y


def lora_silu_and_mul(gate_up: torch.Tensor, h: torch.Tensor, segments: list[LoRASegment], layer: int,
                      silu_and_mul) -> torch.Tensor:
    """silu(gate) * up of `gate_up` [N, 2I] with each segment's gate/up LoRA delta added first.

    On CUDA, a batch with one adapter for every row runs the delta inside the SwiGLU kernel
    (the [N, 2I] projection output is not read and written an extra time); otherwise the delta
    is added by `add_lora` and `silu_and_mul` runs as usual.
    """
    if len(segments) == 1 and _kernels_for(gate_up):
        seg = segments[0]
        g = seg.adapter.layers[layer]["gate_up"] if seg.adapter is not None else None
        if seg.start == 0 and seg.end == gate_up.shape[0] and g is not None and g.use_kernels:
            half = gate_up.shape[1] // 2
            by_start = {c.start: (B, s) for B, c, s in zip(g.B, g.columns, g.scales)}
            gate, up = by_start.get(0, (None, 0.0)), by_start.get(half, (None, 0.0))
            t = triton_lora.lora_shrink(h, g.A)
            return triton_lora.silu_and_mul_lora(gate_up, t, gate[0], up[0], gate[1], up[1])
    if segments:
        add_lora(gate_up, h, segments, layer, "gate_up")
    return silu_and_mul(gate_up)
