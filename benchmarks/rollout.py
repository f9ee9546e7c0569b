"""Rollout throughput: tempering's engine vs `model.generate` on the same model, in one run.

Prints one JSON line. On CPU (default): the default model (SmolLM2-135M-Instruct, fp32),
8 chat prompts × n=4, 64 new tokens. On GPU (`--device cuda`): a Qwen2.5-1.5B-shaped model with
random bf16 weights, 32 prompts × n=8, 128-token prompts, 256 new tokens. EOS is ignored so
every sample has exactly max_new_tokens tokens. Both are warmed up before timing, and the
device is synchronized before each clock read. Our engine returns the logprob of every sampled
token; `generate` returns only the tokens.

    python benchmarks/rollout.py                 # CPU
    python benchmarks/rollout.py --device cuda   # GPU
"""

from __future__ import annotations

import argparse
import json
import platform
import threading
import time

import torch

from tempering.chat import ChatRenderer
from tempering.engine import BasePolicy, Engine, EngineConfig, SamplingParams, engine_model_for


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def load_cpu_model(dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tempering.service.base_model import default_model_dir

    path = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model, tokenizer


def build_gpu_model(device: torch.device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    return model.eval(), None


def prompts_for(args, tokenizer, vocab: int, device_type: str) -> list[list[int]]:
    if tokenizer is not None:
        renderer = ChatRenderer(tokenizer)
        topics = ["the sea", "a robot", "the moon", "a city", "winter", "a dragon", "music", "a garden"]
        return [renderer.render_prompt([{"role": "user", "content": f"Tell me a long story about {t}."}])
                for t in topics[: args.num_prompts]]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, vocab - 100, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)]


def time_generate(model, prompts, args, device) -> float:
    rows = [p for p in prompts for _ in range(args.n)]
    width = max(len(p) for p in rows)
    pad = 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(rows):  # left padding
        input_ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                  min_new_tokens=args.max_new_tokens, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(input_ids=input_ids, attention_mask=mask, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        sync(device)
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=mask, **kwargs)
        sync(device)
        elapsed = time.perf_counter() - start
    assert out.shape[1] - width == args.max_new_tokens
    return elapsed


def time_engine(engine: Engine, prompts, args) -> tuple[float, list]:
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=1.0, ignore_eos=True)
    # warm-up with the same shapes (CUDA graphs, allocator), then drop the prefix cache's advantage
    # by timing fresh prompts' KV only through the real run
    for f in [engine.submit(p, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True), n=args.n, policy=BasePolicy()) for p in prompts]:
        f.result()
    engine.blocks.forget_cached()
    sync(engine.device)
    start = time.perf_counter()
    futures = [engine.submit(p, params, n=args.n, policy=BasePolicy()) for p in prompts]
    results = [f.result() for f in futures]
    sync(engine.device)
    elapsed = time.perf_counter() - start
    assert all(len(c.token_ids) == args.max_new_tokens for r in results for c in r)
    return elapsed, results


def logprob_error(model, prompts, results, device) -> tuple[float, float]:
    """Mean and max |engine logprob - transformers forward logprob| over a few samples."""
    diffs = []
    with torch.inference_mode():
        for p, r in list(zip(prompts, results))[:4]:
            c = r[0]
            ids = torch.tensor([p + c.token_ids], device=device)
            logits = model(ids).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits / c.logprob_temperature, -1).gather(1, torch.tensor(c.token_ids, device=device)[:, None])[:, 0]
            diffs.append((ref.cpu() - torch.tensor(c.logprobs)).abs())
    d = torch.cat(diffs)
    return float(d.mean()), float(d.max())


