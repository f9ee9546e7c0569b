"""The engine's Qwen3-MoE (engine/models/qwen3_moe.py) against transformers + PEFT, on tiny random models.

CPU (fp32) everywhere; the same checks run on CUDA in bf16 (grouped GEMMs, Triton attention,
CUDA graphs) when a GPU is present.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tempering.engine import BasePolicy, Engine, EngineConfig, SamplingParams, engine_model_for
from tempering.engine.models import Qwen3MoeModel

from test_models import AdapterPolicy, NullTokenizer, reference_logprobs, with_lora

DEVICES = [("cpu", torch.float32)] + ([("cuda", torch.bfloat16)] if torch.cuda.is_available() else [])
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_moe(device: str = "cpu", dtype: torch.dtype = torch.float32, **overrides):
    """3 layers (the middle one a dense MLP), 8 experts of which 2 per token, vocab 128."""
    import transformers

    config = transformers.Qwen3MoeConfig(**{
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 512, "mlp_only_layers": [1], "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, **overrides})
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).to(device=device, dtype=dtype).eval()


def engine_for(model, peft_model=lambda: None, **config) -> Engine:
    config = {"num_kv_blocks": 64, "block_size": 16, "max_num_batched_tokens": 64, **config}
    return Engine(engine_model_for(model, 512), NullTokenizer(), stop_token_ids=[0], lock=threading.RLock(),
                  config=EngineConfig(**config), max_seq_len=512, peft_model=peft_model)


def hf_routing(model, ids: list[int], device) -> list[torch.Tensor]:
    """Per MoE layer, transformers' router probabilities [T, E] of the sequence `ids`."""
    probs, hooks = [], []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and not isinstance(gate, torch.nn.Linear):
            hooks.append(gate.register_forward_hook(lambda m, i, out: probs.append(torch.softmax(out[0].float(), -1))))
    try:
        with torch.no_grad():
            model(torch.tensor([ids], device=device))
    finally:
        for h in hooks:
            h.remove()
    return probs


@pytest.mark.parametrize("device,dtype", DEVICES, ids=[d for d, _ in DEVICES])
def test_engine_greedy_tokens_and_logprobs_match_transformers(device, dtype):
    model, reference = tiny_moe(device, dtype), tiny_moe(device, dtype)
    assert isinstance(engine_model_for(model, 512), Qwen3MoeModel)
    engine = engine_for(model)
    try:
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 40, 77)]  # 77 > 64: chunked prefill
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        futures = [engine.submit(p, params, n=2, policy=BasePolicy()) for p in prompts]
        tol = 1e-4 if dtype == torch.float32 else 0.1
        for p, f in zip(prompts, futures):
            a, b = f.result(timeout=300)
            assert a.token_ids == b.token_ids and a.routed_experts is None  # not asked for
            with torch.no_grad():
                logits = reference(torch.tensor([p + a.token_ids], device=device)).logits[0, len(p) - 1:-1].float()
            expected = torch.log_softmax(logits, -1)
            chosen = expected.gather(1, torch.tensor(a.token_ids, device=device)[:, None])[:, 0].cpu()
            assert (chosen - torch.tensor(a.logprobs)).abs().max() < tol
            if dtype == torch.float32:
                assert a.token_ids == expected.argmax(-1).tolist()
    finally:
        engine.close()


@pytest.mark.parametrize("device,dtype", DEVICES, ids=[d for d, _ in DEVICES])
def test_engine_returns_the_experts_transformers_routes_each_token_to(device, dtype):
    """routed_experts: [prompt + completion - 1, MoE layers, k], the same experts as transformers'
    router chooses for the whole sequence, also for a prompt the second sample took from the prefix cache."""
    model = tiny_moe(device, dtype)
    engine = engine_for(model)
    try:
        prompt = torch.randint(1, 128, (37,), generator=torch.Generator().manual_seed(2)).tolist()
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, return_routed_experts=True)
        first = engine.submit(prompt, params, policy=BasePolicy()).result(timeout=300)[0]
        second = engine.submit(prompt, params, policy=BasePolicy()).result(timeout=300)[0]  # 2 blocks cached
        assert engine.stats.num_cached_tokens >= 32
        for c in (first, second):
            ids = prompt + c.token_ids
            assert c.routed_experts.shape == (len(ids) - 1, 2, 2) and str(c.routed_experts.dtype) == "uint8"
            for layer, probs in enumerate(hf_routing(model, ids, device)):
                top = probs[:-1].topk(3, dim=-1)
                expected = top.indices[:, :2].sort(-1).values.cpu()
                theirs = torch.from_numpy(c.routed_experts[:, layer]).long().sort(-1).values
                differs = (expected != theirs).any(-1)
                # only where the 2nd and 3rd experts' probabilities are within rounding of each other
                gap = (top.values[:, 1] - top.values[:, 2]).cpu()
                assert (gap[differs] < (1e-4 if dtype == torch.float32 else 2e-2)).all()
                assert differs.float().mean() < (0.02 if dtype == torch.float32 else 0.2)
    finally:
        engine.close()


