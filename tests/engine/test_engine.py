"""The continuous-batching engine on the real default model (fp32, CPU)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from tempering.chat import ChatRenderer
from tempering.engine import BasePolicy, Engine, EngineConfig, SamplingParams, engine_model_for
from tempering.engine.hf_engine import kv_cache_kwargs
from tempering.errors import ConfigError

QUESTIONS = ["Write a poem about the sea.", "Explain gravity in one paragraph.", "List some fruits and their colors."]


class LivePolicy:
    """The trainer's adapter, as the service's policy presents it."""

    key = ("adapter", "default")
    adapter_name = "default"

    def __init__(self, version=1):
        self.cache_version = self.version = version

    @contextlib.contextmanager
    def activate(self):
        yield


@pytest.fixture(scope="module")
def setup(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    renderer = ChatRenderer(tokenizer)
    holder = {"peft": None}
    engine = Engine(
        engine_model_for(model, 8192), tokenizer, stop_token_ids=renderer.stop_token_ids, lock=threading.RLock(),
        config=EngineConfig(cpu_kv_cache_bytes=256 << 20), peft_model=lambda: holder["peft"],
    )
    yield engine, model, tokenizer, renderer, holder
    engine.close()


def prompt(renderer, text):
    return renderer.render_prompt([{"role": "user", "content": text}])


def hf_greedy(model, prompt_ids, num_tokens):
    """Greedy decoding with the transformers model and its own KV cache (no logits processors)."""
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        ids = []
        for _ in range(num_tokens):
            token = int(out.logits[0, -1].argmax())
            ids.append(token)
            out = model(torch.tensor([[token]]), use_cache=True, **kv_cache_kwargs(model, out.past_key_values))
    return ids


def test_greedy_output_equals_transformers_for_64_tokens_in_a_batch(setup, hf_model):
    engine, _, _, renderer, _ = setup
    reference, _ = hf_model
    prompts = [prompt(renderer, q) for q in QUESTIONS]
    futures = [engine.submit(p, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), policy=BasePolicy()) for p in prompts]
    for p, f in zip(prompts, futures):
        tokens = f.result()[0].token_ids
        # each token is transformers' argmax after the ones before it (one forward over the whole
        # sequence): so transformers' greedy decoding gives these 64 tokens
        with torch.no_grad():
            logits = reference(torch.tensor([p + tokens])).logits[0, len(p) - 1:-1]
        assert tokens == logits.argmax(-1).tolist()
    assert futures[0].result()[0].token_ids[:16] == hf_greedy(reference, prompts[0], 16)  # and decoded step by step


def test_seeds_reproduce_whatever_else_is_batched(setup):
    engine, _, _, renderer, _ = setup
    p = prompt(renderer, "Tell me a story.")
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=42)
    alone = engine.submit(p, params, n=3, policy=BasePolicy()).result()
    noise = [engine.submit(prompt(renderer, q), SamplingParams(max_tokens=16), policy=BasePolicy()) for q in QUESTIONS]
    crowded = engine.submit(p, params, n=3, policy=BasePolicy()).result()
    for f in noise:
        f.result()
    assert [c.token_ids for c in alone] == [c.token_ids for c in crowded]
    assert len({tuple(c.token_ids) for c in alone}) == 3
    other = engine.submit(p, SamplingParams(max_tokens=16, temperature=1.0, seed=43), n=3, policy=BasePolicy()).result()
    assert [c.token_ids for c in other] != [c.token_ids for c in alone]


def test_stop_strings_and_stop_tokens_end_a_sample(setup):
    engine, _, tokenizer, renderer, _ = setup
    p = prompt(renderer, "What is 12+13? Answer with just the number.")
    full = engine.submit(p, SamplingParams(max_tokens=20, temperature=0), policy=BasePolicy()).result()[0]
    assert "=" in full.text and full.finish_reason == "stop" and full.token_ids[-1] == tokenizer.eos_token_id
    cut = engine.submit(p, SamplingParams(max_tokens=20, temperature=0, stop=["="]), policy=BasePolicy()).result()[0]
    assert cut.finish_reason == "stop" and "=" not in cut.text and full.text.startswith(cut.text)
    # the decode before the cut (the server's raw turn text) comes with it; a sample not cut has none
    assert cut.raw_text == tokenizer.decode(cut.token_ids, skip_special_tokens=True) and "=" in cut.raw_text
    assert cut.raw_text.startswith(cut.text) and full.raw_text is None
    stop_id = full.token_ids[1]
    by_id = engine.submit(p, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id]), policy=BasePolicy()).result()[0]
    assert by_id.token_ids == full.token_ids[:2]
    length = engine.submit(p, SamplingParams(max_tokens=3, temperature=0), policy=BasePolicy()).result()[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 3


def test_n_samples_prefill_their_shared_prompt_once(setup):
    engine, _, _, renderer, _ = setup
    p = prompt(renderer, "Describe a sunrise over the mountains in great detail, please, " * 3)
    before_prefill, before_cached = engine.stats.num_prefill_tokens, engine.stats.num_cached_tokens
    engine.submit(p, SamplingParams(max_tokens=4, temperature=1.0), n=8, policy=BasePolicy()).result()
    prefilled = engine.stats.num_prefill_tokens - before_prefill
    cached = engine.stats.num_cached_tokens - before_cached
    block = engine.config.block_size
    assert cached >= 7 * (len(p) // block - 1) * block  # samples 2..8 reuse the full blocks
    assert prefilled < 2 * len(p) + 8 * block


def test_separate_requests_with_one_prompt_share_its_prefill(setup):
    engine, _, _, renderer, _ = setup
    p = prompt(renderer, "Name three rivers and the countries they flow through, with one fact each. " * 2)
    before = engine.stats.num_cached_tokens
    futures = [engine.submit(p, SamplingParams(max_tokens=4, temperature=1.0), policy=BasePolicy()) for _ in range(6)]
    for f in futures:
        f.result()
    block = engine.config.block_size
    assert engine.stats.num_cached_tokens - before >= 5 * (len(p) // block - 1) * block


def test_a_full_kv_cache_queues_and_preempts_without_changing_results(setup, default_model_dir):
    engine, model, tokenizer, renderer, _ = setup
    small = Engine(
        engine_model_for(model, 8192), tokenizer, stop_token_ids=renderer.stop_token_ids, lock=threading.RLock(),
        config=EngineConfig(num_kv_blocks=12, block_size=16, enable_prefix_caching=False),
    )
    try:
        prompts = [prompt(renderer, f"{q} ({i})") for i, q in enumerate(QUESTIONS * 2)]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)  # 4-5 blocks each: 2 fit
        futures = [small.submit(p, params, policy=BasePolicy()) for p in prompts]
        squeezed = [f.result(timeout=300)[0].token_ids for f in futures]
        roomy = [f.result()[0].token_ids for f in [engine.submit(p, params, policy=BasePolicy()) for p in prompts]]
        assert squeezed == roomy
        assert small.stats.num_preemptions > 0 or small.stats.num_steps > len(prompts) * 24 // 4
        with pytest.raises(ConfigError, match="KV cache"):
            small.submit(list(range(1, 400)), params, policy=BasePolicy())
    finally:
        small.close()


def test_adapter_is_read_live_from_the_trainer_tensors(setup, hf_model):
    from tempering.training import Trainer
    from tempering.types import LoRAConfig

    engine, model, _, renderer, holder = setup
    trainer = Trainer.new(model, LoRAConfig(rank=4, alpha=8))
    holder["peft"] = trainer.peft_model
    try:
        with torch.no_grad():
            for p in trainer.params:  # B starts at zero; give the adapter an effect
                if p.dim() == 2 and p.shape[1] == 4:
                    p.normal_(0, 0.02)
        p = prompt(renderer, "What is 2+2?")
        params = SamplingParams(max_tokens=12, temperature=0)
        base = engine.submit(p, params, policy=BasePolicy()).result()[0]
        tuned = engine.submit(p, params, policy=LivePolicy(1)).result()[0]
        assert tuned.logprobs != base.logprobs
        with torch.no_grad():  # the PEFT model computes the same logprobs
            logits = trainer.peft_model(torch.tensor([p + tuned.token_ids])).logits[0, len(p) - 1:-1]
        expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tuned.token_ids)[:, None])[:, 0]
        assert (expected - torch.tensor(tuned.logprobs)).abs().max() < 1e-4
        assert tuned.token_ids == logits.argmax(-1).tolist()  # greedy under the adapter = PEFT's argmax
        # the mechanism: the engine holds the trainer's own A/B tensors, so nothing is copied after a step
        trained = {q.data_ptr() for q in trainer.params}
        adapter = engine._adapter_weights("default")
        held = [t for layer in adapter.layers for g in layer.values() if g is not None for t in g.A + g.B]
        assert held and all(t.data_ptr() in trained for t in held)
        with torch.no_grad():  # an in-place update (what the optimizer does) is served at once
            for q in trainer.params:
                q.mul_(3.0)
        moved = engine.submit(p, params, policy=LivePolicy(2)).result()[0]
        assert moved.logprobs != tuned.logprobs
    finally:
        holder["peft"] = None
        trainer.peft_model.unload()  # take the LoRA layers out of the shared model again


def test_an_aborted_request_stops_at_once_frees_its_blocks_and_spares_the_others(setup):
    """What the server does when a client disconnects: `abort` ends the request's samples at the
    next step (not at max_tokens), frees their KV blocks, fails only its future, and cancels a
    request still queued."""
    import concurrent.futures

    from tempering.errors import RequestAborted

    engine, _, _, renderer, _ = setup
    free_before = engine.blocks.num_free_blocks
    started = threading.Event()
    counts = [0]

    def on_token(*_):
        counts[0] += 1
        started.set()

    long = SamplingParams(max_tokens=2000, temperature=1.0, ignore_eos=True, seed=1)
    doomed = engine.submit(prompt(renderer, QUESTIONS[0]), long, n=3, policy=BasePolicy(), on_token=on_token)
    other = engine.submit(prompt(renderer, QUESTIONS[1]), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                          policy=BasePolicy())
    assert started.wait(120)
    engine.abort(doomed)
    with pytest.raises(RequestAborted):
        doomed.result(timeout=30)
    assert counts[0] < 3 * 2000
    assert len(other.result(timeout=120)[0].token_ids) == 24  # the request beside it is untouched
    engine.abort(other)  # done already: nothing happens
    assert len(other.result()[0].token_ids) == 24
    queued = concurrent.futures.Future()  # a request the worker has not admitted yet is cancelled outright
    engine.abort(queued)
    assert queued.cancelled()
    after = engine.submit(prompt(renderer, QUESTIONS[2]), SamplingParams(max_tokens=8, temperature=0), policy=BasePolicy())
    assert after.result(timeout=120)[0].token_ids
    assert engine.blocks.num_free_blocks == free_before  # the aborted samples' blocks came back


def test_tiny_temperatures_are_greedy_and_top_p_zero_keeps_the_top_token(setup):
    """T below 1e-5 would overflow float32 logits / T (NaN logprobs): it samples greedily, and
    reports the greedy logprobs' temperature; top_p = 0 (or one that rounds to 0 in float32) keeps
    the most likely token instead of removing every token."""
    engine, _, _, renderer, _ = setup
    p = prompt(renderer, QUESTIONS[1])
    greedy = engine.submit(p, SamplingParams(max_tokens=12, temperature=0), policy=BasePolicy()).result(timeout=120)[0]
    for params in (SamplingParams(max_tokens=12, temperature=1e-40, seed=3), SamplingParams(max_tokens=12, temperature=1e-300),
                   SamplingParams(max_tokens=12, temperature=1.0, top_p=0.0, seed=3),
                   SamplingParams(max_tokens=12, temperature=1.0, top_p=1e-300, seed=3)):
        c = engine.submit(p, params, policy=BasePolicy()).result(timeout=120)[0]
        assert c.token_ids == greedy.token_ids, params
        assert all(lp == lp and lp <= 0 for lp in c.logprobs)  # finite (no NaN)
    assert SamplingParams(temperature=1e-300).logprob_temperature == 1.0
    with pytest.raises(ConfigError, match="top_k"):
        SamplingParams(top_k=2**70)


def test_a_kv_cache_sized_from_memory_stops_at_max_kv_blocks(setup, monkeypatch):
    """A small model in a large memory budget would otherwise count millions of blocks (an object
    each in the block manager: tens of seconds to create for a tiny model on an 80 GB GPU)."""
    from tempering.engine import model_runner

    _, model, tokenizer, renderer, _ = setup
    monkeypatch.setattr(model_runner, "MAX_KV_BLOCKS", 40)
    capped = Engine(engine_model_for(model, 8192), tokenizer, stop_token_ids=renderer.stop_token_ids,
                    lock=threading.RLock(), config=EngineConfig(cpu_kv_cache_bytes=1 << 30))
    try:
        assert capped.runner.num_blocks == 40  # 1 GiB would hold ~1,400 blocks of this model
        out = capped.submit(prompt(renderer, QUESTIONS[0]), SamplingParams(max_tokens=4, temperature=0),
                            policy=BasePolicy()).result(timeout=120)
        assert len(out[0].token_ids) == 4
    finally:
        capped.close()


def test_a_batch_that_mixes_adapters_is_grouped_by_adapter_one_segment_each():
    from types import SimpleNamespace

    from tempering.engine.engine import _grouped_by_adapter
    from tempering.engine.scheduler import ScheduledBatch

    def seq(i, name):
        return SimpleNamespace(i=i, request=SimpleNamespace(policy=SimpleNamespace(adapter_name=name)))

    names = ["a", None, "b", "a", None, "b", "a"]
    decode = [seq(i, n) for i, n in enumerate(names)]
    batch = _grouped_by_adapter(ScheduledBatch(decode=list(decode), prefill=[(seq(7, "b"), 5), (seq(8, "a"), 3)]))
    assert [s.i for s in batch.decode] == [1, 4, 0, 3, 6, 2, 5]  # base rows, then each adapter's, in arrival order
    assert [s.i for s, _ in batch.prefill] == [8, 7]
    alone = ScheduledBatch(decode=[seq(0, "a"), seq(1, "a")])
    assert _grouped_by_adapter(alone).decode == alone.decode  # one adapter: untouched


def test_conversations_that_outgrow_the_kv_cache_come_back_from_the_host_tier(setup):
    # three conversations re-sent turn after turn through a cache that holds about one of them:
    # with the host tier, each turn's re-sent conversation is copied back instead of prefilled,
    # and every answer is the one a roomy cache gives
    engine, model, tokenizer, renderer, _ = setup

    def converse(eng):
        conversations = [prompt(renderer, q) for q in QUESTIONS]
        answers = []
        for turn in range(3):
            futures = [eng.submit(c, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                  policy=BasePolicy()) for c in conversations]
            outs = [f.result(timeout=300)[0].token_ids for f in futures]
            answers.append(outs)
            conversations = [c + o + tokenizer.encode(f" Tool result {turn}: {i * 7 + turn}.") for i, (c, o)
                             in enumerate(zip(conversations, outs))]
        return answers

    def small(**config):
        return Engine(engine_model_for(model, 8192), tokenizer, stop_token_ids=renderer.stop_token_ids,
                      lock=threading.RLock(), config=EngineConfig(num_kv_blocks=10, block_size=16, max_num_seqs=1, **config))

    with pytest.raises(ConfigError, match="kv_offloading_size is 1e[+]06 GiB but this host has"):
        small(kv_offloading_size=1e6)  # more than the host has: a clear error before anything is pinned
    tiered, plain = small(kv_offloading_size=0.05), small()
    try:
        roomy = converse(engine)
        assert converse(tiered) == roomy
        assert converse(plain) == roomy
        assert tiered.stats.num_restored_tokens > 0 and tiered.stats.num_offloaded_tokens > 0
        assert tiered.stats.num_prefill_tokens < plain.stats.num_prefill_tokens
        assert plain.stats.num_restored_tokens == 0
    finally:
        tiered.close()
        plain.close()
