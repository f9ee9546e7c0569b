"""One request's failure stays that request's: closing with a cancelled request queued, a token
callback that raises, bad input refused at `submit`; and the sampler never draws an excluded token.
A tiny random Llama on the CPU (fp32)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tempering.engine import BasePolicy, Engine, EngineConfig, SamplingParams, engine_model_for
from tempering.engine.sampler import _invert_cdf
from tempering.errors import ConfigError, EngineError

from test_models import NullTokenizer, tiny

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny("llama3", "cpu", torch.float32)


def engine_for(model) -> Engine:
    return Engine(engine_model_for(model, 512), NullTokenizer(), stop_token_ids=[0], lock=threading.RLock(),
                  config=EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=64), max_seq_len=512)


def test_closing_with_a_cancelled_request_queued_fails_every_other_request(model):
    engine = engine_for(model)
    held = threading.Event()

    def hold_the_worker():  # it takes the lock to launch a step: it stops there, leaving new requests queued
        with engine.lock:
            held.set()
            time.sleep(1.0)

    threading.Thread(target=hold_the_worker).start()
    held.wait()
    running = engine.submit([1, 2, 3], GREEDY, policy=BasePolicy())
    time.sleep(0.3)  # admitted; the worker now waits for the lock
    cancelled = engine.submit([4, 5, 6], GREEDY, policy=BasePolicy())
    engine.abort(cancelled)  # still queued: cancelled in place
    queued = engine.submit([7, 8, 9], GREEDY, policy=BasePolicy())
    engine.close()  # raised InvalidStateError on the cancelled future, leaving the others unresolved
    assert cancelled.cancelled()
    for future in (running, queued):
        with pytest.raises(EngineError, match="closed"):
            future.result(timeout=5)


def test_a_token_callback_that_raises_stops_its_request_alone(model):
    engine = engine_for(model)
    try:
        def on_token(sample, token, logprob, top):
            raise RuntimeError("Event loop is closed")  # a streaming client's loop, gone

        other = engine.submit([1, 2, 3], GREEDY, policy=BasePolicy())
        streamed = engine.submit([4, 5, 6], GREEDY, policy=BasePolicy(), on_token=on_token)
        assert len(other.result(timeout=60)[0].token_ids) == 40
        with pytest.raises(EngineError, match="callback raised RuntimeError"):
            streamed.result(timeout=60)
        assert engine.blocks.num_free_blocks == len(engine.blocks.blocks) - 1  # every block back (0 is the scratch block)
    finally:
        engine.close()


def test_bad_input_is_refused_at_submit_and_the_engine_serves_on(model):
    engine = engine_for(model)
    try:
        with pytest.raises(ConfigError, match="token id 500, outside the model's vocabulary"):
            engine.submit([1, 500, 3], GREEDY, policy=BasePolicy())
        with pytest.raises(ConfigError, match="token id -1"):
            engine.submit([1, -1], GREEDY, policy=BasePolicy())
        with pytest.raises(ConfigError, match="seed must be an integer"):
            SamplingParams(seed=1.5)
        assert SamplingParams(seed=torch.tensor(3).numpy()).seed == 3  # an integer of any kind
        # settings from JSON (`serve --engine-config`): "no" would have been a true bool
        with pytest.raises(ConfigError, match="enable_prefix_caching must be bool, got 'no'"):
            EngineConfig(enable_prefix_caching="no")
        with pytest.raises(ConfigError, match="max_num_seqs must be int, got 2.5"):
            EngineConfig(max_num_seqs=2.5)
        assert EngineConfig(max_num_seqs=np.int64(8), gpu_memory_fraction=1 / 3).max_num_seqs == 8  # any integer
        assert len(engine.submit([1, 2, 3], GREEDY, policy=BasePolicy()).result(timeout=60)[0].token_ids) == 40
    finally:
        engine.close()


def test_ignore_eos_keeps_the_requests_own_stop_token_ids(model):
    engine = engine_for(model)
    try:
        free = engine.submit([1, 2, 3], GREEDY, policy=BasePolicy()).result(timeout=60)[0]
        stop_id = free.token_ids[5]
        stopped = engine.submit([1, 2, 3], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                          stop_token_ids=[stop_id]), policy=BasePolicy()).result(timeout=60)[0]
        first = free.token_ids.index(stop_id)
        assert stopped.token_ids == free.token_ids[:first + 1] and stopped.finish_reason == "stop"
    finally:
        engine.close()


def test_the_inverse_cdf_never_draws_an_excluded_token_even_at_the_edges_of_u():
    """Chunk masses are float32 log-sum-exps and sums inside a chunk float64: at u near 1 the two
    rounded apart and the draw could land past a chunk's last kept token."""
    g = torch.Generator().manual_seed(0)
    for trial in range(100):
        logprobs = torch.log_softmax(torch.randn(1, 2100, generator=g) * 3, -1)
        keep = torch.zeros(2100, dtype=torch.bool)
        keep[torch.randperm(2100, generator=g)[:40]] = True
        logprobs = logprobs.masked_fill(~keep, float("-inf"))
        for u in (2.0 ** -33, 0.5, 1 - 2.0 ** -33):
            assert keep[int(_invert_cdf(logprobs, torch.tensor([u], dtype=torch.float64)))], (trial, u)