def test_a_sample_preempted_while_its_last_token_is_sampled_returns_its_experts():
    """The KV cache holds 3 blocks: y's first decode needs the block x holds, so x (prompt of 17,
    one new token) is preempted while that token is being sampled, and finishes with it, its
    blocks already freed. Its routed experts are the ones kept at the preemption (an IndexError
    reading freed slots failed every request before)."""
    model = tiny_moe()
    engine = engine_for(model, num_kv_blocks=4)
    try:
        y = engine.submit(list(range(1, 17)), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                          policy=BasePolicy())
        prompt = list(range(30, 47))
        x = engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0, return_routed_experts=True),
                          policy=BasePolicy())
        [routed], [other] = x.result(timeout=60), y.result(timeout=60)
        assert engine.stats.num_preemptions >= 1 and len(other.token_ids) == 20
        alone = engine_for(tiny_moe())
        try:
            [expected] = alone.submit(prompt, SamplingParams(max_tokens=1, temperature=0, return_routed_experts=True),
                                      policy=BasePolicy()).result(timeout=60)
        finally:
            alone.close()
        assert routed.token_ids == expected.token_ids
        assert (routed.routed_experts == expected.routed_experts).all() and routed.routed_experts.shape == (17, 2, 2)
    finally:
        engine.close()


@pytest.mark.filterwarnings("ignore:.*_pattern keys did not match any targeted module")  # PEFT's own fused-expert patterns
@pytest.mark.parametrize("device,dtype", DEVICES, ids=[d for d, _ in DEVICES])
def test_engine_with_a_live_expert_lora_matches_peft_and_follows_in_place_updates(device, dtype):
    """LoRA on attention and on every expert's gate/up and down (PEFT target_parameters, which ART's
    target modules become): greedy tokens and logprobs equal transformers + PEFT, before and after
    the adapter changes in place (the optimizer); base and adapter rows can share a batch."""
    model = tiny_moe(device, dtype)
    engine = engine_for(model, peft_model=lambda: peft_model)
    peft_model = with_lora(model, ALL)
    experts = peft_model.base_model.model.model.layers[0].mlp.experts
    assert {experts.parameter_name, experts.base_layer.parameter_name} == {"gate_up_proj", "down_proj"}
    try:
        prompt = torch.randint(1, 128, (29,), generator=torch.Generator().manual_seed(4)).tolist()
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        tol = 1e-4 if dtype == torch.float32 else 0.1
        for update in range(2):
            with engine._cond:  # held back so that both requests share the batch
                live = engine.submit(prompt, params, policy=AdapterPolicy("default", update))
                base = engine.submit(prompt, params, policy=BasePolicy())
            for name, c in (("default", live.result(timeout=300)[0]), (None, base.result(timeout=300)[0])):
                expected = reference_logprobs(peft_model, name, prompt, c.token_ids, device)
                chosen = expected.gather(1, torch.tensor(c.token_ids, device=device)[:, None])[:, 0].cpu()
                assert (chosen - torch.tensor(c.logprobs)).abs().max() < tol, (name, update)
            assert live.result()[0].logprobs != base.result()[0].logprobs
            with torch.no_grad():  # the optimizer's in-place step
                for n, p in peft_model.named_parameters():
                    if "experts" in n and "lora_B" in n:
                        p.mul_(2.0)
    finally:
        engine.close()


