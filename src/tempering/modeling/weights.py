"""Binding the engine to the Hugging Face model's weight tensors, shared with the trainer.

q/k/v (and gate/up) are fused into one weight so the engine runs one matmul instead of three.
The fused tensor is built once, and the HF modules' weights become views into it: the trainer's
modules and the engine read the same memory, and nothing is stored twice.

A fused (or single) weight may be allocated with `extra_rows` spare rows after the projection's
own rows. The engine writes the live LoRA adapter's A matrices there, so one GEMM computes both
`x W^T` and the adapter's `x A^T` (see engine/lora.py); everyone else sees only the
projection's rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["base_layer", "extend_linear", "full_rows", "fuse_linears"]


_ALLOCATION = "_tempering_fused_allocation"  # on a Parameter that fuse_linears made: its whole allocation


def _shared_base(tensors: list[torch.Tensor], num_rows: int) -> torch.Tensor | None:
    """The allocation of an earlier `fuse_linears` that `tensors` are consecutive leading rows of,
    if they are. (The Parameters it binds are views whose `_base` is not kept, so each carries its
    allocation as an attribute.)"""
    shared = getattr(tensors[0], _ALLOCATION, None)
    if shared is None or shared.shape[0] < num_rows:
        return None
    offset = 0
    for t in tensors:
        if getattr(t, _ALLOCATION, None) is not shared or t.data_ptr() != shared[offset].data_ptr():
            return None
        offset += t.shape[0]
    return shared


def _bind(module: nn.Module, attr: str, full: torch.Tensor, rows: slice) -> None:
    """Rebind `module.attr` (weight or bias) as a frozen Parameter over `rows` of `full`."""
    param = nn.Parameter(full[rows], requires_grad=False)
    setattr(param, _ALLOCATION, full)
    setattr(module, attr, param)


def fuse_linears(modules: list[nn.Linear], names: list[str], *, extra_rows: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, slice]]:
    """Concatenate `modules`' weights (and biases) along the output dim and rebind them as views.

    Args:
        modules: the projections to fuse, in output order.
        names: their names (keys of the returned slices).
        extra_rows: spare zero rows to allocate after the fused rows (the engine's LoRA rows).

    Returns:
        (weight [sum(out), in], bias [sum(out)] or None, {name: output slice}); the weight and
        bias are views of the first rows of the allocation (see `full_rows`). Calling it again on
        already-fused modules (the trainer after the engine, on one model) returns views of the
        existing allocation: the base weights are never held twice.

    Raises:
        ValueError: if only some of the modules have a bias.
    """
    weights = [m.weight for m in modules]
    slices, start = {}, 0
    for name, w in zip(names, weights):
        slices[name] = slice(start, start + w.shape[0])
        start += w.shape[0]
    shared = _shared_base(weights, start)
    if shared is not None and shared.shape[0] >= start + extra_rows:
        fused_w = shared[:start]  # fused by an earlier engine or trainer on this model
    else:
        full = torch.zeros(start + extra_rows, weights[0].shape[1], dtype=weights[0].dtype, device=weights[0].device)
        torch.cat([w.detach() for w in weights], dim=0, out=full[:start])
        fused_w = full[:start]
        for m, name in zip(modules, names):
            _bind(m, "weight", full, slices[name])
    biases = [m.bias for m in modules]
    fused_b = None
    if any(b is not None for b in biases):
        if not all(b is not None for b in biases):
            raise ValueError("cannot fuse projections of which only some have a bias")
        bshared = _shared_base(biases, start)
        if bshared is not None and bshared.shape[0] >= start + extra_rows:
            fused_b = bshared[:start]
        else:
            full_b = torch.zeros(start + extra_rows, dtype=biases[0].dtype, device=biases[0].device)
            torch.cat([b.detach() for b in biases], dim=0, out=full_b[:start])
            fused_b = full_b[:start]
            for m, name in zip(modules, names):
                _bind(m, "bias", full_b, slices[name])
    return fused_w, fused_b, slices


def extend_linear(module: nn.Linear, extra_rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Give a single projection `extra_rows` spare rows (its weight becomes a view); returns (weight, bias)."""
    fused_w, fused_b, _ = fuse_linears([module], ["weight"], extra_rows=extra_rows)
    return fused_w, fused_b


def full_rows(view: torch.Tensor | None) -> torch.Tensor | None:
    """The whole allocation behind a weight returned by `fuse_linears` (its rows plus the spare rows)."""
    if view is None:
        return None
    return view._base if view._base is not None else view


def base_layer(module: Any) -> nn.Linear:
    """The plain nn.Linear under a PEFT LoRA wrapper (or the module itself)."""
    return getattr(module, "base_layer", module)
