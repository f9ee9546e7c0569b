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
