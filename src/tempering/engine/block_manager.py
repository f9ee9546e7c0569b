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
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_queue: collections.deque[tuple[int, int]] = collections.deque((i, 0) for i in range(1, num_blocks))
        self._num_free = num_blocks - 1
        self.hash_to_block: dict[int, int] = {}

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
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block

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

    def allocate_prefix(self, seq: Sequence) -> None:
        """For a sequence with no blocks yet, take the cached blocks of its longest cached prefix.

        At least one token is left uncomputed so that the prefill produces logits to sample from.
        Sets `num_computed_tokens` and `num_cached_tokens`.
        """
        assert not seq.block_table
        seq.num_hashed_blocks, seq.last_block_hash = 0, None
        if self.enable_prefix_caching:
            usable = (len(seq.token_ids) - 1) // self.block_size  # never the block holding the last token
            for i in range(usable):
                tokens = tuple(seq.block_tokens(i, self.block_size))
                h = self.chain_hash(seq.last_block_hash, seq.adapter_key, tokens)
                block = self._lookup(h, tokens)
                if block is None:
                    break
                if block.ref_count == 0:  # taken back from the free queue (its entry goes stale)
                    self._num_free -= 1
                block.ref_count += 1
                seq.block_table.append(block.block_id)
                seq.num_hashed_blocks, seq.last_block_hash = i + 1, h
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size

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
        for i in range(seq.num_hashed_blocks, num_full):
            tokens = tuple(seq.block_tokens(i, self.block_size))
            h = self.chain_hash(seq.last_block_hash, seq.adapter_key, tokens)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block.setdefault(h, block.block_id)
            seq.num_hashed_blocks, seq.last_block_hash = i + 1, h

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
        seq.last_block_hash = None

    def forget_cached(self) -> None:
        """Drop every prefix-cache entry (after a failed step, whose blocks may hold garbage)."""
        self.hash_to_block.clear()
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
