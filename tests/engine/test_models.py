"""Engine model code against transformers, for each supported architecture (tiny random models).

Runs on CPU (fp32) everywhere; the same checks run on CUDA in bf16 (Triton decode kernel,
varlen prefill, CUDA graphs) when a GPU is present.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tempering.engine import BasePolicy, Engine, EngineConfig, SamplingParams, engine_model_for


class NullTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def tiny(arch: str, device: str, dtype: torch.dtype):
    import transformers

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if arch == "llama3":
        config = transformers.LlamaConfig(**common, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config, cls = transformers.Qwen3Config(**common, head_dim=32), transformers.Qwen3ForCausalLM
    elif arch == "mistral":
        config, cls = transformers.MistralConfig(**{**common, "tie_word_embeddings": True}, sliding_window=None), transformers.MistralForCausalLM
    elif arch == "gemma3":  # local layers with a 16-token window around a global one; prompts and decodes outgrow it
        config = transformers.Gemma3TextConfig(**{**common, "tie_word_embeddings": True, "num_hidden_layers": 3},
                                               head_dim=32, sliding_window=16, query_pre_attn_scalar=24,
                                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    model = cls(config).to(device=device, dtype=dtype).eval()
    with torch.no_grad():  # make q/k/v biases (Qwen2) and Gemma's zero-centred norm weights non-trivial
        for name, p in model.named_parameters():
            if name.endswith("bias") or (arch == "gemma3" and name.endswith("norm.weight")):
                p.normal_(0, 0.5 if name.endswith("bias") else 0.3)
    return model


DEVICES = [("cpu", torch.float32)] + ([("cuda", torch.bfloat16)] if torch.cuda.is_available() else [])
# a second GPU: the engine's thread must make it its current device (Triton and CUDA graphs launch there)
DEVICES += [("cuda:1", torch.bfloat16)] if torch.cuda.device_count() >= 2 else []


@pytest.mark.parametrize("device,dtype", DEVICES, ids=[d for d, _ in DEVICES])
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "mistral", "gemma3"])
def test_engine_logprobs_and_greedy_tokens_match_transformers(arch, device, dtype):
    model = tiny(arch, device, dtype)
    reference = tiny(arch, device, dtype)  # same seed: the same weights, left unfused
    decoder = engine_model_for(model, 512)
    assert decoder is not None
    engine = Engine(decoder, NullTokenizer(), stop_token_ids=[0], lock=threading.RLock(),
                    config=EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=64), max_seq_len=512)
    try:
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 40, 77)]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        futures = [engine.submit(p, params, n=2, policy=BasePolicy()) for p in prompts]  # 77 > 64: chunked prefill
        tol = 1e-4 if dtype == torch.float32 else 0.1
        for p, f in zip(prompts, futures):
            a, b = f.result(timeout=300)
            assert a.token_ids == b.token_ids  # greedy samples of one request agree (shared prefix, other row)
            with torch.no_grad():
                logits = reference(torch.tensor([p + a.token_ids], device=device)).logits[0, len(p) - 1:-1].float()
            expected = torch.log_softmax(logits, -1)
            chosen = expected.gather(1, torch.tensor(a.token_ids, device=device)[:, None])[:, 0].cpu()
            assert (chosen - torch.tensor(a.logprobs)).abs().max() < tol
            if dtype == torch.float32:  # greedy = argmax of transformers' logits at every step
                assert a.token_ids == expected.argmax(-1).tolist()
    finally:
        engine.close()


class AdapterPolicy:
    """A named adapter of the PEFT model, as the service's policies present it to the engine."""

    def __init__(self, name, version=0):  # the version keys the prefix cache: it changes with the weights
        self.adapter_name, self.key, self.cache_version, self.version = name, ("adapter", name), version, version

    def activate(self):
        import contextlib

        return contextlib.nullcontext()


