"""CUDA graphs of the decode step (GPU only; never imported on CPU).

A decode-only batch of B sequences is padded to the smallest captured bucket >= B
(1, 2, 4, 8, then every 16) and replayed from static input buffers: token ids, positions, cache
slots, block tables and context lengths. Padding rows write their K/V to the scratch block 0
and have context length 0, so the attention kernel skips them. Graphs are captured on first use
of a (bucket, adapter) pair, and share one memory pool; the LoRA tensors a graph reads are the
trainer's, updated in place, so a training step needs no recapture. Logits and sampling run
outside the graph. Pattern after nano-vllm's model runner.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from .context import StepContext
from .lora import EngineAdapter, LoRASegment

__all__ = ["DecodeGraphs"]

log = logging.getLogger("tempering")


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [bucket, H], written by each replay
    adapter: EngineAdapter | None  # kept alive: the graph reads its tensors' addresses


class DecodeGraphs:
    """Captured decode steps of one model and KV cache.

    Args:
        model: the engine's decoder.
        kv_cache: the cache tensor the graphs read and write.
        max_batch_size: largest bucket.
        max_blocks_per_seq: width of the static block table.
    """

    def __init__(self, model: Any, kv_cache: torch.Tensor, *, max_batch_size: int, max_blocks_per_seq: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        device = kv_cache.device
        self.buckets = [b for b in (1, 2, 4, 8) if b <= max_batch_size] + list(range(16, max_batch_size + 1, 16))
        self.max_batch_size = self.buckets[-1]
        self.input_ids = torch.zeros(self.max_batch_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_batch_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(self.max_batch_size, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(self.max_batch_size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(self.max_batch_size, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], _Captured | None] = {}  # None: capture failed, run eagerly
        self.pool = None
        self.stream = torch.cuda.Stream(device)  # warm-up and capture on the same stream

    def bucket_for(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        adapter: EngineAdapter | None,
    ) -> torch.Tensor:
        """Hidden states [B, H] of a decode-only batch (all tensors already on the device)."""
        B, width = block_tables.shape
        bucket = self.bucket_for(B)
        self.input_ids[:B].copy_(input_ids)
        self.positions[:B].copy_(positions)
        self.slot_mapping[:B].copy_(slot_mapping)
        self.block_tables[:B, :width].copy_(block_tables)
        self.context_lens[:B].copy_(context_lens)
        if bucket > B:  # padding rows: scratch slot, no keys
            self.slot_mapping[B:bucket].zero_()
            self.context_lens[B:bucket].zero_()
        key = (bucket, id(adapter) if adapter is not None else 0)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bucket, adapter)
        captured = self.graphs[key]
        if captured is None:
            return self._forward(bucket, adapter)[:B]
        captured.graph.replay()
        return captured.hidden[:B]

    def _forward(self, bucket: int, adapter: EngineAdapter | None) -> torch.Tensor:
        ctx = StepContext(
            slot_mapping=self.slot_mapping[:bucket],
            num_decode=bucket,
            decode_block_tables=self.block_tables[:bucket],
            decode_context_lens=self.context_lens[:bucket],
        )
        lora = [LoRASegment(0, bucket, adapter)] if adapter is not None else []
        return self.model.forward(self.input_ids[:bucket], self.positions[:bucket], ctx, self.kv_cache, lora)

    def _capture(self, bucket: int, adapter: EngineAdapter | None) -> _Captured | None:
        """Capture a graph; on failure log it and return None (that bucket then runs eagerly)."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # warm up (Triton JIT, cuBLAS workspaces) on the capture stream
                self._forward(bucket, adapter)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: CUDA work of other threads (the trainer, user code) cannot break the capture
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                hidden = self._forward(bucket, adapter)
        except RuntimeError as exc:  # includes torch.AcceleratorError
            log.warning("CUDA graph capture of decode bucket %d failed (%s); running it eagerly", bucket, exc)
            torch.cuda.synchronize()
            return None
        torch.cuda.current_stream().wait_stream(self.stream)
        if self.pool is None:
            self.pool = graph.pool()
        return _Captured(graph, hidden, adapter)

    def forget(self, adapter: EngineAdapter) -> None:
        """Drop the graphs that read `adapter`'s tensors (it is being unloaded)."""
        self.graphs = {k: v for k, v in self.graphs.items() if v.adapter is not adapter}
