"""Which KV-cache blocks each sequence owns; prefix sharing by chained block hashes.

The cache is `num_blocks` blocks of `block_size` token slots. Block 0 is never handed out: it is
the scratch block that padded rows write to. A full block is identified by a hash chained over
the adapter key and every token up to its end, so a hit means the whole prefix matches; the
stored token ids are compared too, against collisions. Blocks are ref-counted; a freed block
keeps its hash (and can be found again) until it is reused.

Free blocks are handed out least recently freed first, so that cached prefixes live as long as
possible. The free queue is a deque with lazy deletion: a free block that a cache hit takes back
leaves its entry behind, stamped with an older free count, and `_take_free` skips such entries.
Every operation is O(1) (a dict used as an ordered set, as before, made each take scan past the
tombstones of every earlier take: steps of 10-100 ms once tens of thousands of blocks cycled).

With a host tier (`num_host_blocks`, KV offloading), a cached block about to be reused is first
copied to a slot of host memory, and a prefix lookup that misses the device cache goes on in the
host tier: the blocks found there are copied back into free device blocks instead of being
recomputed. Host slots are reused least recently used first. This class only keeps the books:
the copies it decides are queued in `transfers`, in order, and the engine runs them
(`ModelRunner.transfer`) before the step's forward, on the same stream, so each copy sees the
blocks as every earlier copy and step left them. An agent's conversations outgrow the device
cache between their turns; with the tier, a turn's re-sent conversation costs a copy over PCIe
(the 8B shape: 144 KiB a token, ~3 us at 50 GB/s) instead of its prefill (~30 us a token).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass, field

from .sequence import Sequence

__all__ = ["BlockManager"]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    num_frees: int = 0  # stamps the block's current entry in the free queue
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


class BlockManager:
    """Allocates blocks to sequences.

    Args:
        num_blocks: cache size in blocks (including the scratch block 0).
        block_size: token slots per block.
        enable_prefix_caching: reuse blocks whose chained hash matches.
        num_host_blocks: slots of the host tier (0: none); needs prefix caching.

    Attributes:
        transfers: the copies decided since the engine last took them (`take_transfers`):
            (to_host, device block, host slot), to run in this order.
        num_offloaded_blocks, num_restored_blocks: blocks copied to the host tier and back, in all.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_queue: collections.deque[tuple[int, int]] = collections.deque((i, 0) for i in range(1, num_blocks))
        self._num_free = num_blocks - 1
        self.hash_to_block: dict[int, int] = {}
        self.num_host_blocks = num_host_blocks if enable_prefix_caching else 0
        # hash -> (host slot, token ids), least recently used first
        self.host: collections.OrderedDict[int, tuple[int, tuple[int, ...]]] = collections.OrderedDict()
        self._host_free = list(range(self.num_host_blocks - 1, -1, -1))
        self.transfers: list[tuple[bool, int, int]] = []
        self.num_offloaded_blocks = self.num_restored_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence can hold at most (every block but the scratch block)."""
        return (len(self.blocks) - 1) * self.block_size

    @staticmethod
    def chain_hash(prev: int | None, adapter_key: Hashable, token_ids: tuple[int, ...]) -> int:
        return hash((prev, adapter_key, token_ids))

    def _take_free(self) -> Block:
        while True:  # skip the entries of blocks that a cache hit took back since they were freed
            block_id, stamp = self._free_queue.popleft()
            block = self.blocks[block_id]
            if block.ref_count == 0 and block.num_frees == stamp:
                break
        self._num_free -= 1
        if block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id:
            del self.hash_to_block[block.hash]  # its content is about to be overwritten
            if self.num_host_blocks:
                self._offload(block)
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block

    def _offload(self, block: Block) -> None:
        """Queue the copy of a cached block about to be reused into the host tier (unless it is there)."""
        if block.hash in self.host:
            self.host.move_to_end(block.hash)
            return
        if self._host_free:
            slot = self._host_free.pop()
        elif self.host:
            slot = self.host.popitem(last=False)[1][0]  # the least recently used
        else:  # every slot holds a block being copied back in this step: this one is not kept
            return
        self.host[block.hash] = (slot, block.token_ids)
        self.transfers.append((True, block.block_id, slot))
        self.num_offloaded_blocks += 1

    def take_transfers(self) -> list[tuple[bool, int, int]]:
        """The copies to run before the next step's forward, in order; empties `transfers`."""
        transfers, self.transfers = self.transfers, []
        return transfers

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of `seq`'s first `num_blocks` blocks (whose tokens are all known),
        computed once per sequence and kept in `seq.block_hashes`."""
        hashes = seq.block_hashes
        if len(hashes) < num_blocks:
            prev = hashes[-1] if hashes else None
            for i in range(len(hashes), num_blocks):
                prev = self.chain_hash(prev, seq.adapter_key, tuple(seq.block_tokens(i, self.block_size)))
                hashes.append(prev)
        return hashes

    def num_cached_blocks(self, seq: Sequence) -> int:
        """About how many leading blocks of a waiting `seq` the prefix cache holds, for ranking
        admissions: a binary search over its chained hashes, O(log n) lookups. Exact when cached
        prefixes lose their blocks from the end, as they do: a sequence frees its blocks last
        first, and free blocks are reused least recently freed first. `allocate_prefix` counts exactly."""
        if not self.enable_prefix_caching:
            return 0
        usable = (len(seq.token_ids) - seq.num_pending - 1) // self.block_size
        hashes, cached, host = self.block_hashes(seq, usable), self.hash_to_block, self.host
        lo, hi = 0, usable
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in cached or hashes[mid - 1] in host:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _lookup(self, h: int, token_ids: tuple[int, ...]) -> Block | None:
        block_id = self.hash_to_block.get(h)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == token_ids else None

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that `seq` can hold `num_new_tokens` more computed tokens (no cache hits counted)."""
        needed = (seq.num_computed_tokens + num_new_tokens + self.block_size - 1) // self.block_size
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate_prefix(self, seq: Sequence, max_new_tokens: int | None = None) -> bool:
        """For a sequence with no blocks yet, take the cached blocks of its longest cached prefix,
        on the device and then in the host tier.

        The host tier's blocks are copied back into free blocks only if the free blocks also hold
        the `max_new_tokens` (default: all) that the sequence computes next: a sequence that then
        could not start would give its copied blocks back, and their copies, and the cached blocks
        they evicted, would be made again each step it waits. At least one token is left
        uncomputed so that the prefill produces logits to sample from. Sets `num_computed_tokens`
        and `num_cached_tokens`.

        Returns:
            False if the host tier holds more of the prefix than the free blocks can take now
            (nothing copied): the sequence should wait rather than recompute it.
        """
        assert not seq.block_table
        seq.num_hashed_blocks = 0
        ready = True
        if self.enable_prefix_caching:
            bs = self.block_size
            usable = (len(seq.token_ids) - 1) // bs  # never the block holding the last token
            hashes = self.block_hashes(seq, usable)
            i = 0
            while i < usable:
                block = self._lookup(hashes[i], tuple(seq.block_tokens(i, bs)))
                if block is None:
                    break
                if block.ref_count == 0:  # taken back from the free queue (its entry goes stale)
                    self._num_free -= 1
                block.ref_count += 1
                seq.block_table.append(block.block_id)
                i += 1
            found = []  # the host tier's blocks that continue the prefix: (hash, tokens, host slot)
            while i + len(found) < usable and self.host:
                j = i + len(found)
                h, tokens = hashes[j], tuple(seq.block_tokens(j, bs))
                entry = self.host.get(h)
                if entry is None or entry[1] != tokens:
                    break
                found.append((h, tokens, entry[0]))
            if found:
                computed = (i + len(found)) * bs
                rest = len(seq.token_ids) - computed
                chunk = rest if max_new_tokens is None else min(rest, max_new_tokens)
                if len(found) + (computed + chunk + bs - 1) // bs - (i + len(found)) <= self._num_free:
                    # out of the LRU's reach while free blocks are taken for them: an offload of a
                    # taken block's old content must not reuse a slot whose copy back is not queued yet
                    for h, _, _ in found:
                        del self.host[h]
                    for h, tokens, slot in found:
                        block = self._take_free()
                        block.hash, block.token_ids = h, tokens
                        self.hash_to_block[h] = block.block_id
                        self.transfers.append((False, block.block_id, slot))
                        seq.block_table.append(block.block_id)
                        if h in self.host:  # the same content offloaded meanwhile from another block
                            self._host_free.append(slot)  # reused only by copies queued after this one
                        else:
                            self.host[h] = (slot, tokens)
                    self.num_restored_blocks += len(found)
                    i += len(found)
                else:
                    ready = False
            seq.num_hashed_blocks = i
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size
        return ready

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Add blocks so that `num_new_tokens` more tokens of `seq` fit; the caller checked can_allocate.

        The blocks that these tokens fill are published in the prefix cache at once: the step
        that computes them stores every sequence's K/V before any attention reads the cache,
        so a sequence scheduled later in the same step may already share them.
        """
        for _ in range(self.num_blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free().block_id)
        if self.enable_prefix_caching:
            self._publish(seq, num_new_tokens)

    def allocate_decode(self, seq: Sequence) -> bool:
        """`allocate(seq, 1)` for a decoding sequence, cheaply; False (nothing done) when it needs a
        new block and none is free."""
        if seq.num_computed_tokens >= len(seq.block_table) * self.block_size:  # its token starts a block
            if not self._num_free:
                return False
            seq.block_table.append(self._take_free().block_id)
        if self.enable_prefix_caching and (seq.num_computed_tokens + 1) // self.block_size > seq.num_hashed_blocks:
            self._publish(seq, 1)
        return True

    def _publish(self, seq: Sequence, num_new_tokens: int) -> None:
        """Hash the blocks these tokens fill, so that other sequences can share them."""
        # only blocks whose tokens are all known: a token still being sampled is not hashed
        num_full = min(seq.num_computed_tokens + num_new_tokens, len(seq.token_ids) - seq.num_pending) // self.block_size
        if seq.num_hashed_blocks >= num_full:
            return
        hashes = self.block_hashes(seq, num_full)
        for i in range(seq.num_hashed_blocks, num_full):
            h = hashes[i]
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, tuple(seq.block_tokens(i, self.block_size))
                self.hash_to_block.setdefault(h, block.block_id)
            seq.num_hashed_blocks = i + 1

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks (shared ones stay with their other owners)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                block.num_frees += 1
                self._free_queue.append((block_id, block.num_frees))
                self._num_free += 1
        if len(self._free_queue) > 2 * len(self.blocks):  # mostly stale (cache hits on free blocks): compact
            self._free_queue = collections.deque(
                (i, n) for i, n in self._free_queue if self.blocks[i].ref_count == 0 and self.blocks[i].num_frees == n)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_cached_tokens = seq.num_hashed_blocks = seq.num_table_synced = 0

    def forget_cached(self) -> None:
        """Drop every prefix-cache entry, on the device and in the host tier (after a failed step,
        whose blocks, and the copies queued with it, may hold garbage)."""
        self.hash_to_block.clear()
        self.host.clear()
        self._host_free = list(range(self.num_host_blocks - 1, -1, -1))
        self.transfers = []
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