def with_lora(model, targets, *, adapters=("default",)):
    """Wrap `model` in PEFT LoRA adapters of rank 4 with random non-zero A and B."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False)
    peft_model = get_peft_model(model, config, adapter_name=adapters[0])
    for name in adapters[1:]:
        peft_model.add_adapter(name, config)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)  # s·B·A about as large as the base weights
    return peft_model


def reference_logprobs(peft_model, adapter, prompt, token_ids, device):
    """log_softmax of the PEFT model's forward at the sampled tokens, with `adapter` (None: disabled)."""
    import contextlib

    if adapter is not None:
        peft_model.set_adapter(adapter)
    with torch.no_grad(), (peft_model.disable_adapter() if adapter is None else contextlib.nullcontext()):
        logits = peft_model(torch.tensor([prompt + token_ids], device=device)).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1)


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("device,dtype", DEVICES, ids=[d for d, _ in DEVICES])
@pytest.mark.parametrize("targets", [ALL, ("q_proj", "v_proj", "up_proj", "down_proj")], ids=["all", "some"])
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "gemma3"])
def test_engine_with_a_live_lora_matches_the_peft_forward(arch, targets, device, dtype):
    """Greedy tokens and logprobs with a non-zero adapter equal transformers + PEFT (decode graphs on GPU)."""
    model = tiny(arch, device, dtype)
    engine = Engine(engine_model_for(model, 512), NullTokenizer(), stop_token_ids=[0], lock=threading.RLock(),
                    config=EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=64), max_seq_len=512,
                    peft_model=lambda: peft_model)
    peft_model = with_lora(model, targets)
    try:
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 40, 77)]
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        futures = [engine.submit(p, params, n=2, policy=AdapterPolicy("default")) for p in prompts]
        tol = 1e-4 if dtype == torch.float32 else 0.1
        for p, f in zip(prompts, futures):
            a, b = f.result(timeout=300)
            assert a.token_ids == b.token_ids
            expected = reference_logprobs(peft_model, "default", p, a.token_ids, device)
            chosen = expected.gather(1, torch.tensor(a.token_ids, device=device)[:, None])[:, 0].cpu()
            assert (chosen - torch.tensor(a.logprobs)).abs().max() < tol
            if dtype == torch.float32:
                assert a.token_ids == expected.argmax(-1).tolist()
        base = engine.submit(prompts[0], params, policy=BasePolicy()).result(timeout=300)[0]
        assert base.logprobs != futures[0].result()[0].logprobs  # the adapter changes the policy
    finally:
        engine.close()


