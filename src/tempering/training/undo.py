"""Undoing a failed training step: what the adapter, the optimizer and the RNGs were before it.

A step that fails half way (an out-of-memory error, a non-finite loss raised by a check, a
checkpoint that cannot be written, another rank's failure) must leave the live policy as it was:
the engine keeps sampling from the adapter, and a user's retry must start from the same state.
`UndoRecord` holds the update count, the RNG states and the gate's policy version from the step's
start; `save_tensors` adds the adapter and Adam's moments just before the first optimizer update
writes them, and `restore` puts all of it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["UndoRecord"]


@dataclass(slots=True)
class UndoRecord:
    """What a failed step puts back: update count and RNG states, and (once saved) the tensors."""

    num_updates: int
    python_rng: Any
    torch_rng: torch.Tensor
    version: int  # the gate's policy version before the step
    tensors: list[torch.Tensor] | None = None  # params, then optimizer state tensors at `keys`
    keys: list[tuple[int, str]] = field(default_factory=list)
    others: dict[int, dict[str, Any]] = field(default_factory=dict)  # the optimizer state's non-tensor entries

    def save_tensors(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                     buffers: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """Copy the adapter and the optimizer state into this record, once (later calls do nothing).

        The tensors (hundreds: A and B of every projection, and Adam's two moments of each) are
        copied with one multi-tensor kernel into `buffers`, kept from the last step when their
        shapes still match, not one allocation and copy each: that cost a GPU step tens of
        milliseconds of host time. Returns the buffers to keep for the next step.
        """
        if self.tensors is not None:
            return buffers
        state = optimizer.state
        self.keys = [(i, k) for i, p in enumerate(params) if p in state
                     for k, v in state[p].items() if torch.is_tensor(v)]
        tensors = [p.detach() for p in params] + [state[params[i]][k] for i, k in self.keys]
        self.others = {i: {k: v for k, v in state[p].items() if not torch.is_tensor(v)}
                       for i, p in enumerate(params) if p in state}
        if buffers is None or [b.shape for b in buffers] != [t.shape for t in tensors]:
            buffers = [torch.empty_like(t) for t in tensors]
        torch._foreach_copy_(buffers, tensors)
        self.tensors = buffers
        return buffers

    def restore_tensors(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer, gate: Any) -> bool:
        """Put the saved adapter (inside `gate`, with its policy version) and optimizer state back.

        The saved moments become the optimizer's own tensors. Returns False when nothing was saved
        (the step failed before its first update: the tensors never changed).
        """
        for p in params:
            p.grad = None
        if self.tensors is None:
            return False
        n = len(params)
        with torch.no_grad(), gate:  # a write to the shared adapter, and its version back with it
            for p, copy_ in zip(params, self.tensors[:n]):
                p.copy_(copy_)
            gate.version = self.version
        optimizer.state.clear()  # parameters without state before the step get none back
        for i, extra in self.others.items():
            optimizer.state[params[i]] = dict(extra)
        for (i, k), tensor in zip(self.keys, self.tensors[n:]):
            optimizer.state[params[i]][k] = tensor
        return True
