"""Binding the engine to the Hugging Face model's weight tensors, shared with the trainer.

q/k/v (and gate/up) are fused into one weight so the engine runs one matmul instead of three.
The fused tensor is built once, and the HF modules' weights become views into it: the trainer's
modules and the engine read the same memory, and nothing is stored twice.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["fuse_linears"]


def fuse_linears(modules: list[nn.Linear], names: list[str]) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, slice]]:
    """Concatenate `modules`' weights (and biases) along the output dim and rebind them as views.

    Returns:
        (weight [sum(out), in], bias [sum(out)] or None, {name: output slice}).
        Calling it again on already-fused modules returns the existing fused tensors.
    """
    weights = [m.weight for m in modules]
    base = weights[0]
    shared = base._base if base._base is not None else None
    slices, start = {}, 0
    for name, w in zip(names, weights):
        slices[name] = slice(start, start + w.shape[0])
        start += w.shape[0]
    if shared is not None and all(w._base is shared for w in weights) and shared.shape[0] == start:
        fused_w = shared  # fused by an earlier engine on this model
    else:
        fused_w = torch.cat([w.detach() for w in weights], dim=0)
        for m, name in zip(modules, names):
            m.weight = nn.Parameter(fused_w[slices[name]], requires_grad=False)
    biases = [m.bias for m in modules]
    fused_b = None
    if any(b is not None for b in biases):
        if not all(b is not None for b in biases):
            raise ValueError("cannot fuse projections of which only some have a bias")
        bshared = biases[0]._base
        if bshared is not None and all(b._base is bshared for b in biases):
            fused_b = bshared
        else:
            fused_b = torch.cat([b.detach() for b in biases], dim=0)
            for m, name in zip(modules, names):
                m.bias = nn.Parameter(fused_b[slices[name]], requires_grad=False)
    return fused_w, fused_b, slices


def base_layer(module: Any) -> nn.Linear:
    """The plain nn.Linear under a PEFT LoRA wrapper (or the module itself)."""
    return getattr(module, "base_layer", module)
