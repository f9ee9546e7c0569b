import random

import pytest

from tempering.engine.block_manager import BlockManager
from tempering.engine.request import BasePolicy, GenerationRequest
from tempering.engine.sampling_params import SamplingParams
from tempering.engine.sequence import Sequence


def seq(tokens, adapter=BasePolicy()):
    request = GenerationRequest(list(tokens), SamplingParams(), 1, adapter)
    return Sequence.from_request(request, 0, 0, 100)


def prefill(bm, s):
    bm.allocate_prefix(s)
    n = s.num_uncomputed_tokens
    bm.allocate(s, n)
    s.num_computed_tokens += n


def test_block_zero_is_never_handed_out_and_blocks_cover_the_sequence():
    bm = BlockManager(8, 4)
    s = seq(range(10))
    prefill(bm, s)
    assert 0 not in s.block_table and len(s.block_table) == 3
    assert bm.num_free_blocks == 7 - 3


def test_a_shared_prompt_prefix_reuses_full_blocks_but_not_the_last_token():
    bm = BlockManager(16, 4)
    a, b = seq(range(10)), seq(list(range(8)) + [50, 51])
    prefill(bm, a)
    bm.allocate_prefix(b)
    assert b.num_cached_tokens == 8 and b.block_table == a.block_table[:2]
    same = seq(range(10))
    bm.allocate_prefix(same)
    assert same.num_cached_tokens == 8  # the block holding the last token is always recomputed
    exact = seq(range(12))
    bm.allocate_prefix(exact)
    assert exact.num_cached_tokens == 8


def test_blocks_are_shared_within_one_step_once_allocated():
    bm = BlockManager(16, 4)
    a, b = seq(range(9)), seq(range(9))
    bm.allocate_prefix(a)
    bm.allocate(a, a.num_uncomputed_tokens)  # same step: a's blocks are published at allocation
    bm.allocate_prefix(b)
    assert b.num_cached_tokens == 8


def test_different_adapters_never_share_blocks():
    class Other(BasePolicy):
        adapter_name, cache_version = "default", 3

    bm = BlockManager(16, 4)
    a = seq(range(9))
    prefill(bm, a)
    b = seq(range(9), Other())
    bm.allocate_prefix(b)
    assert b.num_cached_tokens == 0


def test_freed_blocks_stay_findable_until_reused():
    bm = BlockManager(6, 4)
    a = seq(range(9))
    prefill(bm, a)
    bm.free(a)
    b = seq(range(9))
    bm.allocate_prefix(b)
    assert b.num_cached_tokens == 8
    bm.forget_cached()
    c = seq(range(9))
    bm.allocate_prefix(c)
    assert c.num_cached_tokens == 0


def test_ref_counts_return_to_zero_after_random_workloads():
    rng = random.Random(0)
    bm = BlockManager(64, 4)
    live = []
    for _ in range(300):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 8):
            bm.free(live.pop(rng.randrange(len(live))))
            continue
        prefix = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        s = seq(prefix + [rng.randrange(100) for _ in range(rng.randrange(1, 6))])
        bm.allocate_prefix(s)
        if not bm.can_allocate(s, s.num_uncomputed_tokens):
            bm.free(s)
            continue
        bm.allocate(s, s.num_uncomputed_tokens)
        s.num_computed_tokens = len(s)
        for _ in range(rng.randrange(4)):  # decode a few tokens
            s.token_ids.append(rng.randrange(100))
            if not bm.can_allocate(s, 1):
                break
            bm.allocate(s, 1)
            s.num_computed_tokens += 1
        live.append(s)
        owners = {}
        for t in live:
            for block_id in t.block_table:
                owners[block_id] = owners.get(block_id, 0) + 1
        assert all(bm.blocks[b].ref_count == n for b, n in owners.items())
    for s in live:
        bm.free(s)
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert bm.num_free_blocks == 63


