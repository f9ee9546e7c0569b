"""The host tier of the KV cache: pinned host memory that holds KV blocks evicted from the device.

`BlockManager` decides which blocks go to the host and which come back (block_manager.py); this
module holds the host copies and runs those copies. A block's K/V of every layer lie in one
contiguous host slot ([L, 2, block_size, kv_heads, head_dim], and the routed experts of its tokens
for a mixture of experts), so each copy over PCIe is one contiguous transfer of the whole block
(the 8B shape: 2.25 MiB). The host memory is pinned, so the copies run on the device's stream
without making the host wait, in order behind the steps already queued: a block copied out holds
what the last step wrote into it, and a block copied in is there before the next step reads it.

Host memory is pinned when the engine starts, in chunks of about 1 GiB (pinning while steps
run would stall them: cudaHostAlloc takes ~0.1-0.3 s a GiB).

Reference: vLLM's KV offloading connector (`--kv-offloading-size`), SGLang's HiCache; the
swap space of vLLM's first scheduler (Kwon et al. 2023, "PagedAttention", §4.5).
"""

from __future__ import annotations

import torch

__all__ = ["HostKVCache"]

_CHUNK_BYTES = 1 << 30
_MAX_BLOCKS_PER_COPY = 128  # bounds the device staging of one batch of copies


class HostKVCache:
    """Host slots of KV blocks, and the copies between them and the device cache.

    Args:
        kv_cache: the device cache [L, 2, num_blocks, block_size, kv_heads, head_dim], in the
            model's dtype; a host slot takes L * 2 * block_size * kv_heads * head_dim of it.
        routing: the routed experts' ids [L_moe, num_blocks * block_size, k], uint8 or int16
            (a mixture of experts, routing.py), or None.
        num_slots: host slots (blocks); the engine sizes them from `EngineConfig.kv_offloading_size`
            and checks them against the host's available memory first (model_runner.py).

    Raises:
        RuntimeError: from torch, when the host cannot pin that much memory.
    """

    def __init__(self, kv_cache: torch.Tensor, routing: torch.Tensor | None, num_slots: int) -> None:
        self.kv_cache, self.routing, self.num_slots = kv_cache, routing, num_slots
        self.device = kv_cache.device
        self.block_size = kv_cache.shape[3]
        self.slot_shape = (kv_cache.shape[0], 2, *kv_cache.shape[3:])  # [L, 2, bs, h, d]
        self.routing_shape = (routing.shape[0], self.block_size, routing.shape[2]) if routing is not None else None
        slot_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        if routing is not None:
            slot_bytes += routing[:, :self.block_size].numel() * routing.element_size()
        self.slots_per_chunk = max(1, min(num_slots, _CHUNK_BYTES // slot_bytes))
        self.pin = self.device.type == "cuda"
        self.chunks: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (K/V [n, L, 2, bs, h, d], routing [n, L_moe, bs, k])
        for start in range(0, num_slots, self.slots_per_chunk):
            n = min(self.slots_per_chunk, num_slots - start)
            kv = torch.empty((n, *self.slot_shape), dtype=kv_cache.dtype, pin_memory=self.pin)
            routing_rows = (torch.empty((n, *self.routing_shape), dtype=routing.dtype, pin_memory=self.pin)
                            if routing is not None else None)
            self.chunks.append((kv, routing_rows))

    def _slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        chunk, i = divmod(slot, self.slots_per_chunk)
        kv, routing = self.chunks[chunk]
        return kv[i], routing[i] if routing is not None else None

    def _index(self, values: list[int]) -> torch.Tensor:
        """A device index tensor, sent without making the host wait for the stream."""
        t = torch.tensor(values, dtype=torch.long)
        return t.pin_memory().to(self.device, non_blocking=True) if self.pin else t

    def _slots_of(self, blocks: torch.Tensor) -> torch.Tensor:
        """The token slots of `blocks` [n]: [n * block_size]."""
        offsets = torch.arange(self.block_size, device=self.device)
        return (blocks[:, None] * self.block_size + offsets).reshape(-1)

    @torch.inference_mode()
    def run(self, transfers: list[tuple[bool, int, int]]) -> None:
        """Queue `transfers` ((to_host, device block, host slot), from `BlockManager.take_transfers`)
        on the current stream, in their order; consecutive copies the same way go together."""
        start = 0
        while start < len(transfers):
            end, to_host = start, transfers[start][0]
            while (end < len(transfers) and transfers[end][0] == to_host
                   and end - start < _MAX_BLOCKS_PER_COPY):
                end += 1
            (self._to_host if to_host else self._to_device)(transfers[start:end])
            start = end

    def _to_host(self, ops: list[tuple[bool, int, int]]) -> None:
        blocks = self._index([b for _, b, _ in ops])
        kv = self.kv_cache.index_select(2, blocks).permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, L, 2, bs, h, d]
        routing = None
        if self.routing is not None:  # [L_moe, n * bs, k] -> [n, L_moe, bs, k]
            rows = self.routing.index_select(1, self._slots_of(blocks))
            routing = rows.view(rows.shape[0], len(ops), self.block_size, -1).permute(1, 0, 2, 3).contiguous()
        for k, (_, _, slot) in enumerate(ops):
            host_kv, host_routing = self._slot(slot)
            host_kv.copy_(kv[k], non_blocking=True)
            if routing is not None:
                host_routing.copy_(routing[k], non_blocking=True)

    def _to_device(self, ops: list[tuple[bool, int, int]]) -> None:
        last = {block: slot for _, block, slot in ops}  # a block filled twice keeps the later copy
        kv = torch.empty((len(last), *self.slot_shape), dtype=self.kv_cache.dtype, device=self.device)
        routing = (torch.empty((len(last), *self.routing_shape), dtype=self.routing.dtype, device=self.device)
                   if self.routing is not None else None)
        for k, slot in enumerate(last.values()):
            host_kv, host_routing = self._slot(slot)
            kv[k].copy_(host_kv, non_blocking=True)
            if routing is not None:
                routing[k].copy_(host_routing, non_blocking=True)
        blocks = self._index(list(last))
        self.kv_cache.index_copy_(2, blocks, kv.permute(1, 2, 0, 3, 4, 5))
        if routing is not None:
            self.routing.index_copy_(1, self._slots_of(blocks), routing.permute(1, 0, 2, 3).reshape(
                self.routing.shape[0], -1, self.routing.shape[2]))