def test_a_request_whose_adapter_is_unloaded_fails_alone(model):
    """A server unloads the least recently used saved step's adapter; requests on it then fail with
    the reason, and the others go on (they all failed: the step could not find the adapter)."""
    from test_models import AdapterPolicy, with_lora

    peft = with_lora(tiny("llama3", "cpu", torch.float32), ("q_proj", "v_proj"), adapters=("default", "step-0001"))
    engine = Engine(engine_model_for(peft.get_base_model(), 512), NullTokenizer(), stop_token_ids=[0],
                    lock=threading.RLock(), config=EngineConfig(num_kv_blocks=64, block_size=16), max_seq_len=512,
                    peft_model=lambda: peft)
    try:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        on_old = engine.submit([1, 2, 3], params, policy=AdapterPolicy("step-0001", 1))
        on_base = engine.submit([4, 5, 6], params, policy=BasePolicy())
        while not engine.stats.num_decode_tokens:
            time.sleep(0.01)
        assert engine.adapter_in_use("step-0001") and not engine.adapter_in_use("default")
        with engine.lock:  # as the service unloads one: under the engine's lock
            peft.delete_adapter("step-0001")
            engine.forget_adapter("step-0001")
        with pytest.raises(EngineError, match="'step-0001' is not loaded .*send the request again"):
            on_old.result(timeout=60)
        assert len(on_base.result(timeout=60)[0].token_ids) == 200
    finally:
        engine.close()


def test_the_service_unloads_the_least_recently_used_saved_step_no_request_samples_with():
    import collections
    from types import SimpleNamespace

    from tempering.service.service import ModelService

    busy = {"step-0001"}
    service = SimpleNamespace(engine=SimpleNamespace(adapter_in_use=lambda name: name in busy),
                              _step_adapters=collections.OrderedDict((s, f"step-{s:04d}") for s in (1, 2, 3)))
    assert ModelService._evictable_step_adapter(service) == "step-0002"  # step 1 is in use
    busy.add("step-0003")
    assert ModelService._evictable_step_adapter(service) is None  # 3 is the newest: kept; 1 in use
    assert list(service._step_adapters) == [1, 3]


def test_cancelling_an_asyncio_caller_stops_its_running_request(model):
    import asyncio

    engine = engine_for(model)
    try:
        async def cancel_midway():
            task = asyncio.ensure_future(engine.generate([1, 2, 3], SamplingParams(max_tokens=400, temperature=0,
                                                                                   ignore_eos=True), policy=BasePolicy()))
            while not engine.stats.num_decode_tokens:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancel_midway())
        deadline = time.time() + 10
        while not engine.is_idle and time.time() < deadline:  # its samples stop (they ran on for nobody)
            time.sleep(0.01)
        assert engine.is_idle and engine.stats.num_decode_tokens < 200  # 399 when it ran to the end
    finally:
        engine.close()


def test_closing_while_the_worker_is_stuck_in_a_step_fails_queued_requests_now_and_running_ones_when_it_returns(model):
    engine = engine_for(model)
    running = engine.submit([1, 2, 3], GREEDY, policy=BasePolicy())
    running.result(timeout=60)  # warm: a step launches at once below
    release = threading.Event()
    step = engine._step

    def stuck_step():  # a step that waits (as one waiting for a long training step's weights does)
        release.wait(30)
        step()

    engine._step = stuck_step
    running = engine.submit([1, 2, 3], GREEDY, policy=BasePolicy())
    time.sleep(0.3)  # admitted: the worker is inside its step
    queued = engine.submit([4, 5, 6], GREEDY, policy=BasePolicy())
    engine.close(timeout_s=0.2)  # read the worker's structures while it ran
    with pytest.raises(EngineError, match="closed"):
        queued.result(timeout=1)
    assert not running.done()  # the worker's own, until its step returns
    release.set()
    with pytest.raises(EngineError, match="closed"):
        running.result(timeout=30)
    engine._thread.join(timeout=30)
    assert not engine._thread.is_alive()
