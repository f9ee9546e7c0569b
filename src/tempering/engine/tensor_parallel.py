"""The tensor-parallel engine's step messages: the leader's schedule, broadcast to its followers.

Under tensor parallelism (modeling/tensor_parallel.py) every rank of the group must run the same forward
at the same time: each holds a part of every layer and the ranks sum their partial outputs twice
per layer. The leader (TP rank 0) alone schedules, samples and answers requests. Before each
forward it broadcasts the step's model inputs on the engine's process group, and each follower
runs that forward on its shards and its own KV cache (the same blocks: its cache has the leader's
number of blocks, and the leader's block tables address it). The followers' sampled tokens would
be the leader's: they compute no logits.

A message is `meta`, host integers (shapes, prefill spans, adapter names), broadcast on the
group's gloo `host_group` (its length first), then `data`, the step's device tensors flattened
into one int64 tensor, broadcast on the `engine_group` (NCCL on GPUs). The leader never waits for
the device to send (its data broadcast is queued behind the work that computes it); an idle
follower waits in its thread on the host, not in a device kernel.

Kinds: STEP (a forward: eager, or a decode step that the leader replays from a CUDA graph, which
the follower replays from its own), CAPTURE (the leader is about to capture a decode graph: its
two warm-up forwards run collectives, so the follower warms up and captures the same graph at
the same time), PAUSE (the leader's engine has stopped for a training step: see
`Engine.pause_followers`), STOP (the leader's engine is closing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .context import PrefillSpan, StepContext

if TYPE_CHECKING:
    from ..modeling.tensor_parallel import TensorParallel

__all__ = ["CAPTURE", "PAUSE", "STEP", "STOP", "StepLink", "StepMessage"]

STEP, CAPTURE, STOP, PAUSE = 1, 2, 3, 4

# optional StepContext tensors, in message order, with the dtype they are rebuilt in
_FIELDS = (("decode_block_tables", torch.long), ("decode_context_lens", torch.long),
           ("prefill_key_slots", torch.long), ("cu_q", torch.int32), ("cu_k", torch.int32),
           ("prefill_block_tables", torch.long), ("prefill_context_lens", torch.long),
           ("decode_shared_prefix", torch.long))


@dataclass(slots=True)
class StepMessage:
    """What a follower received.

    Attributes:
        kind: STEP, CAPTURE, PAUSE or STOP.
        segments: (start, end, adapter name) of the batch's rows that use an adapter.
        ids, positions: [T] int64 (STEP).
        ctx: the attention metadata (STEP).
        graph: (bucket, sample) of the leader's CUDA graph for a STEP it replays or a CAPTURE; None: eager.
    """

    kind: int
    segments: list[tuple[int, int, str]]
    ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    ctx: StepContext | None = None
    graph: tuple[int, bool] | None = None


class StepLink:
    """Broadcasts steps from the TP leader (`send_*`) and receives them on a follower (`recv`).

    Args:
        tp: the tensor-parallel group (its `engine_group` carries the messages).
        device: this rank's device (the payload lives there; NCCL needs CUDA tensors).
    """

    def __init__(self, tp: TensorParallel, device: torch.device) -> None:
        self.tp = tp
        self.device = device

    # ---- leader -------------------------------------------------------------------------------

    def send_step(self, ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
                  segments: list[tuple[int, int, str]], graph: tuple[int, bool] | None = None) -> None:
        """Broadcast a forward's inputs: ids [T] int64 (every row's actual token: pending ones already
        read from the sampled ids), positions [T], the context, the adapter segments, and the leader's
        graph (bucket, sample) when it replays one."""
        meta = [STEP, ids.shape[0], ctx.num_decode, ctx.max_q, ctx.max_k]
        meta += [*graph] if graph is not None else [0, 0]
        data = [ids, positions, ctx.slot_mapping]
        for name, _ in _FIELDS:
            t = getattr(ctx, name)
            if t is None:
                meta += [0, 0, 0]
            else:
                meta += [1, t.shape[0], t.shape[1] if t.dim() == 2 else 0]
                data.append(t.reshape(-1))
        meta.append(len(ctx.prefill))
        for span in ctx.prefill:  # a span's block table is None on GPUs (prefill_key_slots address its keys)
            table = span.block_table
            meta += [span.start, span.num_new, span.context_len, -1 if table is None else table.shape[0]]
            if table is not None:
                data.append(table)
        meta += _encode_segments(segments)
        self._send(meta, torch.cat([t.to(torch.long) for t in data]))

    def send_capture(self, bucket: int, sample: bool, segments: list[tuple[int, int, str]]) -> None:
        """Tell the followers to warm up and capture the graph of (bucket, adapter, sample) now."""
        self._send([CAPTURE, bucket, int(sample), *_encode_segments(segments)], None)

    def send_stop(self) -> None:
        self._send([STOP], None)

    def send_pause(self) -> None:
        self._send([PAUSE], None)

    def _send(self, meta: list[int], data: torch.Tensor | None) -> None:
        host = torch.tensor([data.shape[0] if data is not None else 0, *meta], dtype=torch.long)
        src = self.tp.leader
        dist.broadcast(torch.tensor([host.shape[0]], dtype=torch.long), src=src, group=self.tp.host_group)
        dist.broadcast(host, src=src, group=self.tp.host_group)
        if data is not None:
            dist.broadcast(data, src=src, group=self.tp.engine_group)

    # ---- follower -----------------------------------------------------------------------------

    def recv(self) -> StepMessage:
        """The leader's next message (blocks until it sends one: a follower's engine thread waits here)."""
        src = self.tp.leader
        length = torch.empty(1, dtype=torch.long)
        dist.broadcast(length, src=src, group=self.tp.host_group)
        host = torch.empty(int(length.item()), dtype=torch.long)
        dist.broadcast(host, src=src, group=self.tp.host_group)
        num_data, *meta = host.tolist()
        data = None
        if num_data:
            data = torch.empty(num_data, dtype=torch.long, device=self.device)
            dist.broadcast(data, src=src, group=self.tp.engine_group)
        kind = meta[0]
        if kind in (STOP, PAUSE):
            return StepMessage(kind, [])
        if kind == CAPTURE:
            return StepMessage(CAPTURE, _decode_segments(meta, 3)[0], graph=(meta[1], bool(meta[2])))
        T, num_decode, max_q, max_k, bucket, sample = meta[1:7]
        offset, pos = 0, 7

        def take(n: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            nonlocal offset
            t = data[offset:offset + n]
            offset += n
            return t if dtype == torch.long else t.to(dtype)

        ids, positions, slots = take(T), take(T), take(T)
        ctx = StepContext(slot_mapping=slots, num_decode=num_decode, max_q=max_q, max_k=max_k)
        for name, dtype in _FIELDS:
            present, rows, cols = meta[pos:pos + 3]
            pos += 3
            if present:
                t = take(rows * max(cols, 1), dtype)
                setattr(ctx, name, t.view(rows, cols) if cols else t)
        num_spans = meta[pos]
        pos += 1
        for _ in range(num_spans):
            start, num_new, context_len, table_len = meta[pos:pos + 4]
            pos += 4
            ctx.prefill.append(PrefillSpan(start, num_new, context_len, None if table_len < 0 else take(table_len)))
        segments, _ = _decode_segments(meta, pos)
        return StepMessage(STEP, segments, ids, positions, ctx, (bucket, bool(sample)) if bucket else None)


def _encode_segments(segments: list[tuple[int, int, str]]) -> list[int]:
    out = [len(segments)]
    for start, end, name in segments:
        raw = name.encode()
        out += [start, end, len(raw), *raw]
    return out


def _decode_segments(meta: list[int], pos: int) -> tuple[list[tuple[int, int, str]], int]:
    segments = []
    count = meta[pos]
    pos += 1
    for _ in range(count):
        start, end, n = meta[pos:pos + 3]
        pos += 3
        segments.append((start, end, bytes(meta[pos:pos + n]).decode()))
        pos += n
    return segments, pos
