"""CUDA graphs of the decode step (GPU only; never imported on CPU).

A decode-only batch of B sequences is padded to the smallest captured bucket >= B
(1, 2, 4, 8, then every 16) and replayed from static input buffers: token ids, positions, cache
slots, block tables and context lengths. Padding rows write their K/V to the scratch block 0
and have context length 0, so the attention kernel skips them. Graphs are captured on first use
of a (bucket, adapter, sampling) triple, and share one memory pool; the LoRA tensors a graph
reads are the trainer's, updated in place, so a training step needs no recapture.

A decode row whose newest token the previous step is still sampling reads it inside the graph
from `last_tokens` (the runner's buffer of the newest step's sampled ids). When every row samples
with the fused Gumbel-max sampler (no top-k/top-p, no top logprobs, no grammar: the RL rollout
case), the graph also computes the logits and samples, writing the ids to `last_tokens` and their
logprobs to `logprobs`: a step is then a few input copies and one launch on the host. Otherwise
the graph returns the hidden states and the runner samples. Pattern after nano-vllm's model runner.

Structured outputs: a decode step with grammar rows can only be sampled once the host has filled
its bitmasks, after the forward was launched. Its forward graph returns the hidden states, and a
second graph per bucket (`sample_masked`) computes the logits and samples with the masks (fused
Gumbel-max reading the packed words), so that the host pays one launch for it, not the ~1 ms of
eager launches it took on an H100 host at batch 256.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .context import StepContext
from .layers.triton_sampler import gumbel_sample
from .lora import EngineAdapter, LoRASegment

__all__ = ["DecodeGraphs", "StagedDecode"]

log = logging.getLogger("tempering")


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor | None  # [bucket, H], written by each replay (None when the graph samples)
    adapter: EngineAdapter | None  # kept alive: the graph reads its tensors' addresses


@dataclass(slots=True)
class StagedDecode:
    """A decode step whose inputs are in the graph buffers (`DecodeGraphs.stage`), to be replayed."""

    batch_size: int
    bucket: int
    adapter: EngineAdapter | None
    sample: bool
    captured: _Captured | None  # None: capture failed, run eagerly


class DecodeGraphs:
    """Captured decode steps of one model and KV cache.

    Args:
        model: the engine's decoder.
        kv_cache: the cache tensor the graphs read and write.
        max_batch_size: largest bucket.
        max_blocks_per_seq: width of the static block table.
        last_tokens: [>= max_batch_size] int64, the newest step's sampled ids (read by rows whose
            token is pending; written by graphs that sample).
        forward_only: a tensor-parallel follower's graphs: they never sample (the leader does), and
            a graph is captured only when the leader captures its own (`capture`), since the
            warm-ups run collectives; `stage` of a graph not captured runs it eagerly.
        on_capture: called as on_capture(bucket, adapter, sample) right before a graph's warm-ups
            (a tensor-parallel leader tells its followers to capture too).
        cascade: the graphs run cascade attention, reading the shared prefix's length from a
            static buffer (`stage`'s `shared_prefix`; EngineConfig.cascade_attention).

    A capture that fails (memory the trainer holds at that moment, say) is logged and its bucket
    runs eagerly; the leader tries it again after `retry_after` eager steps of it, `max_attempts`
    times in all.
    """

    retry_after = 1024
    max_attempts = 3

    def __init__(self, model: Any, kv_cache: torch.Tensor, *, max_batch_size: int, max_blocks_per_seq: int,
                 last_tokens: torch.Tensor, forward_only: bool = False,
                 on_capture: Callable[[int, EngineAdapter | None, bool], None] | None = None,
                 cascade: bool = False) -> None:
        self.model = model
        self.forward_only = forward_only
        self.on_capture = on_capture
        self.kv_cache = kv_cache
        device = kv_cache.device
        self.buckets = [b for b in (1, 2, 4, 8) if b <= max_batch_size] + list(range(16, max_batch_size + 1, 16))
        self.max_batch_size = self.buckets[-1]
        size = self.max_batch_size
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.sources = torch.full((size,), -1, dtype=torch.long, device=device)  # row of last_tokens, or -1
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(size, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(size, dtype=torch.int32, device=device)
        # cascade attention: the keys every row shares (0: none; the graphs then skip the prefix kernel's work)
        self.shared_prefix = torch.zeros(1, dtype=torch.long, device=device) if cascade else None
        self.temperature = torch.ones(size, dtype=torch.float32, device=device)  # sampling graphs' options
        self.seeds = torch.zeros(size, dtype=torch.long, device=device)
        self.counters = torch.zeros(size, dtype=torch.long, device=device)
        self.last_tokens = last_tokens
        self.logprobs = torch.zeros(size, dtype=torch.float32, device=device)  # written by sampling graphs
        self.graphs: dict[tuple[int, int, bool], _Captured | None] = {}  # None: capture failed, run eagerly
        self.failures: dict[tuple[int, int, bool], list[int]] = {}  # key: [failed captures, eager steps before the next]
        # masked sampling (structured outputs): hidden states in, bitmasks and each row's mask row
        self.hidden = None  # [size, H], allocated on first use, as are the bitmasks [size, W] int32
        self.mask_bits = None
        self.mask_index = torch.full((size,), -1, dtype=torch.int32, device=device)
        self.num_allowed = torch.zeros(size, dtype=torch.int32, device=device)
        self.sample_graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.pool = None
        self.stream = torch.cuda.Stream(device)  # warm-up and capture on the same stream

    def bucket_for(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def stage(self, input_ids: torch.Tensor, sources: torch.Tensor | None, positions: torch.Tensor,
              slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
              adapter: EngineAdapter | None, sample: bool, shared_prefix: torch.Tensor | None = None) -> StagedDecode:
        """Queue the copies of a decode-only batch's inputs (all on the device) into the buffers of
        its graph, capturing the graph on first use; `replay` then runs it.

        Args:
            input_ids: [B] int64 (any value where `sources` points to a pending token).
            sources: [B] int64 row of `last_tokens` holding the row's newest token, or -1; None: all known.
            positions, slot_mapping: [B] int64; block_tables: [B, width] int; context_lens: [B] int.
            adapter: the LoRA of every row, or None.
            sample: the graph also samples (fused Gumbel-max; `replay` copies the options in): the
                ids land in `last_tokens[:B]` and their logprobs in `logprobs[:B]`.
            shared_prefix: [1] int64, cascade attention's shared keys (graphs made with `cascade`).

        Nothing staged reads `last_tokens` or the buffers a masked sampling reads, so a step can be
        staged before the previous step's deferred sampling is queued (`sample_masked`), taking
        this host work off the path between the grammar masks and the next forward. The copies
        queue behind the previous step's forward, which read the same buffers.
        """
        B, width = block_tables.shape
        bucket = self.bucket_for(B)
        self.input_ids[:B].copy_(input_ids)
        if sources is not None:
            self.sources[:B].copy_(sources)
        else:
            self.sources[:B].fill_(-1)
        self.positions[:B].copy_(positions)
        self.slot_mapping[:B].copy_(slot_mapping)
        self.block_tables[:B, :width].copy_(block_tables)
        self.context_lens[:B].copy_(context_lens)
        if self.shared_prefix is not None:
            if shared_prefix is not None:
                self.shared_prefix.copy_(shared_prefix)
            else:
                self.shared_prefix.zero_()
        if bucket > B:  # padding rows: scratch slot, no keys
            self.slot_mapping[B:bucket].zero_()
            self.context_lens[B:bucket].zero_()
            self.sources[B:bucket].fill_(-1)
        key = (bucket, id(adapter) if adapter is not None else 0, sample)
        if key not in self.graphs or (self.graphs[key] is None and self._retry_due(key)):
            if self.forward_only:  # captured only with the leader (`capture`)
                return StagedDecode(B, bucket, adapter, sample, None)
            if self.on_capture is not None:
                self.on_capture(bucket, adapter, sample)
            self._capture(key, adapter)
        return StagedDecode(B, bucket, adapter, sample, self.graphs[key])

    def capture(self, bucket: int, adapter: EngineAdapter | None, sample: bool) -> None:
        """(A tensor-parallel follower) warm up and capture the graph of (bucket, adapter, sample) as the
        leader does the same: the warm-ups' collectives meet the leader's. The warm-ups read inputs
        that write to the scratch block only (slot 0, no keys), never to a live sequence's blocks."""
        self.input_ids[:bucket].zero_()
        self.sources[:bucket].fill_(-1)
        self.positions[:bucket].zero_()
        self.slot_mapping[:bucket].zero_()
        self.context_lens[:bucket].zero_()
        if self.shared_prefix is not None:
            self.shared_prefix.zero_()
        self._capture((bucket, id(adapter) if adapter is not None else 0, sample), adapter)

    def replay(self, staged: StagedDecode, sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
               ) -> torch.Tensor | None:
        """Run a staged step: copy the sampling options in (`sampling`: (temperature [B] float32,
        seeds [B] int64, counters [B] int64), when the graph samples), then replay its graph.

        Returns:
            the hidden states [B, H], or None when the graph sampled.
        """
        B, bucket = staged.batch_size, staged.bucket
        if staged.sample and not self.forward_only:
            for static, values in zip((self.temperature, self.seeds, self.counters), sampling):
                static[:B].copy_(values)
        captured = staged.captured
        if captured is None:
            hidden = self._forward(bucket, staged.adapter, staged.sample)
            return hidden[:B] if hidden is not None else None
        captured.graph.replay()
        return captured.hidden[:B] if captured.hidden is not None else None

    def _forward(self, bucket: int, adapter: EngineAdapter | None, sample: bool) -> torch.Tensor | None:
        ctx = StepContext(
            slot_mapping=self.slot_mapping[:bucket],
            num_decode=bucket,
            decode_block_tables=self.block_tables[:bucket],
            decode_context_lens=self.context_lens[:bucket],
            decode_shared_prefix=self.shared_prefix,
        )
        lora = [LoRASegment(0, bucket, adapter)] if adapter is not None else []
        sources = self.sources[:bucket]
        ids = torch.where(sources >= 0, self.last_tokens[sources.clamp(min=0)], self.input_ids[:bucket])
        hidden = self.model.forward(ids, self.positions[:bucket], ctx, self.kv_cache, lora)
        if not sample or self.forward_only:
            return hidden
        token_ids, logprobs, _ = gumbel_sample(self.model.logits(hidden), self.temperature[:bucket],
                                               self.seeds[:bucket], self.counters[:bucket])
        self.last_tokens[:bucket].copy_(token_ids)
        self.logprobs[:bucket].copy_(logprobs)
        return None

    def _capture(self, key: tuple[int, int, bool], adapter: EngineAdapter | None) -> None:
        """Capture the graph of `key` (bucket, adapter id, sample) into `graphs`; on failure store None
        (the bucket runs eagerly) and count the failure for `_retry_due`."""
        bucket, _, sample = key
        graph, hidden = self._record(lambda: self._forward(bucket, adapter, sample), f"decode bucket {bucket}")
        if graph is not None:
            self.graphs[key] = _Captured(graph, hidden, adapter)
            self.failures.pop(key, None)
            return
        self.graphs[key] = None
        failed = self.failures.setdefault(key, [0, 0])
        failed[0] += 1
        failed[1] = self.retry_after
        if failed[0] < self.max_attempts and not self.forward_only:
            log.warning("decode bucket %d runs eagerly; its capture is tried again after %d of its steps (attempt %d of %d)",
                        bucket, self.retry_after, failed[0] + 1, self.max_attempts)

    def _retry_due(self, key: tuple[int, int, bool]) -> bool:
        """Count one eager step of a bucket whose capture failed: True when its next capture is due."""
        failed = self.failures.get(key)
        if failed is None or failed[0] >= self.max_attempts:
            return False
        failed[1] -= 1
        return failed[1] <= 0

    def _record(self, step: Callable[[], Any], what: str) -> tuple[torch.cuda.CUDAGraph | None, Any]:
        """Warm `step` up twice on the capture stream, then capture it: (graph, what the captured
        call returned), or (None, None) after logging a failed capture (the caller runs eagerly)."""
        # the warm-up may sample too: keep the newest step's ids, which this step's rows read
        saved = self.last_tokens.clone()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(2):  # warm up (Triton JIT, cuBLAS workspaces) on the capture stream
                step()
        graph = torch.cuda.CUDAGraph()
        try:
            # capture_begin/end rather than `torch.cuda.graph`, whose entry synchronizes the whole device
            # and empties the allocator's cache: that waits for the trainer's queued work too, and under
            # tensor parallelism for its collectives, which may wait for another rank's engine, which
            # waits for this capture (a deadlock). thread_local: CUDA work of other threads (the
            # trainer, user code) cannot break the capture.
            with torch.cuda.stream(self.stream):
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    out = step()
                finally:
                    graph.capture_end()
        except RuntimeError as exc:  # includes torch.AcceleratorError
            log.warning("CUDA graph capture of %s failed (%s); running it eagerly", what, exc)
            self.stream.synchronize()
            self.last_tokens.copy_(saved)
            return None, None
        torch.cuda.current_stream().wait_stream(self.stream)
        self.last_tokens.copy_(saved)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, out

    def stage_masked(self, hidden: torch.Tensor, sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """The first half of a masked sampling (`sample_masked`), queued right after the step's forward
        while the host fills its bitmasks: copy the hidden states and sampling options in.

        Args:
            hidden: [B, H] the step's hidden states (its forward graph's output, which the next
                forward overwrites).
            sampling: (temperature [B] float32, seeds [B] int64, counters [B] int64) on the device.
        """
        B = hidden.shape[0]
        if self.hidden is None or self.hidden.shape[1] != hidden.shape[1]:
            self.hidden = torch.zeros(self.max_batch_size, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
            self.sample_graphs.clear()
        self.hidden[:B].copy_(hidden)
        for static, values in zip((self.temperature, self.seeds, self.counters), sampling):
            static[:B].copy_(values)

    def sample_masked(self, batch_size: int, bits: torch.Tensor, mask_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample a decode step's rows under grammar bitmasks from a captured graph: logits, then the
        fused Gumbel-max sampler reading the packed words; the ids land in `last_tokens[:B]`.
        Call `stage_masked` first, with nothing staged in between that writes the sampling options
        (a decode step staged with `DecodeGraphs.stage` copies its own only at `replay`).

        Args:
            batch_size: B, the rows of the step.
            bits: [C, W] int32 bitmasks of the constrained rows (pinned host memory: copied without
                blocking), C <= the largest bucket.
            mask_index: [B] int32 each row's bitmask row, -1 for a free row (pinned host memory).

        Returns:
            (logprobs [B] float32 of the sampled ids under the unmasked distribution, the number of
            allowed tokens per row [B] int32), views of static buffers the next call overwrites.
        """
        B, C = batch_size, bits.shape[0]
        bucket = self.bucket_for(B)
        if self.mask_bits is None or self.mask_bits.shape[1] != bits.shape[1]:
            self.mask_bits = torch.zeros(self.max_batch_size, bits.shape[1], dtype=torch.int32, device=self.mask_index.device)
            self.sample_graphs.clear()
        self.mask_bits[:C].copy_(bits, non_blocking=True)
        self.mask_index[:B].copy_(mask_index, non_blocking=True)
        if bucket > B:
            self.mask_index[B:bucket].fill_(-1)
        if bucket not in self.sample_graphs:
            self.sample_graphs[bucket], _ = self._record(lambda: self._sample_masked(bucket),
                                                         f"masked sampling, bucket {bucket}")
        graph = self.sample_graphs[bucket]
        if graph is None:
            self._sample_masked(bucket)
        else:
            graph.replay()
        return self.logprobs[:B], self.num_allowed[:B]

    def _sample_masked(self, bucket: int) -> None:
        token_ids, logprobs, num_allowed = gumbel_sample(
            self.model.logits(self.hidden[:bucket]), self.temperature[:bucket], self.seeds[:bucket],
            self.counters[:bucket], self.mask_bits, self.mask_index[:bucket])
        self.last_tokens[:bucket].copy_(token_ids)
        self.logprobs[:bucket].copy_(logprobs)
        self.num_allowed[:bucket].copy_(num_allowed)

    def forget(self, adapter: EngineAdapter) -> None:
        """Drop the graphs that read `adapter`'s tensors (it is being unloaded), and the buckets whose
        capture with it failed (kept as None, they no longer hold the adapter, only its id)."""
        self.graphs = {k: v for k, v in self.graphs.items() if k[1] != id(adapter)}
        self.failures = {k: v for k, v in self.failures.items() if k[1] != id(adapter)}

    def release(self) -> None:
        """Free every captured graph and the memory pool (the engine is closing).

        Under tensor parallelism the graphs hold NCCL collectives, and `ncclCommDestroy` (from
        `torch.distributed.destroy_process_group`) blocks for as long as a graph that captured one
        of the communicator's operations is alive (pytorch/pytorch#115388): resetting them first
        lets the process group be destroyed."""
        # the replays' streams only: a device-wide sync would also wait for the trainer's queued work
        torch.cuda.default_stream(self.kv_cache.device).synchronize()
        self.stream.synchronize()
        for captured in self.graphs.values():
            if captured is not None:
                captured.graph.reset()
        for graph in self.sample_graphs.values():
            if graph is not None:
                graph.reset()
        self.graphs.clear()
        self.failures.clear()
        self.sample_graphs.clear()
        self.pool = None
