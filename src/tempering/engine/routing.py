"""The experts every cached token was routed to (MoE routing replay), kept beside the KV cache.

A mixture-of-experts model records, in each forward, the top-k expert ids of every MoE layer at
each token's KV slot (`RoutingTable.write`, at the step's `slot_mapping`, like the K/V): one
[L_moe, slots, k] integer tensor, 0.4% of the KV cache's size for Qwen3-30B-A3B (48 layers × 8
ids of one byte per token against 96 KiB of K/V). Tokens taken from the prefix cache thus keep
the routing of the forward that computed their K/V, which is what the sample depended on.

When a sample that asked for its routing finishes, the rows of its tokens 0 .. len-2 (every
token that was an input; the last sampled one never was) are gathered on the device in one
index_select per step and copied to pinned host memory without waiting (`gather`); the request
completes once that copy is done (`PendingRouting.ready`), a step or two later, so the engine's
pipeline never stalls on it.

Reference: rollout routing replay (R3), Ma et al. 2025, arXiv 2510.11370; vLLM's and SGLang's
`routed_experts` have the same [tokens - 1, layers, k] layout.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PendingRouting", "RoutingTable", "token_slots"]


class RoutingTable:
    """Routed expert ids per MoE layer and KV slot.

    Args:
        num_layers: MoE layers (dense layers have no entry).
        num_slots: KV cache slots (blocks × block size).
        top_k: experts per token.
        dtype: uint8 (up to 256 experts) or int16.
        device: the KV cache's.
    """

    def __init__(self, num_layers: int, num_slots: int, top_k: int, dtype: torch.dtype, device: torch.device) -> None:
        self.ids = torch.zeros(num_layers, num_slots, top_k, dtype=dtype, device=device)  # [L, slots, k]

    @staticmethod
    def bytes_per_token(num_layers: int, top_k: int, dtype: torch.dtype) -> int:
        return num_layers * top_k * torch.empty(0, dtype=dtype).element_size()

    def write(self, layer: int, slot_mapping: torch.Tensor, ids: torch.Tensor) -> None:
        """Record MoE layer `layer`'s ids [N, k] of the batch's tokens at their slots [N] (no host sync)."""
        self.ids[layer].index_copy_(0, slot_mapping, ids.to(self.ids.dtype))

    def gather(self, slots: list[np.ndarray]) -> PendingRouting:
        """Start copying the rows at each sequence's `slots` [n_i] to the host (one gather, no wait)."""
        lengths = [len(s) for s in slots]
        index = torch.from_numpy(np.concatenate(slots) if slots else np.zeros(0, np.int64)).to(self.ids.device)
        rows = self.ids.index_select(1, index)  # [L, Σn, k]
        if not rows.is_cuda:
            return PendingRouting(rows, lengths, None)
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return PendingRouting(host, lengths, done)


def token_slots(block_table: list[int], num_tokens: int, block_size: int) -> np.ndarray:
    """[num_tokens] int64 KV slots of a sequence's first `num_tokens` positions."""
    pos = np.arange(num_tokens)
    return np.asarray(block_table, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


class PendingRouting:
    """The routed experts of the sequences finished in one step, on their way to the host.

    `host`: [L, Σn, k] (pinned, being filled until `done`); `lengths`: n per sequence.
    """

    def __init__(self, host: torch.Tensor, lengths: list[int], done: torch.cuda.Event | None) -> None:
        self.host = host
        self.starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        self.done = done
        self._array: np.ndarray | None = None

    def ready(self) -> bool:
        """Whether the copy has finished (never waits)."""
        return self.done is None or self.done.query()

    def array(self, i: int) -> np.ndarray:
        """Sequence i's routed experts [n_i, L, k] (waits for the copy if needed)."""
        if self._array is None:
            if self.done is not None:
                self.done.synchronize()
            self._array = self.host.permute(1, 0, 2).numpy()  # [Σn, L, k], a view
        return np.ascontiguousarray(self._array[self.starts[i]:self.starts[i + 1]])
