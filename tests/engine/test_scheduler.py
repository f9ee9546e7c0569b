from tempering.engine.block_manager import BlockManager
from tempering.engine.config import EngineConfig
from tempering.engine.request import BasePolicy, GenerationRequest
from tempering.engine.sampling_params import SamplingParams
from tempering.engine.scheduler import Scheduler
from tempering.engine.sequence import Sequence, SequenceStatus


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8):
    config = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, block_size=block_size, num_kv_blocks=num_blocks)
    return Scheduler(config, BlockManager(num_blocks, block_size, enable_prefix_caching=False))


def seq(prompt_len, max_tokens=100, first=0):
    request = GenerationRequest(list(range(first, first + prompt_len)), SamplingParams(), 1, BasePolicy())
    return Sequence.from_request(request, 0, 0, max_tokens)


def run_step(sch, *, finish_after=None):
    """Apply a step as the engine does: count computed tokens, append a token to sampling sequences."""
    batch = sch.schedule()
    for s, n in batch.items():
        s.num_computed_tokens += n
        if s.num_computed_tokens == len(s):
            s.token_ids.append(7)
            if finish_after is not None and s.num_completion_tokens >= finish_after:
                sch.finish(s)
    return batch


def test_decode_and_prefill_share_a_step_under_the_token_budget():
    sch = make(budget=12)
    a = seq(5)
    sch.add(a)
    assert run_step(sch).prefill == [(a, 5)]
    b, c = seq(6, first=100), seq(6, first=200)
    sch.add(b)
    sch.add(c)
    batch = run_step(sch)
    assert batch.decode == [a]
    assert batch.prefill == [(b, 6), (c, 5)]  # c gets the rest of the budget: a chunk
    assert batch.num_tokens == 12
    batch = run_step(sch)
    # c's last prompt token is computed exactly like a decode row
    assert batch.decode == [a, b, c] and batch.prefill == []


def test_a_long_prompt_is_prefilled_in_chunks():
    sch = make(budget=8)
    s = seq(20)
    sch.add(s)
    chunks = [run_step(sch).prefill[0][1] for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert s.num_completion_tokens == 1  # sampled once, after the last chunk


def test_preemption_when_blocks_run_out_and_everything_still_finishes():
    sch = make(num_blocks=9, block_size=4, budget=64)  # 8 usable blocks = 32 token slots
    seqs = [seq(6, first=10 * i) for i in range(4)]
    for s in seqs:
        sch.add(s)
    for _ in range(200):
        if not sch.has_work:
            break
        run_step(sch, finish_after=6)
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert sch.num_preemptions > 0
    assert sch.blocks.num_free_blocks == 8


def cached_make(policy, num_blocks=9, host_blocks=0):
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=num_blocks,
                          scheduling_policy=policy)
    return Scheduler(config, BlockManager(num_blocks, 4, num_host_blocks=host_blocks))


def test_longest_prefix_first_starts_the_turn_whose_conversation_is_cached():
    # room for one prompt of 5 blocks; the later request re-sends a conversation still in the cache
    order = {}
    for policy in ("fcfs", "lpm"):
        sch = cached_make(policy)
        old = seq(17, max_tokens=1, first=100)
        sch.add(old)
        run_step(sch, finish_after=1)  # computed, finished: its 4 full blocks stay cached
        fresh, again = seq(18, first=500), seq(18, first=100)  # `again` extends `old`
        sch.add(fresh)
        sch.add(again)
        order[policy] = [s for s, _ in run_step(sch).prefill]
        assert len(order[policy]) == 1
    assert order["fcfs"][0].token_ids[0] == 500
    assert order["lpm"][0].token_ids[0] == 100 and order["lpm"][0].num_cached_tokens == 16


def test_a_request_passed_over_max_bypass_times_goes_first():
    sch = cached_make("lpm", num_blocks=64)
    sch.max_bypass = 2
    warm = seq(9, max_tokens=1, first=100)
    sch.add(warm)
    run_step(sch, finish_after=1)
    sch.config.max_num_seqs = 1  # one admission a step
    head = seq(9, max_tokens=1, first=700)  # nothing of it cached
    sch.add(head)
    for i in range(4):  # a steady stream of requests whose prefix is cached
        sch.add(seq(9 + i, max_tokens=1, first=100))
    started = []
    for _ in range(3):
        started += [s for s, _ in run_step(sch, finish_after=1).prefill]
    assert started[0].token_ids[0] == 100 and started[1].token_ids[0] == 100
    assert started[2] is head and head.num_bypassed == 2


def test_a_prefix_in_the_host_tier_waits_for_room_instead_of_being_recomputed():
    sch = cached_make("fcfs", num_blocks=7, host_blocks=16)  # 6 usable blocks
    first = seq(17, max_tokens=1, first=100)
    sch.add(first)
    run_step(sch, finish_after=1)  # 5 blocks, 4 of them full (cached)
    other = seq(13, max_tokens=12, first=500)  # grows to 6 blocks: evicts `first`'s 4 into the host tier
    sch.add(other)
    for _ in range(11):
        run_step(sch)
    assert len(other.block_table) == 6 and sch.blocks.num_offloaded_blocks == 4
    back = seq(18, max_tokens=1, first=100)  # `first` and one more token
    sch.add(back)
    run_step(sch)  # `other` holds every block: `back` waits, nothing copied back, nothing prefilled
    assert back.status is SequenceStatus.WAITING and not back.block_table
    assert sch.blocks.num_restored_blocks == 0
    sch.finish(other)
    batch = run_step(sch)
    assert batch.prefill == [(back, 2)]  # its 16 cached tokens copied back, 2 computed
    assert sch.blocks.num_restored_blocks == 4 and back.num_cached_tokens == 16


def test_the_host_tier_cuts_the_prefill_of_conversations_that_outgrow_the_cache():
    # benchmarks/scheduler_replay.py, small: 24 conversations of 4 turns through a 12k-token cache
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "scheduler_replay.py"
    spec = importlib.util.spec_from_file_location("scheduler_replay", path)
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    shape = dict(replay.SHAPES["8b"], kv_tokens=12_000)
    runs = {gib: replay.replay(shape, policy="fcfs", host_gib=gib, conversations=24, turns=4, system_tokens=300,
                               tool_delay_s=0.05, hbm_gb_s=3000, pcie_gb_s=40, seed=0) for gib in (0.0, 4.0)}
    without, tiered = runs[0.0], runs[4.0]
    assert without["restored_tokens"] == 0 and tiered["restored_tokens"] > 0
    assert tiered["prefilled_tokens"] < 0.6 * without["prefilled_tokens"]
    assert tiered["prompt_tokens_sent"] == without["prompt_tokens_sent"]
