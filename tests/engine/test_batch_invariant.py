"""Batch-invariant mode: a token's logprob does not depend on its batch, and scoring a sampled
sequence afterwards (Engine.score, one prefill) returns the sampled logprobs bit for bit (CUDA);
the CPU twin agrees to float32 rounding. The Llama family (Qwen2 here), Gemma 3, whose local
layers' 16-token window the sequences outgrow, and Qwen3-MoE with LoRA on every expert (a
token's experts, and each expert's rows, change with its batch)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_models import DEVICES, AdapterPolicy, NullTokenizer, tiny, with_lora
from test_qwen3_moe import tiny_moe

from tempering.engine import Engine, EngineConfig, SamplingParams, engine_model_for
from tempering.errors import ConfigError


def _engine(device, dtype, *, batch_invariant=True, arch="qwen2"):
    model = tiny_moe(device, dtype) if arch == "qwen3_moe" else tiny(arch, device, dtype)
    holder = {}
    engine = Engine(engine_model_for(model, 512, batch_invariant=batch_invariant), NullTokenizer(), stop_token_ids=[0],
                    lock=threading.RLock(), max_seq_len=512, peft_model=lambda: holder.get("peft"),
                    config=EngineConfig(num_kv_blocks=128, block_size=16, max_num_batched_tokens=64,
                                        batch_invariant=batch_invariant))
    holder["peft"] = with_lora(model, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    return engine


ARCHS = ["qwen2", "gemma3", "qwen3_moe"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("device,dtype", DEVICES[:2], ids=[d for d, _ in DEVICES[:2]])
def test_scoring_sampled_sequences_returns_their_sampled_logprobs(device, dtype, arch):
    engine = _engine(device, dtype, arch=arch)
    try:
        g = torch.Generator().manual_seed(3)
        # 77 > 64: a chunked prefill; 130: rows whose window starts past the first 64-key tile
        prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 40, 77, 130)]
        policy = AdapterPolicy("default")
        futures = [engine.submit(p, SamplingParams(max_tokens=20, temperature=1.0, seed=i, ignore_eos=True), n=3,
                                 policy=policy) for i, p in enumerate(prompts)]
        samples = [(p, c) for p, f in zip(prompts, futures) for c in f.result(timeout=300)]
        scored = engine.score([p + c.token_ids for p, c in samples],
                              [[1.0] * (len(p) + len(c.token_ids)) for p, c in samples], policy)
        for (p, c), values in zip(samples, scored):
            got = torch.tensor(values[len(p) - 1:])
            want = torch.tensor(c.logprobs)
            if device.startswith("cuda"):
                assert torch.equal(got, want), (got - want).abs().max()
            else:
                assert (got - want).abs().max() < 1e-4
    finally:
        engine.close()


@pytest.mark.filterwarnings("ignore:.*_pattern keys did not match any targeted module")
@pytest.mark.parametrize("device,dtype", DEVICES[:2], ids=[d for d, _ in DEVICES[:2]])
def test_scoring_a_moe_sample_routes_it_as_given(device, dtype):
    """A rescored Qwen3-MoE sample routes as the trainer replays it (`routed_experts`): with its sampled
    routing the scores are its sampled logprobs, with other experts they are another function's."""
    engine = _engine(device, dtype, arch="qwen3_moe")
    try:
        prompt = torch.randint(1, 128, (40,), generator=torch.Generator().manual_seed(5)).tolist()
        params = SamplingParams(max_tokens=20, temperature=1.0, seed=2, ignore_eos=True, return_routed_experts=True)
        policy = AdapterPolicy("default")
        c = engine.submit(prompt, params, policy=policy).result(timeout=300)[0]
        ids = prompt + c.token_ids
        sampled = np.concatenate([c.routed_experts.astype(np.int64), np.full((1, 2, 2), -1)])  # the last token: unfed
        other = np.where(sampled >= 0, (sampled + 1) % 8, -1)
        temps = [[1.0] * len(ids)]
        same, shifted = (engine.score([ids], temps, policy, routed_experts=[r])[0][len(prompt) - 1:]
                         for r in (sampled, other))
        if device.startswith("cuda"):
            assert same == c.logprobs
        else:
            assert max(abs(a - b) for a, b in zip(same, c.logprobs)) < 1e-4
        assert max(abs(a - b) for a, b in zip(shifted, c.logprobs)) > 1e-3  # 1e-2 on this tiny model
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_sequences_tokens_and_logprobs_do_not_depend_on_its_batch(arch):
    engine = _engine("cuda", torch.bfloat16, arch=arch)
    try:
        prompt = torch.randint(1, 128, (33,), generator=torch.Generator().manual_seed(1)).tolist()
        others = [torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 90, 51)]
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
        policy = AdapterPolicy("default")
        alone = engine.submit(prompt, params, policy=policy).result(timeout=300)[0]
        crowd = [engine.submit(o, SamplingParams(max_tokens=30, temperature=1.0, seed=5, ignore_eos=True), n=8,
                               policy=policy) for o in others]
        together = engine.submit(prompt, params, policy=policy)
        for f in crowd:
            f.result(timeout=300)
        together = together.result(timeout=300)[0]
        assert together.token_ids == alone.token_ids and together.logprobs == alone.logprobs
    finally:
        engine.close()


def test_batch_invariant_mode_is_refused_for_a_model_it_does_not_cover():
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128))
    with pytest.raises(ConfigError, match="batch_invariant .* covers .*GPT2LMHeadModel is not"):
        engine_model_for(gpt2, 512, batch_invariant=True)
