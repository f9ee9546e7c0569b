"""Work sharing: an optimizer update's micro-batches computed by whichever rank is free.

Dedicated mode (service/service.py) trains on rank 0 while the other ranks serve. In a pipelined
loop a serving rank finishes decoding its part of the next batch before the running step ends,
and the staleness bound then holds the batch after it back: its GPU would wait. Instead it takes
micro-batches of the running step. Every rank packs the update's sequences into the same list of
micro-batches (`pack_sequences` is deterministic), then claims them one at a time from an atomic
counter in the run's torch.distributed store (`Store.add`), runs the claimed row's forward and
backward into its own gradient accumulators, and at the end the ranks sum their accumulators with
one all-reduce per dtype (`DataParallel.reduce_update`). Every token's loss weight was fixed over
the whole mini-batch before any row ran, so the sum is rank 0's gradient alone up to float
reassociation (which rank computed which row changes the order of the sums, not the terms).

Rank 0 claims from the start and keeps at most two claimed rows in its GPU's queue, so it never
claims work the device will only reach much later; a serving rank claims only while its engine
has nothing to decode, and stops asking once every row is claimed.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .data_parallel import DataParallel

__all__ = ["MicroBatchClaims", "SharedUpdate", "run_claimed"]

log = logging.getLogger(__name__)


class MicroBatchClaims:
    """The claims on one update's `count` micro-batches, shared by the ranks through `store`.

    Args:
        store: a torch.distributed store every rank of the group reaches (the run's rendezvous store).
        key: the counter's key, unique to this update (a retried step needs a new one).
        count: the number of micro-batches.
    """

    def __init__(self, store: dist.Store, key: str, count: int) -> None:
        self.store = store
        self.key = key
        self.count = count
        self.num_claimed = 0  # by this rank

    def claim(self) -> int | None:
        """The index of the next unclaimed micro-batch (now this rank's), or None when all are taken."""
        if self.count == 0:
            return None
        index = self.store.add(self.key, 1) - 1
        if index >= self.count:
            return None
        self.num_claimed += 1
        return index

    def all_claimed(self) -> bool:
        """Whether every micro-batch has been claimed (by any rank)."""
        return self.count == 0 or self.store.add(self.key, 0) >= self.count


@dataclass(slots=True)
class SharedUpdate:
    """One optimizer update shared with other ranks (see the module docstring).

    Attributes:
        group: the ranks that share it (rank 0 and the serving ranks); their gradients are summed over it.
        store: the store that holds the claims' counter.
        key: the counter's key for this update (unique: a retried step gets a new one).
        poll_s: how often a serving rank whose engine is busy looks again.
        reduced: set once this rank has taken part in the gradients' sum.
    """

    group: DataParallel
    store: dist.Store
    key: str
    poll_s: float = 0.005
    reduced: bool = False

    def close(self) -> None:
        """Drop the claims' counter from the store (once every rank is past its claims)."""
        try:
            self.store.delete_key(self.key)
        except (RuntimeError, NotImplementedError) as exc:  # a store that cannot delete keeps a few bytes
            log.debug("could not delete the claims counter %s: %r", self.key, exc)

    def release(self, grad_buffers: list[torch.Tensor], num_stats: int, *, failed: bool) -> None:
        """This rank's part when it leaves before the sum (it failed, or had no row to train):
        claim every micro-batch left, so that no other rank starts one, and join the sum with
        zeros, so that the others do not wait; with `failed` as a failed rank, so that their part
        raises DistributedError. Does nothing once `reduced`.

        Args:
            grad_buffers: this rank's flat gradient buffers (their shapes and dtypes are the sum's).
            num_stats: the length of the statistics vector the ranks sum beside them.
            failed: whether this rank's part failed.
        """
        if self.reduced:
            return
        self.reduced = True
        self.store.add(self.key, 1 << 40)
        device = grad_buffers[0].device
        self.group.reduce_update([torch.zeros_like(b) for b in grad_buffers], torch.zeros(num_stats, device=device),
                                 failed=failed)
        self.close()


def run_claimed(claims: MicroBatchClaims, run: Callable[[int], None], *, device: torch.device,
                may_claim: Callable[[], bool] | None = None, poll_s: float = 0.005, queued: int = 2) -> None:
    """Claim micro-batches and `run(index)` each until none is left.

    Args:
        claims: the update's claims.
        run: queues one micro-batch's forward and backward (asynchronously on a GPU).
        device: where `run` queues its work; on CUDA at most `queued` claimed rows wait in the
            current stream before the next claim.
        may_claim: a serving rank's condition to claim (its engine is idle); while it is False
            the rank waits, polling every `poll_s`, and returns once every row is claimed.
    """
    pending: collections.deque[torch.cuda.Event] = collections.deque()
    while True:
        while len(pending) >= queued:
            pending.popleft().synchronize()
        if may_claim is not None:
            while not may_claim():
                if claims.all_claimed():
                    return
                time.sleep(poll_s)
        index = claims.claim()
        if index is None:
            return
        run(index)
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            pending.append(event)