def adapter_switch(engine: Engine, model, prompts, results, holder: dict, args) -> dict:
    """How long after a training step the engine serves the new adapter.

    A LoRA trainer is attached to the same model (the engine reads its tensors). We time a
    1-token request right after a train step, and the same request with no step before it;
    the difference is the switch cost. The first use of the adapter also captures its CUDA
    graphs (reported apart).
    """
    from tempering.service.policies import AdapterPolicy
    from tempering.training import TokenizedSequence, Trainer
    from tempering.types import LoRAConfig, TrainConfig

    trainer = Trainer.new(model, LoRAConfig(rank=8, alpha=16))
    holder["peft"] = trainer.peft_model
    seqs = []
    for j, (p, r) in enumerate(zip(prompts[:8], results[:8])):
        c = r[0]
        seqs.append(TokenizedSequence(p + c.token_ids, [False] * len(p) + [True] * len(c.token_ids),
                                      [float("nan")] * len(p) + c.logprobs, advantage=1.0 if j % 2 else -1.0))
    config = TrainConfig(learning_rate=1e-5)
    probe = prompts[0][:32]

    def latency(version: int, train: bool) -> float:
        if train:
            with engine.lock:
                trainer.step(seqs, config)
        sync(engine.device)
        start = time.perf_counter()
        engine.submit(probe, SamplingParams(max_tokens=4, temperature=0), policy=AdapterPolicy(trainer.peft_model, "default", version)).result()
        return time.perf_counter() - start

    first_use = latency(1, train=True)  # includes capturing the adapter's CUDA graphs
    after, before = [], []
    for k in range(5):
        after.append(latency(100 + 2 * k, train=True))
        before.append(latency(101 + 2 * k, train=False))
    return {
        "adapter_first_use_ms": round(first_use * 1e3, 1),
        "adapter_switch_ms": round((sorted(after)[2] - sorted(before)[2]) * 1e3, 2),
        "request_latency_after_step_ms": round(sorted(after)[2] * 1e3, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--cpu-dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    args.num_prompts = args.num_prompts or (32 if gpu else 8)
    args.n = args.n or (8 if gpu else 4)
    args.max_new_tokens = args.max_new_tokens or (256 if gpu else 64)

    model, tokenizer = build_gpu_model(device) if gpu else load_cpu_model(getattr(torch, args.cpu_dtype))
    prompts = prompts_for(args, tokenizer, model.config.vocab_size, device.type)
    num_tokens = args.num_prompts * args.n * args.max_new_tokens

    baseline_s = None if args.skip_generate else time_generate(model, prompts, args, device)

    class _Tok:  # random-weight GPU model: no tokenizer; EOS ignored anyway
        def decode(self, ids, skip_special_tokens=True):
            return ""

    holder = {"peft": None}
    engine = Engine(
        engine_model_for(model, 4096),
        tokenizer or _Tok(),
        stop_token_ids=[0],
        lock=threading.RLock(),
        config=EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, cpu_kv_cache_bytes=1 << 30),
        max_seq_len=4096,
        peft_model=lambda: holder["peft"],
    )
    engine_s, results = time_engine(engine, prompts, args)
    lp_mean, lp_max = logprob_error(model, prompts, results, device)
    switch = adapter_switch(engine, model, prompts, results, holder, args)
    engine.close()

    ours = num_tokens / engine_s
    record = {
        "benchmark": "rollout",
        "device": args.device,
        "machine": machine(device),
        "model": "Qwen2.5-1.5B-shaped random bf16" if gpu else f"SmolLM2-135M-Instruct {args.cpu_dtype}",
        "workload": f"{args.num_prompts} prompts x n={args.n}, {args.max_new_tokens} new tokens",
        "tokens": num_tokens,
        "engine_s": round(engine_s, 3),
        "engine_tok_per_s": round(ours, 1),
        "engine_returns_logprobs": True,
        "generate_s": None if baseline_s is None else round(baseline_s, 3),
        "generate_tok_per_s": None if baseline_s is None else round(num_tokens / baseline_s, 1),
        "speedup_vs_generate": None if baseline_s is None else round(baseline_s / engine_s, 2),
        "logprob_abs_err_mean": lp_mean,
        "logprob_abs_err_max": lp_max,
        **switch,
        "torch": torch.__version__,
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