def test_free_blocks_are_reused_least_recently_freed_first_and_cache_hits_leave_no_double_entry():
    bm = BlockManager(6, 4)  # blocks 1..5
    a, b = seq(range(8)), seq(range(100, 108))
    prefill(bm, a)
    prefill(bm, b)
    first, second = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)  # free order: 5, then a's blocks (reversed), then b's blocks (reversed)
    again = seq(list(range(8)) + [9])  # a cache hit takes a's blocks back from the free queue
    bm.allocate_prefix(again)
    assert again.block_table == first and bm.num_free_blocks == 3
    taken = [bm._take_free().block_id for _ in range(3)]
    assert taken == [5, *reversed(second)]  # a's stale entries were skipped
    assert bm.num_free_blocks == 0


def test_the_free_queue_stays_bounded_when_cache_hits_keep_reviving_free_blocks():
    bm = BlockManager(8, 4)
    for _ in range(200):  # the same prompt again and again: every block comes back from the cache
        s = seq(range(9))
        prefill(bm, s)
        bm.free(s)
    assert len(bm._free_queue) <= 2 * len(bm.blocks)
    assert bm.num_free_blocks == 7
    assert sorted(bm._take_free().block_id for _ in range(7)) == list(range(1, 8))


def _run_transfers(bm, device, host):
    """The copies the engine runs before a step's forward, on stand-ins for the two caches."""
    for to_host, block, slot in bm.take_transfers():
        if to_host:
            host[slot] = device[block]
        else:
            device[block] = host[slot]


@pytest.mark.parametrize("host_blocks", [1, 3, 24])
def test_the_host_tier_gives_back_evicted_prefixes_with_their_own_content(host_blocks):
    # an agent's conversations, each re-sent longer, outgrow the device cache: every block taken from
    # the cache, on the device or copied back from the host, must hold its own tokens' K/V, also when
    # the host tier is smaller than one prefix (its slots then turn over within a step)
    restored = 0
    for trial in range(30):
        rng = random.Random(trial)
        bm = BlockManager(12, 4, num_host_blocks=host_blocks)
        device, host = {}, {}  # block -> the tokens whose K/V it holds; host slot -> the same
        conversations = [list(range(100 * c, 100 * c + 9)) for c in range(6)]
        for _ in range(60):
            c = rng.randrange(len(conversations))
            s = seq(conversations[c])
            ready = bm.allocate_prefix(s)
            n = s.num_uncomputed_tokens
            if not ready or not bm.can_allocate(s, n):
                bm.free(s)
                _run_transfers(bm, device, host)
                continue
            bm.allocate(s, n)
            _run_transfers(bm, device, host)
            for i in range(s.num_cached_tokens // 4):
                assert device[s.block_table[i]] == tuple(s.block_tokens(i, 4))
            for i in range(s.num_cached_tokens // 4, len(s.block_table)):  # the step's forward
                device[s.block_table[i]] = tuple(s.block_tokens(i, 4))
            s.num_computed_tokens += n
            bm.free(s)
            conversations[c] += [rng.randrange(1000, 2000) for _ in range(rng.randint(1, 6))]
            if len(conversations[c]) > 40:
                conversations[c] = list(range(100 * c, 100 * c + 9))
        assert bm.num_free_blocks == 11
        slots = [slot for slot, _ in bm.host.values()] + bm._host_free  # every slot once: none lost
        assert sorted(slots) == list(range(host_blocks))
        restored += bm.num_restored_blocks
    assert restored > 30


def test_a_prefix_evicted_from_the_device_is_copied_back_instead_of_recomputed():
    bm = BlockManager(5, 4, num_host_blocks=8)  # 4 usable blocks
    a = seq(range(13))
    prefill(bm, a)  # 4 blocks, the first 3 full (hashed)
    bm.free(a)
    b = seq(range(100, 109))
    prefill(bm, b)  # takes a's last 3 blocks: its 2 full ones among them go to the host tier
    assert [t[0] for t in bm.take_transfers()] == [True, True]
    bm.free(b)
    again = seq(range(13))
    bm.allocate_prefix(again)
    assert again.num_cached_tokens == 12  # block 0 still on the device, blocks 1-2 back from the host
    assert [t[0] for t in bm.take_transfers()].count(False) == 2
    assert bm.num_restored_blocks == 2
    without = BlockManager(5, 4)
    for s in (seq(range(13)), seq(range(100, 109))):
        prefill(without, s)
        without.free(s)
    recomputed = seq(range(13))
    without.allocate_prefix(recomputed)
    assert recomputed.num_cached_tokens == 4