@pytest.mark.filterwarnings("ignore:.*_pattern keys did not match any targeted module")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_moe_decode_graphs_sample_what_the_eager_steps_sample():
    """CUDA graphs of MoE decode steps (grouped GEMMs with device offsets, routing writes) replay the
    eager steps' tokens, logprobs and routed experts, with the live expert LoRA."""
    prompts = [torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 33, 50)]
    outputs = {}
    for use_graphs in (True, False):
        model = tiny_moe("cuda", torch.bfloat16)
        peft_model = with_lora(model, ALL)
        engine = engine_for(model, peft_model=lambda peft_model=peft_model: peft_model, use_cuda_graphs=use_graphs)
        try:
            params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True, return_routed_experts=True)
            outputs[use_graphs] = [c for r in [engine.submit(p, params, n=4, policy=AdapterPolicy("default"))
                                               for p in prompts] for c in r.result(timeout=300)]
            if use_graphs:
                assert any(c is not None for c in engine.runner.graphs.graphs.values())
        finally:
            engine.close()
    for a, b in zip(outputs[True], outputs[False]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
        assert (a.routed_experts == b.routed_experts).mean() > 0.99


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rank", [8, 16])
def test_the_expert_lora_kernels_add_what_the_grouped_gemms_add(dtype, rank):
    """engine/layers/triton_moe_lora.py against modeling.experts._add_delta_ (per-expert products),
    experts with no rows and with more rows than a tile included, with and without a row mask."""
    from tempering.engine.layers.triton_moe_lora import moe_lora_add_
    from tempering.modeling.experts import _add_delta_, sort_by_expert

    g = torch.Generator(device="cuda").manual_seed(rank)
    E, K, N, tokens, k = 16, 200, 300, 40, 4
    ids = torch.randint(0, E - 2, (tokens, k), device="cuda", generator=g)  # experts E-2, E-1: no rows
    ids[:20, 0] = 3  # expert 3: more than a 16-row tile
    batch = sort_by_expert(ids, E, host_counts=False)
    x = torch.randn(tokens * k, K, device="cuda", generator=g).to(dtype)
    lora = (torch.randn(E, rank, K, device="cuda", generator=g).to(dtype) * 0.1,
            torch.randn(E, N, rank, device="cuda", generator=g).to(dtype) * 0.1)
    y = torch.randn(tokens * k, N, device="cuda", generator=g).to(dtype)
    rows = torch.rand(tokens, device="cuda", generator=g) < 0.5
    for mask in (None, rows):
        expected = _add_delta_(y.clone(), x, lora, batch, mask, impl="loop")
        got = moe_lora_add_(y.clone(), x, lora, batch, mask)
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        else:  # t and the delta rounded to bfloat16 after sums taken in another order: a last-bit difference at most
            assert ((got.float() - expected.float()).abs() <= 2 * expected.float().abs() * 2 ** -8 + 1e-2).all()
            assert (got == expected).float().mean() > 0.9
        if mask is not None:  # the rows of tokens the adapter does not serve are y's own
            untouched = ~mask[batch.token]
            assert torch.equal(got[untouched], y[untouched])


@pytest.mark.parametrize("device,dtype", DEVICES, ids=[d for d, _ in DEVICES])
def test_a_prefix_copied_back_from_the_host_tier_keeps_its_kv_and_routed_experts(device, dtype):
    """The cache holds one prompt; the second evicts the first into the host tier (pinned memory
    on CUDA). The first, sent again, is copied back, K/V and the experts each token was routed to:
    the same tokens, logprobs and experts as its first time."""
    model = tiny_moe(device, dtype)
    engine = engine_for(model, num_kv_blocks=5, kv_offloading_size=0.001)
    try:
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, return_routed_experts=True)
        a, b = list(range(1, 50)), list(range(60, 109))
        [first] = engine.submit(a, params, policy=BasePolicy()).result(timeout=60)
        engine.submit(b, params, policy=BasePolicy()).result(timeout=60)
        [again] = engine.submit(a, params, policy=BasePolicy()).result(timeout=60)
        assert engine.stats.num_restored_tokens >= 32
        assert again.token_ids == first.token_ids
        # its last prompt token alone now (a different batch shape): equal on CPU, within bf16 on CUDA
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert max(abs(x - y) for x, y in zip(again.logprobs, first.logprobs)) <= tol
        assert (again.routed_experts == first.routed_experts).all()
    finally:
        engine.close()
