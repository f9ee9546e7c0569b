"""WeightsGate: when the engine may read the shared weights and the trainer may write them.

The engine and the trainer share one set of tensors: the base weights, which nobody writes, and
the live LoRA adapter, which the trainer's optimizer updates in place. A training step's forward
and backward only read them, so they run while the engine keeps decoding; only the moments that
write them (an optimizer update, putting the adapter back after a failed step, injecting or
loading adapters) must not overlap an engine step. The gate is the lock both sides take for
those moments, and it carries the policy version that the engine stamps on every sampled token.

On CUDA the two sides run on different streams, so holding a lock on the host is not enough: a
kernel queued by the last holder may still be running. Each holder, when it enters, makes its
current stream wait for an event that the previous holder recorded on its own stream when it
left; so the trainer's update runs after the engine's last queued read, and the engine's next
step reads the updated adapter. The wait is on the device (`cudaStreamWaitEvent`): no host sync.
Enter the gate with the stream that will do the work current.
"""

from __future__ import annotations

import threading
from typing import Self

import torch

__all__ = ["WeightsGate"]


class WeightsGate:
    """A re-entrant lock over the shared weights, ordered across CUDA streams, with the policy version.

    `with gate:` around an engine step (it reads the weights) or a write by the trainer.

    Attributes:
        version: the policy version of the live adapter: the number of the training step whose
            update produced its weights (0 before any). The trainer sets it while it holds the
            gate, together with the update, so an engine step reads weights and version that match.

    Args:
        device: where the weights live; on CUDA, critical sections are ordered with an event.
        version: the starting version (the step the model resumes at).
    """

    def __init__(self, device: torch.device, *, version: int = 0) -> None:
        self._lock = threading.RLock()
        self.version = version
        self._device = torch.device(device)
        self._is_cuda = self._device.type == "cuda"
        self._event: torch.cuda.Event | None = None  # recorded by the last holder as it left

    def __enter__(self) -> Self:
        self._lock.acquire()
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)  # after the previous holder's work
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._is_cuda:
                if self._event is None:
                    self._event = torch.cuda.Event()
                # re-recording one event is safe: every wait and record happens under the lock
                self._event.record(torch.cuda.current_stream(self._device))
        finally:
            self._lock.release()
