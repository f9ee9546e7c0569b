"""The LoRA tensors of a PEFT-wrapped model, found once and shared by reference.

`collect_adapter` returns references to PEFT's own A/B parameters (never copies), grouped by the
fused projection they belong to (q/k/v, o, gate/up, down): the engine applies them at inference
and the trainer's forward trains them, so an optimizer step is served with no reload.
`y = x W^T + s (x A^T) B^T`, s = alpha / r (Hu et al. 2021, arXiv 2106.09685).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["AdapterWeights", "LoRAEntry", "collect_adapter"]

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(slots=True)
class LoRAEntry:
    A: torch.Tensor  # [r, in]
    B: torch.Tensor  # [out, r]
    scale: float
    out: slice  # columns of the (fused) output this projection owns


@dataclass(slots=True)
class AdapterWeights:
    """One adapter's LoRA tensors, per decoder layer and fused projection ("qkv", "o", "gate_up", "down")."""

    name: str
    layers: list[dict[str, list[LoRAEntry]]] = field(default_factory=list)


def _entry(module: Any, adapter: str, out: slice) -> LoRAEntry | None:
    lora_A = getattr(module, "lora_A", None)
    if lora_A is None or adapter not in lora_A:
        return None
    if getattr(module, "use_dora", {}).get(adapter, False):
        raise ConfigError("DoRA adapters are not supported by the tempering engine")
    return LoRAEntry(lora_A[adapter].weight, module.lora_B[adapter].weight, float(module.scaling[adapter]), out)


def collect_adapter(hf_layers: list[Any], adapter: str, fused_slices: dict[str, dict[str, slice]]) -> AdapterWeights:
    """References to `adapter`'s A/B tensors in a PEFT-wrapped model's decoder layers.

    Args:
        hf_layers: the HF model's decoder layers (`model.model.layers`).
        adapter: the PEFT adapter name.
        fused_slices: {"qkv": {"q_proj": slice, ...}, "gate_up": {...}} output columns of each
            projection inside the engine's fused weights.
    """
    weights = AdapterWeights(adapter)
    for layer in hf_layers:
        groups: dict[str, list[LoRAEntry]] = {"qkv": [], "o": [], "gate_up": [], "down": []}
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            if (e := _entry(getattr(attn, name), adapter, fused_slices["qkv"][name])) is not None:
                groups["qkv"].append(e)
        if (e := _entry(attn.o_proj, adapter, slice(None))) is not None:
            groups["o"].append(e)
        for name in ("gate_proj", "up_proj"):
            if (e := _entry(getattr(mlp, name), adapter, fused_slices["gate_up"][name])) is not None:
                groups["gate_up"].append(e)
        if (e := _entry(mlp.down_proj, adapter, slice(None))) is not None:
            groups["down"].append(e)
        weights.layers.append(groups)
    return weights
