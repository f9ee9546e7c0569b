"""What runs next: continuous batching under a token budget, chunked prefill, preemption.

Every step takes all running sequences that are decoding (one token each) and fills the rest of
the token budget with prefill work: first the unfinished chunks of running prompts, then new
sequences from the waiting queue (their cached prefix skipped), first come first served or those
with the longest cached prefix first (`_admission_order`). Prefill and decode share one flat
batch. When the cache cannot hold the next token of a decoding sequence, the most recently started
sequence is preempted: its blocks are freed and it is recomputed later (its prefix often still
cached).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, SequenceStatus

__all__ = ["MAX_BYPASS", "ScheduledBatch", "Scheduler"]

MAX_BYPASS = 1024  # admissions of later requests a waiting request lets pass before it goes first


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: decoding sequences first, then prefill chunks.

    Attributes:
        decode: sequences computing their one newest token.
        prefill: (sequence, number of tokens computed this step).
    """

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.prefill)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)

    def items(self) -> list[tuple[Sequence, int]]:
        """(sequence, new tokens) in batch order."""
        return [(s, 1) for s in self.decode] + self.prefill


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.on_preempt: Callable[[Sequence], None] | None = None  # called before a victim's blocks are freed
        self.max_bypass = MAX_BYPASS

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        num_seqs = 0

        # 1. decoding sequences, oldest first; preempt from the newest when blocks run out
        # (a sequence whose last token is still being sampled and reaches max_tokens is done)
        decoding = [s for s in self.running
                    if len(s.token_ids) - s.num_computed_tokens == 1 and len(s.token_ids) - s.num_prompt_tokens < s.max_tokens]
        for seq in decoding:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below by an older sequence
            if budget < 1 or num_seqs >= self.config.max_num_seqs:
                break
            while not self.blocks.allocate_decode(seq):
                victim = self._newest_running(exclude=batch.decode)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            batch.decode.append(seq)
            budget -= 1
            num_seqs += 1

        # 2. running prompts that are part-way through a chunked prefill
        for seq in self.running:
            if seq.num_uncomputed_tokens > 1 and budget > 0 and num_seqs < self.config.max_num_seqs:
                chunk = min(seq.num_uncomputed_tokens, budget)
                if not self.blocks.can_allocate(seq, chunk):
                    continue
                self.blocks.allocate(seq, chunk)
                batch.prefill.append((seq, chunk))
                budget -= chunk
                num_seqs += 1

        # 3. new sequences (their cached prefix skipped), in admission order
        if self.waiting and budget > 0 and num_seqs < self.config.max_num_seqs:
            admitted = 0
            for seq in self._admission_order():
                if budget <= 0 or num_seqs >= self.config.max_num_seqs:
                    break
                if seq.num_pending:  # preempted while its last token was being sampled: wait for it
                    continue
                if not seq.block_table and not self.blocks.allocate_prefix(seq, budget):
                    self.blocks.free(seq)  # its prefix is in the host tier: wait for room to copy it back
                    break
                chunk = min(seq.num_uncomputed_tokens, budget)
                if not self.blocks.can_allocate(seq, chunk):
                    self.blocks.free(seq)  # do not hold cached blocks while waiting
                    break
                self.blocks.allocate(seq, chunk)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                batch.prefill.append((seq, chunk))
                budget -= chunk
                num_seqs += 1
                admitted += 1
            if admitted:
                self._drop_admitted(admitted)
        return batch

    def _admission_order(self) -> list[Sequence]:
        """The waiting sequences in the order they may start: first come first served ("fcfs"), or
        longest cached prefix first ("lpm", as SGLang's scheduler calls it), in arrival order among equals.

        An agent's next turn re-sends the conversation whose KV its last turn just left in the
        cache. First come first served would start the requests that waited longest, whose
        prefixes the running ones have since evicted: when the conversations outgrow the cache,
        every turn would recompute its whole conversation. Admitting the turns whose prefix is
        resident keeps a working set that fits cycling through the cache; the others wait and
        recompute once. (With a host tier, KV offloading, the evicted prefixes come back by copy
        and first come first served keeps more conversations decoding at once.) A request that
        later ones have passed over `MAX_BYPASS` times starts first, whatever its prefix (no
        request waits forever under a steady load of cached ones).
        """
        waiting = self.waiting
        if len(waiting) == 1 or self.config.scheduling_policy == "fcfs":
            return list(waiting)
        cached = self.blocks.num_cached_blocks
        limit = self.max_bypass
        keys = [(s.num_bypassed < limit, -cached(s), i) for i, s in enumerate(waiting)]
        keys.sort()
        return [waiting[i] for _, _, i in keys]

    def _drop_admitted(self, admitted: int) -> None:
        """Remove the `admitted` sequences started this step from the queue; count the bypasses of those left."""
        waiting = self.waiting
        while admitted and waiting[0].status is SequenceStatus.RUNNING:  # from the head (first come first served)
            waiting.popleft()
            admitted -= 1
        if not admitted:
            return
        still: collections.deque[Sequence] = collections.deque()
        passed = 0  # admitted sequences that had queued after the one being kept
        for seq in reversed(self.waiting):
            if seq.status is SequenceStatus.RUNNING:
                passed += 1
            else:
                seq.num_bypassed += passed
                still.appendleft(seq)
        self.waiting = still

    def _newest_running(self, exclude: list[Sequence]) -> Sequence:
        for seq in reversed(self.running):
            if seq not in exclude:
                return seq
        return self.running[-1]

    def _preempt(self, seq: Sequence) -> None:
        if self.on_preempt is not None:
            self.on_preempt(seq)
        self.blocks.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Free a finished (or failed) sequence's blocks and drop it from the queues."""
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
