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
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    model = cls(config).to(device=device, dtype=dtype).eval()
    with torch.no_grad():  # make q/k/v biases (Qwen2) non-trivial
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


DEVICES = [("cpu", torch.float32)] + ([("cuda", torch.bfloat16)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device,dtype", DEVICES, ids=[d for d, _ in DEVICES])
@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "mistral"])
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


def test_unsupported_architectures_fall_back_with_a_log_line(caplog):
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    model = transformers.GPT2LMHeadModel(config)
    with caplog.at_level("WARNING", logger="tempering"):
        assert engine_model_for(model, 64) is None
    assert "falling back to the transformers engine" in caplog.text
