"""The trainer's data parallelism over torch.distributed ranks (one process per GPU).

Every rank holds the same base weights and the same LoRA adapter and receives the same
sequences. Each optimizer update's mini-batch is split between the ranks (whole sequences,
balanced by tokens), each rank packs and runs its share, and the LoRA gradients are summed with
one all-reduce per dtype. Every token's loss weight was fixed over the whole mini-batch before
the split, so the sum is the 1-rank gradient up to float reassociation. Each rank then clips and
steps its own copy of the optimizer (the LoRA state is small: replicating it costs a few
hundred MB at 32B, and needs no broadcast of the updated adapter); since all-reduce hands every
rank the same bits, the adapters stay identical, which the tests check.

A step fails as a whole: a rank whose part raises keeps walking through the same collective
calls with a failure flag, so the ranks never wait on each other at different points, and at
the next flag every rank stops and undoes the step (Trainer._undoable).

Collectives run on the process group's device: CUDA tensors with NCCL, CPU tensors with gloo.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["DataParallel", "flat_buffers"]


class DataParallel:
    """This rank's place in the data-parallel group.

    Args:
        group: the torch.distributed process group (None: the default group, which must be
            initialized).
        store: a store every rank of the group reaches (the run's rendezvous store), for work
            shared by claims (work_sharing.py); None: no sharing.

    Raises:
        RuntimeError: if torch.distributed is not initialized.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, store: dist.Store | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs torch.distributed initialized (init_process_group)")
        self.group = group
        self.store = store
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # the global rank of this group's first member: the source of `broadcast_`
        self.first = dist.get_process_group_ranks(group)[0] if group is not None else 0

    def shard(self, sizes: Sequence[int]) -> list[int]:
        """The indices (ascending) of this rank's items: longest first, each to the least-loaded rank.

        Deterministic, so every rank computes the same split without communicating.
        """
        loads = [0] * self.world_size
        mine = []
        for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
            rank = min(range(self.world_size), key=loads.__getitem__)
            loads[rank] += sizes[i]
            if rank == self.rank:
                mine.append(i)
        return sorted(mine)

    def reduce_update(self, grads: Sequence[torch.Tensor], stats: torch.Tensor, *, failed: bool,
                      max_index: int | None = None) -> tuple[torch.Tensor, int]:
        """Sum the gradients in place over the ranks, and combine the update's statistics.

        Args:
            grads: flat gradient buffers (one per dtype), summed in place.
            stats: [K] float32 sums of this rank's rows (on the group's device).
            failed: whether this rank's part of the update raised.
            max_index: the entry of `stats` that is a max, not a sum.

        Returns:
            ([K] statistics over all ranks, number of ranks whose part failed). Reads one value
            back to the host (the failure count).
        """
        for g in grads:
            dist.all_reduce(g, group=self.group)
        vec = torch.cat([stats.float(), stats.new_tensor([float(failed)], dtype=torch.float32)])  # [K + 1]
        gathered = [torch.empty_like(vec) for _ in range(self.world_size)]
        dist.all_gather(gathered, vec, group=self.group)
        every = torch.stack(gathered)  # [W, K + 1]
        total = every.sum(0)
        if max_index is not None:
            total[max_index] = every[:, max_index].max()
        return total[:-1], int(total[-1].item())

    def agree(self, ok: bool, device: torch.device) -> bool:
        """True when every rank passes `ok=True` (a step's final vote: commit or undo everywhere)."""
        flag = torch.tensor([0.0 if ok else 1.0], device=device)
        dist.all_reduce(flag, group=self.group)
        return flag.item() == 0.0

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int | None = None) -> None:
        """Overwrite `tensors` on every rank with rank `src`'s (a global rank; default: the group's
        first) (one broadcast per dtype); `src`'s own tensors are only read."""
        src = self.first if src is None else src
        is_src = dist.get_rank() == src  # `src` is a global rank, as in dist.broadcast
        with torch.no_grad():
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for group in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in group])
                dist.broadcast(flat, src=src, group=self.group)
                if not is_src:
                    parts = flat.split([t.numel() for t in group])
                    torch._foreach_copy_(group, [f.view_as(t) for f, t in zip(parts, group)])


def flat_buffers(params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed gradient storage for `params`: one flat buffer per dtype, and a view of it shaped
    like each parameter (in `params` order), so that one all-reduce per dtype covers them all.

    Returns:
        (buffers, views).
    """
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)
    buffers: list[torch.Tensor] = []
    views: dict[int, torch.Tensor] = {}
    for dtype, indices in by_dtype.items():
        flat = torch.zeros(sum(params[i].numel() for i in indices), dtype=dtype, device=params[indices[0]].device)
        offset = 0
        for i in indices:
            n = params[i].numel()
            views[i] = flat[offset:offset + n].view_as(params[i])
            offset += n
        buffers.append(flat)
    return buffers, [views[i] for i in range(len(params))]