@pytest.mark.parametrize("device,dtype", DEVICES, ids=[d for d, _ in DEVICES])
@pytest.mark.parametrize("targets", [ALL, ("q_proj", "v_proj", "up_proj", "down_proj")], ids=["all", "some"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_spare_rows_lora_matches_peft_and_follows_in_place_updates(arch, targets, device, dtype):
    """The fast path (the adapter's A in spare rows of the base weights, the q/k/v, o and down deltas
    fused into the next kernels with shadows of B^T; the PyTorch twins on CPU) is exact, and an
    in-place change of A or B (what the optimizer does) is served at the next request."""
    from tempering.engine.models import LlamaFamilyModel

    model = tiny(arch, device, dtype)
    decoder = LlamaFamilyModel(model, 512, max_lora_rank=8, spare_rows=True)
    engine = Engine(decoder, NullTokenizer(), stop_token_ids=[0], lock=threading.RLock(),
                    config=EngineConfig(num_kv_blocks=64, block_size=16), max_seq_len=512, peft_model=lambda: peft_model)
    peft_model = with_lora(model, targets)
    try:
        prompt = torch.randint(1, 128, (37,), generator=torch.Generator().manual_seed(4)).tolist()
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        tol = 1e-4 if dtype == torch.float32 else 0.1
        for update in range(3):
            c = engine.submit(prompt, params, n=2, policy=AdapterPolicy("default", update)).result(timeout=300)[0]
            assert decoder.spare_rows.bound is engine._adapter_weights("default")
            expected = reference_logprobs(peft_model, "default", prompt, c.token_ids, device)
            chosen = expected.gather(1, torch.tensor(c.token_ids, device=device)[:, None])[:, 0].cpu()
            assert (chosen - torch.tensor(c.logprobs)).abs().max() < tol, update
            with torch.no_grad():  # the optimizer's in-place step: A first, then B
                for name, p in peft_model.named_parameters():
                    if ("lora_A" if update == 0 else "lora_B") in name:
                        p.mul_(1.5)
        spare = decoder.spare_rows.full[0]["qkv"][decoder.spare_rows.num_out["qkv"]:].float()
        assert spare.abs().sum() > 0  # the spare rows hold A's copy ...
        q_weight = model.model.layers[0].self_attn.q_proj.base_layer.weight
        assert torch.equal(q_weight, decoder.layers[0].qkv[:q_weight.shape[0]])  # ... and the base weights are untouched
    finally:
        engine.close()


def test_spare_rows_round_a_wide_projection_to_64_rows_and_never_exceed_the_allocation():
    from tempering.engine.lora import SpareRows, spare_rows_for

    assert spare_rows_for(16, 17920) == 64  # gate/up of a 1.5B model: 17984 rows, 0.36% more
    assert spare_rows_for(24, 2048) == 24 and spare_rows_for(8, 1536) == 8  # rounding to 64 would cost 3-4%
    assert spare_rows_for(3, 100) == 8
    for num_out in (96, 1536, 2048, 4096, 17920, 2 * 27648):
        for slices in (1, 2, 3):
            allocated = SpareRows.allocation(slices, 16, num_out)
            for rank in (1, 4, 8, 16):
                assert slices * rank <= spare_rows_for(slices * rank, num_out) <= allocated


@pytest.mark.parametrize("device,dtype", DEVICES, ids=[d for d, _ in DEVICES])
def test_one_batch_mixing_base_live_and_older_adapters_gives_each_row_its_policy(device, dtype):
    model = tiny("qwen2", device, dtype)
    engine = Engine(engine_model_for(model, 512), NullTokenizer(), stop_token_ids=[0], lock=threading.RLock(),
                    config=EngineConfig(num_kv_blocks=64, block_size=16), max_seq_len=512,
                    peft_model=lambda: peft_model)
    peft_model = with_lora(model, ALL, adapters=("default", "step-1"))
    try:
        prompt = torch.randint(1, 128, (21,), generator=torch.Generator().manual_seed(3)).tolist()
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        policies = {None: BasePolicy(), "default": AdapterPolicy("default"), "step-1": AdapterPolicy("step-1")}
        steps_before = engine.stats.num_steps
        with engine._cond:  # hold the worker back so that the three requests are scheduled together
            futures = {name: engine.submit(prompt, params, policy=pol) for name, pol in policies.items()}
        results = {name: f.result(timeout=300)[0] for name, f in futures.items()}
        assert engine.stats.num_steps - steps_before <= 16  # one batch: a prefill step, then shared decode steps
        tol = 1e-4 if dtype == torch.float32 else 0.1
        for name, c in results.items():
            expected = reference_logprobs(peft_model, name, prompt, c.token_ids, device)
            chosen = expected.gather(1, torch.tensor(c.token_ids, device=device)[:, None])[:, 0].cpu()
            assert (chosen - torch.tensor(c.logprobs)).abs().max() < tol, name
        assert len({tuple(c.logprobs) for c in results.values()}) == 3
    finally:
        engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lora", [False, True], ids=["base", "live-lora"])
def test_sampling_inside_the_decode_graph_draws_what_the_eager_step_draws(lora):
    """A decode graph that samples (the RL case) gives the seeded tokens and logprobs of an eager
    step; so does a graph that leaves top-p sampling to the runner. Pending tokens flow through
    `last_tokens` from prefill (eager) steps into graph steps and back."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (9, 33, 50)]
    outputs = {}
    for use_graphs in (True, False):
        model = tiny("qwen2", "cuda", torch.bfloat16)
        peft_model = with_lora(model, ALL) if lora else None
        engine = Engine(engine_model_for(model, 512), NullTokenizer(), stop_token_ids=[0], lock=threading.RLock(),
                        config=EngineConfig(num_kv_blocks=64, block_size=16, use_cuda_graphs=use_graphs), max_seq_len=512,
                        peft_model=lambda peft_model=peft_model: peft_model)
        policy = AdapterPolicy("default") if lora else BasePolicy()
        try:
            free = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
            nucleus = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=8, ignore_eos=True)
            outputs[use_graphs] = [[c for r in (engine.submit(p, params, n=4, policy=policy) for p in prompts)
                                    for c in r.result(timeout=300)] for params in (free, nucleus)]  # n=4: one graph bucket, eager shapes alike
            if use_graphs:
                kinds = {key[2] for key, captured in engine.runner.graphs.graphs.items() if captured is not None}
                assert kinds == {True, False}  # graphs that sample and graphs that leave it to the runner ran
        finally:
            engine.close()
        if use_graphs:  # closing frees them (graphs that captured NCCL collectives would block its teardown)
            assert engine.runner.graphs is None
    for graphed, eager in zip(outputs[True], outputs[False]):
        for a, b in zip(graphed, eager):
            assert a.token_ids == b.token_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_cascade_attention_over_a_shared_system_prompt_gives_the_logprobs_transformers_gives(arch):
    """12 conversations sharing a 320-token system prompt through the prefix cache, decoded with
    cascade attention (graphs and eager steps; Gemma 3's sliding layers read their own keys): each
    row's greedy tokens score as transformers scores them, and the shared prefix was used."""
    g = torch.Generator().manual_seed(6)
    system = torch.randint(1, 128, (320,), generator=g).tolist()
    prompts = [system + torch.randint(1, 128, (n,), generator=g).tolist() for n in range(3, 15)]
    model, reference = tiny(arch, "cuda", torch.bfloat16), tiny(arch, "cuda", torch.bfloat16)
    engine = Engine(engine_model_for(model, 512), NullTokenizer(), stop_token_ids=[0], lock=threading.RLock(),
                    config=EngineConfig(num_kv_blocks=512, block_size=16, cascade_attention=True), max_seq_len=512)
    try:
        engine.submit(system + [5], SamplingParams(max_tokens=1)).result(timeout=300)  # the prompt in the cache
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        futures = [engine.submit(p, params) for p in prompts]
        for p, f in zip(prompts, futures):
            [a] = f.result(timeout=300)
            with torch.no_grad():
                logits = reference(torch.tensor([p + a.token_ids], device="cuda")).logits[0, len(p) - 1:-1].float()
            chosen = torch.log_softmax(logits, -1).gather(1, torch.tensor(a.token_ids, device="cuda")[:, None])[:, 0]
            assert (chosen.cpu() - torch.tensor(a.logprobs)).abs().max() < 0.1
        assert engine.runner.graphs.shared_prefix.item() == 320  # the last step's 12 rows shared 20 blocks
    finally:
        engine.close()


def test_the_shared_prefix_of_a_decode_batch_is_the_blocks_every_row_holds():
    import numpy as np

    from tempering.engine.model_runner import shared_prefix_len

    tables = np.tile(np.arange(1, 41, dtype=np.int32), (8, 1))
    lens = [600] * 8
    assert shared_prefix_len(tables, lens, 16) == 37 * 16  # whole blocks before every row's newest key
    tables[3, 30:] += 100  # one row's own blocks from block 30
    assert shared_prefix_len(tables, lens, 16) == 30 * 16
    assert shared_prefix_len(tables, [600] * 7 + [400], 16) == 25 * 16  # the shortest row's whole blocks
    tables[5, 10] = 999
    assert shared_prefix_len(tables, lens, 16) == 0  # 160 keys: each row reads its own
    assert shared_prefix_len(tables[:7], lens[:7], 16) == 0  # fewer than 8 rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_bucket_whose_capture_failed_runs_eagerly_is_tried_again_and_its_adapter_can_be_unloaded(monkeypatch):
    """A decode graph whose capture fails (here: forced) leaves its bucket to run eagerly, with the
    tokens a graph gives; the capture is tried again after `retry_after` eager steps, `max_attempts`
    times in all; unloading the adapter drops its failed buckets with its graphs."""
    from tempering.engine.cuda_graphs import DecodeGraphs

    model = tiny("qwen2", "cuda", torch.bfloat16)
    peft_model = with_lora(model, ALL)
    prompt = list(range(3, 20))
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=3, ignore_eos=True)  # 15 decode steps of 4 rows
    record = DecodeGraphs._record
    monkeypatch.setattr(DecodeGraphs, "retry_after", 3)
    outputs = {}
    for failing in (0, 1, 99):  # captures of bucket 4 that fail before one succeeds
        tries = []

        def record_failing(self, step, what, failing=failing, tries=tries):  # as a failed capture returns
            if what == "decode bucket 4":
                tries.append(what)
                if len(tries) <= failing:
                    return None, None
            return record(self, step, what)

        monkeypatch.setattr(DecodeGraphs, "_record", record_failing)
        engine = Engine(engine_model_for(model, 512), NullTokenizer(), stop_token_ids=[0], lock=threading.RLock(),
                        config=EngineConfig(num_kv_blocks=64, block_size=16), max_seq_len=512,
                        peft_model=lambda: peft_model)
        try:
            outputs[failing] = engine.submit(prompt, params, n=4, policy=AdapterPolicy("default")).result(timeout=300)
            (captured,) = [v for k, v in engine.runner.graphs.graphs.items() if k[0] == 4]
            assert len(tries) == min(failing + 1, DecodeGraphs.max_attempts)
            assert (captured is None) == (failing >= DecodeGraphs.max_attempts)
            with engine.lock:
                engine.forget_adapter("default")  # raised AttributeError on the None of a failed capture
            assert not engine.runner.graphs.graphs and not engine.runner.graphs.failures
        finally:
            engine.close()
    for failing in (1, 99):
        assert [c.token_ids for c in outputs[failing]] == [c.token_ids for c in outputs[0]]


def test_unsupported_architectures_fall_back_with_a_log_line(caplog):
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    model = transformers.GPT2LMHeadModel(config)
    with caplog.at_level("WARNING", logger="tempering"):
        assert engine_model_for(model, 64) is None
    assert "falling back to the transformers engine" in caplog.text
