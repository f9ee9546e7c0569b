"""Forward, loss and backward of a packed row, captured once per row shape as a CUDA graph.

On a GPU the trainer's step is bound by the host: a 28-layer forward and backward with
recomputation launches about ten thousand kernels through Python and autograd, and on an H100
host that took longer than the kernels themselves (benchmarks/RESULTS.md). A CUDA graph replays
all of them with one launch.

Rows are padded to a power-of-two `RowShape` (batching.py), so a run sees only a few shapes. The
first row of a shape runs eagerly on a side stream (real work: its gradient counts), which also
performs the lazy initialization that must not happen during a capture (cuBLAS workspaces,
Triton compilation); then the same computation is captured, reading static input buffers. A
later row of that shape is copied into the buffers and the graph replayed. Gradients come from
`torch.autograd.grad` and are added into accumulators owned here, which `install_grads()` hands
to the optimizer.

What a captured graph relies on: the objective never syncs with the host and depends on no
host value but the shape and the config it was captured with (part of the key); the LoRA
parameters are updated in place (the optimizer does so), never reallocated; no dropout (its
random numbers would be frozen into the graph). `capture=False` runs the same path eagerly,
which is the CPU twin that the tests compare against.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from .batching import MicroBatch, Row, RowShape
from .data_parallel import flat_buffers

__all__ = ["RowGraphs"]

log = logging.getLogger("tempering")

Objective = Callable[[Row], tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: Row  # static device buffers the graph reads
    stats: torch.Tensor  # static output the graph writes


class RowGraphs:
    """Runs rows through `objective` and its backward, accumulating the gradient of `params`.

    Args:
        params: the trained tensors (LoRA A/B), updated in place between replays.
        device: where the rows run.
        max_graphs: graphs kept (least recently used dropped first).
    """

    def __init__(self, params: list[torch.Tensor], device: torch.device, *, max_graphs: int = 16) -> None:
        self.params = params
        self.device = device
        self.max_graphs = max_graphs
        # views of one flat buffer per dtype: data parallelism all-reduces the buffers in one call each
        self.grad_buffers, self.grads = flat_buffers(params)
        self._graphs: OrderedDict[Hashable, _Captured] = OrderedDict()
        self._pool = None
        self._capture_stream: torch.cuda.Stream | None = None
        self.capture_error: str | None = None  # set when a capture failed: rows then run eagerly
        self.num_captures = 0
        self.num_replays = 0

    def begin_update(self) -> None:
        """Zero the gradient accumulators (before the first row of an optimizer update)."""
        for buffer in self.grad_buffers:
            buffer.zero_()

    def install_grads(self) -> None:
        """Point each parameter's `.grad` at its accumulator, for clipping and the optimizer step."""
        for p, g in zip(self.params, self.grads):
            p.grad = g

    def run(self, micro: MicroBatch, objective: Objective, key: Hashable, *, capture: bool,
            pad: bool | None = None) -> torch.Tensor:
        """Add the row's gradient into the accumulators; returns its statistics vector.

        Args:
            micro: the packed row (host tensors).
            objective: row → (loss, stats); captured with the row's shape under `key`, so
                `key` must name everything it depends on besides the shape.
            key: hashable description of the objective (the loss options).
            capture: replay (or capture) a CUDA graph; False runs eagerly.
            pad: pad the row to its `RowShape` bucket; by default only when capturing.

        Returns:
            [K] float32 statistics on the device. With CUDA graphs it is a static buffer that the
            next `run` overwrites: consume it (add it to a running total) before then.

        Raises:
            ValueError: `capture` on a device that is not CUDA.
        """
        if capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        capture = capture and self.capture_error is None
        shape = RowShape.bucket(micro) if (capture if pad is None else pad) else None
        row = micro.row(shape)
        if not capture:
            return self._forward_backward(row.to(self.device), objective)
        full_key = (shape, key, row.routed_experts is not None)  # a graph reads routed experts or does not
        captured = self._graphs.get(full_key)
        if captured is None:
            return self._capture(full_key, row, objective)
        self._graphs.move_to_end(full_key)
        for name, t in row.tensors().items():
            getattr(captured.inputs, name).copy_(t.pin_memory(), non_blocking=True)
        captured.graph.replay()
        self.num_replays += 1
        return captured.stats

    def _forward_backward(self, row: Row, objective: Objective) -> torch.Tensor:
        loss, stats = objective(row)
        grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        used = [(g, acc) for g, acc in zip(grads, self.grads) if g is not None]
        if used:
            torch._foreach_add_([acc for _, acc in used], [g for g, _ in used])
        return stats

    def _capture(self, key: Hashable, row: Row, objective: Objective) -> torch.Tensor:
        inputs = row.to(self.device)  # the static buffers: allocated outside the graph's pool
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # the eager run: this row's real contribution, and the warm-up
            stats = self._forward_backward(inputs, objective)
        current.wait_stream(side)
        stats.record_stream(current)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # one memory pool for all shapes: they never overlap
            # this GPU's own: `torch.cuda.graph`'s default capture stream is one per process, made on the
            # device current at its first use, so a trainer on cuda:1 after one on cuda:0 captured its
            # kernels on cuda:0's stream (the capture failed, and the row's eager rerun after it too)
            self._capture_stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        # a capture puts the device's default generator in capture mode and a failed one never takes it
        # out (every later random op on the device would then fail): keep its state to put back
        generator = torch.cuda.default_generators[self.device.index or 0]
        not_capturing = torch.Generator(device=self.device)  # a state of its own, not shared with the capture
        not_capturing.set_state(generator.get_state())
        try:
            # thread-local: another model's engine may keep working on the GPU from its own thread
            with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream, capture_error_mode="thread_local"):
                static_stats = self._forward_backward(inputs, objective)
        except RuntimeError as exc:  # an op that cannot be captured (a host sync, say): stay eager from now on
            generator.graphsafe_set_state(not_capturing)
            self.capture_error = f"{type(exc).__name__}: {exc}"
            log.warning("training without CUDA graphs: capturing a row failed (%s)", self.capture_error)
            torch.cuda.synchronize(self.device)
            return stats  # the eager run above already added this row's gradient
        self._graphs[key] = _Captured(graph, inputs, static_stats)
        self.num_captures += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        log.debug("captured a training graph for %s (%d kept)", key, len(self._graphs))
        return stats
